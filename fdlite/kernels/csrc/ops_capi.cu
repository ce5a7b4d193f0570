// A few plain C entry points of the ops library, called through ctypes: CUDA events of our own
// runtime on Paddle's stream (Paddle 2.6.2's Event.elapsed_time is a stub returning 0), host-to-device
// copies for the runner's per-step inputs, the run-time switches, and the library's version, so a stale
// cached build is noticed. No Paddle headers.
#include <cuda_runtime.h>
#include <stdint.h>

#include "ops_options.h"

#define FDL_API extern "C" __attribute__((visibility("default")))

FDL_API int fdl_ops_abi_version(void) { return 9; }

// The switches of fdlite/envs.py the kernels follow (the C++ side reads no environment): pdl = FDLITE_PDL
// (0, 1 or 2: see fdl::Options), gemv = FDLITE_GEMV, attn_mma = FDLITE_ATTN_MMA (0 or 1). Called by
// fdlite/kernels/gpu.py when it loads the library, before any op runs (and by `gpu.set_options`: launches
// after the call follow it, graphs keep what they captured). Returns 0, or 1 for a pdl outside 0..2
// (nothing changed).
FDL_API int fdl_set_options(int pdl, int gemv, int attn_mma) {
  if (pdl < 0 || pdl > 2) return 1;
  fdl::options().pdl = pdl;
  fdl::options().gemv = gemv != 0;
  fdl::options().attn_mma = attn_mma != 0;
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
