// A few plain C entry points of the ops library, called through ctypes: CUDA events of our own
// runtime on Paddle's stream (Paddle 2.6.2's Event.elapsed_time is a stub returning 0), host-to-device
// copies for the runner's per-step inputs, the run-time switches, and the library's version, so a stale
// cached build is noticed. No Paddle headers.
#include <cuda_runtime.h>
#include <stdint.h>

#include <cstring>

#include "ops_options.h"

#define FDL_API extern "C" __attribute__((visibility("default")))

FDL_API int fdl_ops_abi_version(void) { return 15; }

// The switches of fdlite/envs.py the kernels follow (the C++ side reads no environment): pdl = FDLITE_PDL
// (0, 1 or 2: see fdl::Options), gemv = FDLITE_GEMV, attn_mma = FDLITE_ATTN_MMA (0, 1 or 2), decode_mma =
// FDLITE_DECODE_MMA, decode_split_keys = FDLITE_DECODE_SPLIT_KEYS. Called by fdlite/kernels/gpu.py when it loads the library,
// before any op runs (and by `gpu.set_options`: launches after the call follow it, graphs keep what they captured).
// Returns 0, 1 for a pdl or attn_mma outside 0..2, 2 for a decode_split_keys that is not a multiple of 64 in [0, 4096]
// (nothing changed).
FDL_API int fdl_set_options(int pdl, int gemv, int attn_mma, int decode_mma, int decode_split_keys) {
  if (pdl < 0 || pdl > 2 || attn_mma < 0 || attn_mma > 2) return 1;
  if (decode_split_keys < 0 || decode_split_keys > 4096 || decode_split_keys % 64 != 0) return 2;
  fdl::options().pdl = pdl;
  fdl::options().gemv = gemv != 0;
  fdl::options().attn_mma = attn_mma;
  fdl::options().decode_mma = decode_mma != 0;
  fdl::options().decode_split_keys = decode_split_keys;
  return 0;
}

FDL_API void* fdl_event_create(void) {
  cudaEvent_t e = nullptr;
  return cudaEventCreate(&e) == cudaSuccess ? (void*)e : nullptr;
}

FDL_API int fdl_event_record(void* e, void* stream) { return (int)cudaEventRecord((cudaEvent_t)e, (cudaStream_t)stream); }

// Milliseconds between two recorded events (waits for `end`); negative on error.
FDL_API float fdl_event_elapsed_ms(void* start, void* end) {
  if (cudaEventSynchronize((cudaEvent_t)end) != cudaSuccess) return -1.f;
  float ms = -1.f;
  if (cudaEventElapsedTime(&ms, (cudaEvent_t)start, (cudaEvent_t)end) != cudaSuccess) return -2.f;
  return ms;
}

FDL_API int fdl_event_destroy(void* e) { return (int)cudaEventDestroy((cudaEvent_t)e); }

// Pinned host memory (page-locked: a device -> host copy into it is asynchronous) and its release.
FDL_API void* fdl_host_alloc(size_t bytes) {
  void* p = nullptr;
  return cudaHostAlloc(&p, bytes, cudaHostAllocDefault) == cudaSuccess ? p : nullptr;
}

FDL_API int fdl_host_free(void* p) { return (int)cudaFreeHost(p); }

// Device -> host copy on `stream` into pinned memory, then `event` recorded after it: the caller waits on the
// event (fdl_event_synchronize) when it needs the values, and the stream runs on meanwhile.
FDL_API int fdl_memcpy_d2h_async(void* dst, const void* src, size_t bytes, void* stream, void* event) {
  const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, (cudaStream_t)stream);
  if (e != cudaSuccess) return (int)e;
  return (int)cudaEventRecord((cudaEvent_t)event, (cudaStream_t)stream);
}

// Blocks the calling host thread until `event` completed (ctypes releases the GIL meanwhile).
FDL_API int fdl_event_synchronize(void* e) { return (int)cudaEventSynchronize((cudaEvent_t)e); }

// Synchronous device -> host copy through our runtime (the harness checks data_ptr() with it).
FDL_API int fdl_memcpy_d2h(void* dst, const void* src, size_t bytes) {
  return (int)cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
}

// Host -> device copy on `stream` (the runner's per-step inputs into its persistent buffers). Through
// ctypes this costs a few microseconds, against about 35 for a host Paddle tensor plus a copy op. From
// pageable memory the runtime stages the source before returning, so the caller may reuse it at once.
FDL_API int fdl_memcpy_h2d_async(void* dst, const void* src, size_t bytes, void* stream) {
  return (int)cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, (cudaStream_t)stream);
}

// n host -> device copies in one call: t holds n destinations, then n sources, then n byte counts (the
// runner's step inputs: one ctypes call for all its buffers). Returns the first error, 0 if none.
FDL_API int fdl_memcpy_h2d_many(int n, const uint64_t* t, void* stream) {
  for (int i = 0; i < n; ++i) {
    const cudaError_t e = cudaMemcpyAsync(reinterpret_cast<void*>(t[i]), reinterpret_cast<const void*>(t[n + i]),
                                          (size_t)t[2 * n + i], cudaMemcpyHostToDevice, (cudaStream_t)stream);
    if (e != cudaSuccess) return (int)e;
  }
  return 0;
}

// The same n copies staged through `pinned` (page-locked, pinned_bytes long, the caller's slot of a ring): each
// source is copied there on the host (16-byte aligned pieces), the device copies read it from there, and `done` is
// recorded after them. Why: from pageable memory the runtime may first wait for the stream to drain before it
// stages the copy, which holds the calling thread until the GPU has finished the step before (async scheduling
// then launches each step only after the previous one ended: measured, docs/benchmarks.md); from pinned memory
// the call returns at once. The caller leaves `pinned` alone until `done` fired. While the stream captures a
// graph the copies go straight from the sources (a captured copy must not read a slot later steps rewrite).
// Returns the first CUDA error, -1 when the pieces do not fit pinned_bytes (nothing queued), 0 if fine.
FDL_API int fdl_memcpy_h2d_many_pinned(int n, const uint64_t* t, void* stream, void* pinned, size_t pinned_bytes,
                                       void* done) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing((cudaStream_t)stream, &cs);
  if (e != cudaSuccess) return (int)e;
  if (cs != cudaStreamCaptureStatusNone) return fdl_memcpy_h2d_many(n, t, stream);
  size_t need = 0;
  for (int i = 0; i < n; ++i) need += ((size_t)t[2 * n + i] + 15) / 16 * 16;
  if (need > pinned_bytes) return -1;
  char* base = static_cast<char*>(pinned);
  size_t off = 0;
  for (int i = 0; i < n; ++i) {
    const size_t bytes = (size_t)t[2 * n + i];
    std::memcpy(base + off, reinterpret_cast<const void*>(t[n + i]), bytes);
    e = cudaMemcpyAsync(reinterpret_cast<void*>(t[i]), base + off, bytes, cudaMemcpyHostToDevice, (cudaStream_t)stream);
    if (e != cudaSuccess) return (int)e;
    off += (bytes + 15) / 16 * 16;
  }
  return (int)cudaEventRecord((cudaEvent_t)done, (cudaStream_t)stream);
}
