// Device side of fdlite's custom all-reduce across the GPUs of one host.
//
// Hand-written because no GPU build of Paddle runs on the machines we verify on
// (PyPI's paddlepaddle-gpu has no sm_90 code), and because NCCL's fixed launch and
// protocol costs dominate the small all-reduces of tensor-parallel decoding. Every
// rank maps every peer's "shared" buffer (signal flags + staging area) into its own
// address space (CUDA IPC across processes, or plain pointers when the ranks live in
// one process) and reads the peers' data directly over NVLink / P2P.
//
// Ordering between ranks uses per-block flags, not host synchronisation. Each
// launch takes a fresh epoch from a counter kept in device memory (not a kernel
// argument), so a captured CUDA graph, whose arguments are frozen, can be replayed
// any number of times, interleaved with eager launches, without stale flags.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace fdar {

constexpr int kMaxWorld = 8;
constexpr int kMaxBlocks = 64;
constexpr int kThreads = 512;
// Three flag arrays: start (inputs ready), mid (two-shot partial sums ready),
// end (done reading peers; they may reuse their buffers).
constexpr int kPhases = 3;
enum Phase { kStart = 0, kMid = 1, kEnd = 2 };

// Error bits a kernel can leave in Signal::error (read back by the host).
constexpr uint32_t kErrUnregistered = 1u;  // graph replayed before its buffers were registered
constexpr uint32_t kErrSpinTimeout = 2u;   // a peer never arrived (debug builds trap after this)

// Lives at the start of each rank's shared allocation. flags[phase][block][peer] is
// written by `peer` (remotely) and polled by the owner.
struct alignas(128) Signal {
  uint32_t flags[kPhases][kMaxBlocks][kMaxWorld];
  uint32_t epoch[kMaxBlocks];  // launches seen by each block slot; owner-only
  uint32_t error;
  // Every rank's Signal as mapped here, written by the host once peers are known. The
  // barrier indexes it by thread; a by-value kernel parameter indexed at run time would
  // be copied to local memory by every thread.
  Signal* peer[kMaxWorld];
};

// One registered buffer: its address on every rank, indexed by rank.
struct RankPtrs {
  const void* p[kMaxWorld];
};

// What each rank knows about the group, passed by value (fixed once peers are open);
// only ever indexed by compile-time constants (unrolled loops over W).
struct Peers {
  Signal* sig[kMaxWorld];
  char* staging[kMaxWorld];
};

// This rank's own pieces, passed by value next to Peers.
struct Self {
  Signal* sig;
  uint4* staging;
  int rank;
};

// ---- memory-model helpers -------------------------------------------------------

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Peer data is read with .cg (L2, not the SM's L1): on a single-GPU simulation another
// rank's block on the same SM may have left a stale copy of that line in L1.
__device__ __forceinline__ uint4 ld_peer(const uint4* p) { return __ldcg(p); }
__device__ __forceinline__ uint32_t ld_peer(const uint32_t* p) { return __ldcg(p); }

__device__ __forceinline__ void spin_until(const uint32_t* flag, uint32_t want, Signal* self) {
#ifdef FDAR_SPIN_TIMEOUT_NS
  uint64_t t0 = 0;
  int n = 0;
#endif
  while (ld_acquire_sys(flag) != want) {
#ifdef FDAR_SPIN_TIMEOUT_NS
    // A debug aid, not a protocol: a peer that never arrives (mismatched calls, a
    // graph replayed on one rank only) becomes a trap instead of a hung GPU.
    if ((++n & 1023) == 0) {
      const uint64_t t = global_ns();
      if (t0 == 0) {
        t0 = t;
      } else if (t - t0 > (uint64_t)(FDAR_SPIN_TIMEOUT_NS)) {
        atomicOr(&self->error, kErrSpinTimeout);
        __threadfence_system();
        __trap();
      }
    }
#endif
  }
}

// Every block of every rank meets its same-index block on each peer. Thread p < W
// posts our arrival into peer p's flag and waits for peer p's arrival in ours.
// The __syncthreads before the release makes all of this block's earlier writes
// (staging copy, partial sums) part of what the release publishes. `peer` is
// Signal::peer[threadIdx.x], loaded once per launch.
template <int W>
__device__ __forceinline__ void block_barrier(const Self& me, Signal* peer, int phase, uint32_t e) {
  __syncthreads();
  if (threadIdx.x < W) {
    st_release_sys(&peer->flags[phase][blockIdx.x][me.rank], e);
    spin_until(&me.sig->flags[phase][blockIdx.x][threadIdx.x], e, me.sig);
  }
  __syncthreads();
}

// ---- 16-byte packs ------------------------------------------------------------------

template <typename T>
struct Pack;  // how many T in 16 bytes, and how to widen / narrow them

template <>
struct Pack<float> {
  static constexpr int N = 4;
  __device__ static void load(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  __device__ static uint4 store(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
};

template <>
struct Pack<__half> {
  static constexpr int N = 8;
  __device__ static void load(const uint4& v, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 t = __half22float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
  __device__ static uint4 store(const float* f) {
    uint4 v;
    __half2* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    return v;
  }
};

template <>
struct Pack<__nv_bfloat16> {
  static constexpr int N = 8;
  __device__ static void load(const uint4& v, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 t = __bfloat1622float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
  __device__ static uint4 store(const float* f) {
    uint4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return v;
  }
};

// Sum of W packs in rank order 0..W-1, in fp32, rounded once: every rank sums in
// the same order, so all ranks get bit-identical results.
template <typename T, int W>
__device__ __forceinline__ uint4 reduce_packs(const uint4 (&v)[W]) {
  float acc[Pack<T>::N];
  Pack<T>::load(v[0], acc);
#pragma unroll
  for (int p = 1; p < W; ++p) {
    float t[Pack<T>::N];
    Pack<T>::load(v[p], t);
#pragma unroll
    for (int k = 0; k < Pack<T>::N; ++k) acc[k] += t[k];
  }
  return Pack<T>::store(acc);
}

// Where this launch reads inputs from. `slot` (a registered RankPtrs in device
// memory) is used for registered and graph-captured buffers; null means our staging
// buffers. A slot still all-null is a graph replayed before registration: flag it and
// move no data, but keep taking part in the barriers so peers do not hang.
template <int W>
__device__ __forceinline__ bool input_ptrs(const Peers& P, const Self& me, const RankPtrs* slot,
                                           const uint4* (&src)[W]) {
  bool ok = true;
#pragma unroll
  for (int p = 0; p < W; ++p) {
    src[p] = slot ? reinterpret_cast<const uint4*>(slot->p[p])
                  : reinterpret_cast<const uint4*>(P.staging[p]);
    ok = ok && src[p] != nullptr;
  }
  if (!ok && blockIdx.x == 0 && threadIdx.x == 0) atomicOr(&me.sig->error, kErrUnregistered);
  return ok;
}

// ---- kernels --------------------------------------------------------------------------
// Work is in 16-byte vectors. Block b always handles the same vector indices (within
// the whole tensor for one-shot, within each rank's chunk for two-shot) in every
// phase, so block b only ever waits on block b of its peers.

// One-shot: every rank reads the whole tensor from every peer. Lowest latency.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    one_shot_kernel(Peers P, Self me, const RankPtrs* slot, const uint4* copy_src, uint4* out,
                    int64_t n_vec) {
  const uint32_t e = me.sig->epoch[blockIdx.x] + 1;
  Signal* peer = threadIdx.x < W ? me.sig->peer[threadIdx.x] : nullptr;
  const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  if (copy_src) {  // staging mode: publish our input (fused copy saves a launch)
    for (int64_t i = first; i < n_vec; i += stride) me.staging[i] = copy_src[i];
  }
  const uint4* src[W];
  const bool ok = input_ptrs<W>(P, me, slot, src);
  block_barrier<W>(me, peer, kStart, e);
  if (ok) {
    for (int64_t i = first; i < n_vec; i += stride) {
      uint4 v[W];
#pragma unroll
      for (int p = 0; p < W; ++p) v[p] = ld_peer(src[p] + i);
      out[i] = reduce_packs<T, W>(v);
    }
  }
  block_barrier<W>(me, peer, kEnd, e);
  if (threadIdx.x == 0) me.sig->epoch[blockIdx.x] = e;
}

// Two-shot: reduce-scatter (rank r sums chunk r from all peers into its staging
// buffer), then all-gather (every rank copies every chunk's sum). Each rank moves
// 2(W-1)/W of the tensor over the links instead of (W-1): better for large messages.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    two_shot_kernel(Peers P, Self me, const RankPtrs* slot, const uint4* copy_src, uint4* out,
                    int64_t n_vec) {
  const uint32_t e = me.sig->epoch[blockIdx.x] + 1;
  Signal* peer = threadIdx.x < W ? me.sig->peer[threadIdx.x] : nullptr;
  const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t chunk = (n_vec + W - 1) / W;
  auto chunk_len = [&](int q) -> int64_t {
    const int64_t b = (int64_t)q * chunk;
    return b >= n_vec ? 0 : (n_vec - b < chunk ? n_vec - b : chunk);
  };
  uint4* mine = me.staging;
  if (copy_src) {  // same per-chunk index mapping as the reads below
#pragma unroll
    for (int q = 0; q < W; ++q) {
      const int64_t base = (int64_t)q * chunk, len = chunk_len(q);
      for (int64_t j = first; j < len; j += stride) mine[base + j] = copy_src[base + j];
    }
  }
  const uint4* src[W];
  const bool ok = input_ptrs<W>(P, me, slot, src);
  block_barrier<W>(me, peer, kStart, e);
  if (ok) {  // reduce-scatter: our chunk's sum goes into our staging buffer
    const int64_t base = (int64_t)me.rank * chunk, len = chunk_len(me.rank);
    for (int64_t j = first; j < len; j += stride) {
      uint4 v[W];
#pragma unroll
      for (int p = 0; p < W; ++p) v[p] = ld_peer(src[p] + base + j);
      mine[base + j] = reduce_packs<T, W>(v);
    }
  }
  block_barrier<W>(me, peer, kMid, e);
  if (ok) {  // all-gather from every rank's staging buffer
#pragma unroll
    for (int q = 0; q < W; ++q) {
      const uint4* s = reinterpret_cast<const uint4*>(P.staging[q]);
      const int64_t base = (int64_t)q * chunk, len = chunk_len(q);
      for (int64_t j = first; j < len; j += stride) out[base + j] = ld_peer(s + base + j);
    }
  }
  block_barrier<W>(me, peer, kEnd, e);
  if (threadIdx.x == 0) me.sig->epoch[blockIdx.x] = e;
}

// Gather through the staging buffers: every rank publishes `rows` rows of `in_row`
// units (16 or 4 bytes each, U) into its own staging buffer; after the barrier each rank
// writes the rows of the `src_count` ranks from `src_first` on side by side: unit c of
// rank p's row r goes to column p * in_row + c of output row r (row length out_row, which
// may cut the last rank's columns: the vocabulary padding of a tensor-parallel LM head).
// All-gather: src_first 0, src_count W. Broadcast: only the root publishes, src_count 1.
// No reduction: the bytes move unchanged, so every rank's copy is identical.
template <typename U, int W>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(Peers P, Self me, const U* in, U* out, int64_t rows, int64_t in_row,
                  int64_t out_row, int src_first, int src_count) {
  const uint32_t e = me.sig->epoch[blockIdx.x] + 1;
  Signal* peer = threadIdx.x < W ? me.sig->peer[threadIdx.x] : nullptr;
  const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t n = rows * in_row;
  U* mine = reinterpret_cast<U*>(me.staging);
  if (in) {
    for (int64_t i = first; i < n; i += stride) mine[i] = in[i];
  }
  block_barrier<W>(me, peer, kStart, e);
  for (int q = 0; q < src_count; ++q) {
    const int p = src_first + q;
    const U* s = reinterpret_cast<const U*>(P.staging[0]);
#pragma unroll
    for (int k = 1; k < W; ++k) s = k == p ? reinterpret_cast<const U*>(P.staging[k]) : s;  // constant-indexed Peers
    const int64_t col0 = (int64_t)q * in_row;
    for (int64_t i = first; i < n; i += stride) {
      const int64_t r = i / in_row, c = col0 + i % in_row;
      if (c < out_row) out[r * out_row + c] = ld_peer(s + i);
    }
  }
  block_barrier<W>(me, peer, kEnd, e);
  if (threadIdx.x == 0) me.sig->epoch[blockIdx.x] = e;
}

}  // namespace fdar

// ---- host side (implemented in custom_all_reduce.cu) ---------------------------------
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fdar {

// Failure with a code for the C ABI: a cudaError_t or one of FDAR_E_*.
struct Error : std::runtime_error {
  int code;
  Error(int c, const std::string& what) : std::runtime_error(what), code(c) {}
};

// One rank's view of the group. Not thread-safe: one host thread per handle.
class Group {
 public:
  Group(int rank, int world, int64_t staging_bytes, int max_blocks);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  int max_blocks() const { return max_blocks_; }
  int64_t max_size() const { return staging_bytes_; }
  int64_t one_shot_max() const { return one_shot_max_; }
  void set_one_shot_max(int64_t b) { one_shot_max_ = b; }
  void* shared_base() const { return base_; }
  const int64_t* stats() const { return stats_; }

  void ipc_handle(void* out) const;
  void open_peers_ipc(const char* handles);
  void set_peers_local(void* const* bases);

  void register_buffer(void* const* ptrs);  // resolved addresses, by rank
  void register_buffer_ipc(const void* own, const char* handles, const int64_t* offsets);

  void begin_capture();
  int64_t end_capture();
  const std::vector<std::pair<int64_t, const void*>>& pending() const { return pending_; }
  void register_graph(void* const* ptrs, int64_t n);  // world*n, rank-major
  void register_graph_ipc(const char* handles, const int64_t* offsets, int64_t n);
  void drop_pending() { pending_.clear(); }

  void all_reduce(const void* in, void* out, int64_t numel, int dtype, cudaStream_t stream,
                  int algo);
  void gather(const void* in, void* out, int64_t rows, int64_t in_row_bytes, int64_t out_row_bytes,
              int root, cudaStream_t stream);
  uint32_t device_errors(bool clear);

 private:
  int64_t alloc_slot();
  void write_slot(int64_t slot, const RankPtrs& rp);
  char* open_ipc(const char* handle);  // cached: one mapping per peer allocation

  int rank_, world_, device_, max_blocks_;
  int64_t staging_bytes_, one_shot_max_;
  char* base_ = nullptr;          // own Signal, then staging (one cudaMalloc, IPC-shareable)
  RankPtrs* table_ = nullptr;     // registered-pointer table (device)
  int64_t table_cap_ = 0, next_slot_ = 0;
  Peers peers_{};
  Self self_{};
  bool peers_ready_ = false, capture_open_ = false;
  std::map<std::string, char*> ipc_maps_;
  std::unordered_map<const void*, int64_t> registered_;  // own input address -> slot
  std::vector<std::pair<int64_t, const void*>> pending_;  // (slot, own input) from captures
  int64_t stats_[5] = {0, 0, 0, 0, 0};
};

int blocks_per_sm(int world);

}  // namespace fdar
