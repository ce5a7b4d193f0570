// Host side of fdlite's custom all-reduce: buffers, peers, the registered-pointer
// table for graph capture, and the choice of kernel. Hand-written for the reasons
// given in custom_all_reduce.cuh; the C ABI over it is custom_all_reduce_capi.cu.
#include <cuda.h>  // only for CUresult/CUdeviceptr types of cuPointerGetAttribute

#include <algorithm>
#include <cstring>

#include "custom_all_reduce.cuh"
#include "custom_all_reduce_capi.h"

namespace fdar {

static_assert(sizeof(cudaIpcMemHandle_t) == FDAR_IPC_HANDLE_BYTES, "IPC handle size");
static_assert(FDAR_STAT_COUNT == 5, "stats size");

namespace {

constexpr int kDefaultBlocks = 36;
constexpr int64_t kTableSlots = 16384;  // 1 MiB of RankPtrs; FastDeploy-size models use < 1k
constexpr int64_t kAlign = 256;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error((int)e, std::string(what) + ": " + cudaGetErrorString(e));
}

int64_t staging_offset() { return (sizeof(Signal) + kAlign - 1) / kAlign * kAlign; }

// Default one-shot ceiling. One-shot reads (W-1) tensors over the links, two-shot
// 2(W-1)/W tensors plus one more barrier: at W=2 they move the same bytes, so
// one-shot always wins; at 4 and 8 two-shot wins once bandwidth dominates.
int64_t default_one_shot_max(int world) {
  if (world <= 2) return INT64_MAX;
  return world == 4 ? (512 << 10) : (256 << 10);
}

template <typename T, int W>
void launch(int algo, int blocks, cudaStream_t s, const Peers& P, const Self& me,
            const RankPtrs* slot, const uint4* copy_src, uint4* out, int64_t n_vec) {
  if (algo == FDAR_ALGO_ONE_SHOT)
    one_shot_kernel<T, W><<<blocks, kThreads, 0, s>>>(P, me, slot, copy_src, out, n_vec);
  else
    two_shot_kernel<T, W><<<blocks, kThreads, 0, s>>>(P, me, slot, copy_src, out, n_vec);
}

template <int W>
void launch_dtype(int dtype, int algo, int blocks, cudaStream_t s, const Peers& P,
                  const Self& me, const RankPtrs* slot, const uint4* copy_src, uint4* out,
                  int64_t n_vec) {
  switch (dtype) {
    case FDAR_BF16:
      return launch<__nv_bfloat16, W>(algo, blocks, s, P, me, slot, copy_src, out, n_vec);
    case FDAR_FP16:
      return launch<__half, W>(algo, blocks, s, P, me, slot, copy_src, out, n_vec);
    case FDAR_FP32:
      return launch<float, W>(algo, blocks, s, P, me, slot, copy_src, out, n_vec);
  }
  throw Error(FDAR_E_ARG, "dtype must be FDAR_BF16, FDAR_FP16 or FDAR_FP32");
}

int dtype_size(int dtype) {
  switch (dtype) {
    case FDAR_BF16:
    case FDAR_FP16:
      return 2;
    case FDAR_FP32:
      return 4;
  }
  throw Error(FDAR_E_ARG, "dtype must be FDAR_BF16, FDAR_FP16 or FDAR_FP32");
}

template <typename K>
int occupancy(K kernel) {
  int n = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0), "occupancy");
  return n;
}

template <int W>
int blocks_per_sm_w() {
  int n = occupancy(one_shot_kernel<__nv_bfloat16, W>);
  n = std::min(n, occupancy(one_shot_kernel<__half, W>));
  n = std::min(n, occupancy(one_shot_kernel<float, W>));
  n = std::min(n, occupancy(two_shot_kernel<__nv_bfloat16, W>));
  n = std::min(n, occupancy(two_shot_kernel<__half, W>));
  n = std::min(n, occupancy(two_shot_kernel<float, W>));
  return n;
}

typedef CUresult (*PointerGetAttributeFn)(void*, CUpointer_attribute, CUdeviceptr);

// cuPointerGetAttribute through the runtime's entry-point query, so the library
// needs no link against libcuda (absent on build machines without a driver).
PointerGetAttributeFn pointer_get_attribute() {
  static PointerGetAttributeFn fn = nullptr;
  if (!fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    check(cudaGetDriverEntryPointByVersion("cuPointerGetAttribute", &p, 12000, cudaEnableDefault,
                                           &q),
          "cudaGetDriverEntryPointByVersion(cuPointerGetAttribute)");
    if (q != cudaDriverEntryPointSuccess || !p)
      throw Error(FDAR_E_STATE, "cuPointerGetAttribute not found in the driver");
    fn = reinterpret_cast<PointerGetAttributeFn>(p);
  }
  return fn;
}

}  // namespace

int blocks_per_sm(int world) {
  switch (world) {
    case 1: return blocks_per_sm_w<1>();
    case 2: return blocks_per_sm_w<2>();
    case 4: return blocks_per_sm_w<4>();
    case 8: return blocks_per_sm_w<8>();
  }
  throw Error(FDAR_E_ARG, "world size must be 1, 2, 4 or 8");
}

Group::Group(int rank, int world, int64_t staging_bytes, int max_blocks)
    : rank_(rank), world_(world), device_(0), max_blocks_(max_blocks > 0 ? max_blocks : kDefaultBlocks),
      staging_bytes_(staging_bytes), one_shot_max_(default_one_shot_max(world)) {
  if (world != 1 && world != 2 && world != 4 && world != 8)
    throw Error(FDAR_E_ARG, "world size must be 1, 2, 4 or 8");
  if (rank < 0 || rank >= world) throw Error(FDAR_E_ARG, "rank out of range");
  if (staging_bytes < 16 || staging_bytes % 16) throw Error(FDAR_E_ARG, "staging_bytes must be a positive multiple of 16");
  if (max_blocks_ > kMaxBlocks) throw Error(FDAR_E_ARG, "max_blocks above kMaxBlocks (64)");
  check(cudaGetDevice(&device_), "cudaGetDevice");
  try {
    // Plain cudaMalloc: IPC handles need it (not cudaMallocAsync pools or managed memory).
    check(cudaMalloc(&base_, staging_offset() + staging_bytes_), "cudaMalloc(shared)");
    check(cudaMemset(base_, 0, sizeof(Signal)), "cudaMemset(signal)");
    table_cap_ = kTableSlots;
    check(cudaMalloc(&table_, sizeof(RankPtrs) * table_cap_), "cudaMalloc(table)");
    // All-null slots: a graph replayed before registration is detected, not a wild read.
    check(cudaMemset(table_, 0, sizeof(RankPtrs) * table_cap_), "cudaMemset(table)");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  } catch (...) {
    if (table_) cudaFree(table_);
    if (base_) cudaFree(base_);
    throw;
  }
}

Group::~Group() {
  for (auto& kv : ipc_maps_) cudaIpcCloseMemHandle(kv.second);
  if (table_) cudaFree(table_);
  if (base_) cudaFree(base_);
}

void Group::ipc_handle(void* out) const {
  cudaIpcMemHandle_t h;
  check(cudaIpcGetMemHandle(&h, base_), "cudaIpcGetMemHandle");
  std::memcpy(out, &h, sizeof(h));
}

char* Group::open_ipc(const char* handle) {
  std::string key(handle, FDAR_IPC_HANDLE_BYTES);
  auto it = ipc_maps_.find(key);
  if (it != ipc_maps_.end()) return it->second;
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle, sizeof(h));
  void* p = nullptr;
  check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  ipc_maps_[key] = static_cast<char*>(p);
  return static_cast<char*>(p);
}

void Group::open_peers_ipc(const char* handles) {
  std::vector<void*> bases(world_);
  for (int p = 0; p < world_; ++p)
    bases[p] = p == rank_ ? base_ : open_ipc(handles + (size_t)p * FDAR_IPC_HANDLE_BYTES);
  set_peers_local(bases.data());
}

void Group::set_peers_local(void* const* bases) {
  if (bases[rank_] != base_) throw Error(FDAR_E_ARG, "bases[rank] must be this rank's shared base");
  for (int p = 0; p < kMaxWorld; ++p) {
    char* b = p < world_ ? static_cast<char*>(bases[p]) : nullptr;
    if (p < world_ && !b) throw Error(FDAR_E_ARG, "null peer base");
    peers_.sig[p] = reinterpret_cast<Signal*>(b);
    peers_.staging[p] = b ? b + staging_offset() : nullptr;
  }
  Signal* own = reinterpret_cast<Signal*>(base_);
  check(cudaMemcpy(own->peer, peers_.sig, sizeof(peers_.sig), cudaMemcpyHostToDevice),
        "cudaMemcpy(peer directory)");
  self_ = Self{own, reinterpret_cast<uint4*>(base_ + staging_offset()), rank_};
  peers_ready_ = true;
}

int64_t Group::alloc_slot() {
  if (next_slot_ >= table_cap_)
    throw Error(FDAR_E_CAPACITY, "registered-pointer table full (" + std::to_string(table_cap_) + " slots)");
  return next_slot_++;
}

void Group::write_slot(int64_t slot, const RankPtrs& rp) {
  for (int p = 0; p < world_; ++p)
    if (!rp.p[p] || reinterpret_cast<uintptr_t>(rp.p[p]) % 16)
      throw Error(FDAR_E_ALIGN, "registered buffers must be non-null and 16-byte aligned");
  check(cudaMemcpy(table_ + slot, &rp, sizeof(rp), cudaMemcpyHostToDevice), "cudaMemcpy(table)");
}

void Group::register_buffer(void* const* ptrs) {
  RankPtrs rp{};
  for (int p = 0; p < world_; ++p) rp.p[p] = ptrs[p];
  auto it = registered_.find(ptrs[rank_]);
  const int64_t slot = it != registered_.end() ? it->second : alloc_slot();
  write_slot(slot, rp);
  registered_[ptrs[rank_]] = slot;
}

void Group::register_buffer_ipc(const void* own, const char* handles, const int64_t* offsets) {
  std::vector<void*> ptrs(world_);
  for (int p = 0; p < world_; ++p)
    ptrs[p] = p == rank_ ? const_cast<void*>(own)
                         : open_ipc(handles + (size_t)p * FDAR_IPC_HANDLE_BYTES) + offsets[p];
  register_buffer(ptrs.data());
}

void Group::begin_capture() { capture_open_ = true; }

int64_t Group::end_capture() {
  capture_open_ = false;
  return (int64_t)pending_.size();
}

void Group::register_graph(void* const* ptrs, int64_t n) {
  if (n != (int64_t)pending_.size())
    throw Error(FDAR_E_STATE, "register_graph: " + std::to_string(n) + " buffers given, " +
                                  std::to_string(pending_.size()) + " pending on this rank");
  for (int64_t i = 0; i < n; ++i) {
    RankPtrs rp{};
    for (int p = 0; p < world_; ++p) rp.p[p] = ptrs[(size_t)p * n + i];
    if (rp.p[rank_] != pending_[i].second)
      throw Error(FDAR_E_ARG, "register_graph: own entry differs from the recorded input");
    write_slot(pending_[i].first, rp);
  }
  pending_.clear();
}

void Group::register_graph_ipc(const char* handles, const int64_t* offsets, int64_t n) {
  if (n != (int64_t)pending_.size())
    throw Error(FDAR_E_STATE, "register_graph_ipc: count differs from this rank's pending buffers");
  std::vector<void*> ptrs((size_t)world_ * n);
  for (int p = 0; p < world_; ++p)
    for (int64_t i = 0; i < n; ++i) {
      const size_t k = (size_t)p * n + i;
      ptrs[k] = p == rank_ ? const_cast<void*>(pending_[i].second)
                           : open_ipc(handles + k * FDAR_IPC_HANDLE_BYTES) + offsets[k];
    }
  register_graph(ptrs.data(), n);
}

void Group::all_reduce(const void* in, void* out, int64_t numel, int dtype, cudaStream_t stream,
                       int algo) {
  if (!peers_ready_) throw Error(FDAR_E_NO_PEERS, "peers not opened (fdar_open_peers_ipc / fdar_set_peers_local)");
  if (numel <= 0 || !in || !out) throw Error(FDAR_E_ARG, "empty or null all-reduce");
  const int64_t bytes = numel * dtype_size(dtype);
  if (bytes % 16 || bytes > staging_bytes_)
    throw Error(FDAR_E_SIZE, "all-reduce of " + std::to_string(bytes) + " bytes: need a multiple of 16 up to " + std::to_string(staging_bytes_));
  if (reinterpret_cast<uintptr_t>(in) % 16 || reinterpret_cast<uintptr_t>(out) % 16)
    throw Error(FDAR_E_ALIGN, "all-reduce pointers must be 16-byte aligned");
  if (algo == FDAR_ALGO_AUTO) algo = bytes <= one_shot_max_ ? FDAR_ALGO_ONE_SHOT : FDAR_ALGO_TWO_SHOT;
  if (algo != FDAR_ALGO_ONE_SHOT && algo != FDAR_ALGO_TWO_SHOT) throw Error(FDAR_E_ARG, "bad algo");

  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &cs), "cudaStreamIsCapturing");

  const RankPtrs* slot = nullptr;
  const uint4* copy_src = nullptr;
  int path;
  // In place can't read inputs where they are: peers would see our partial output.
  auto reg = in != out ? registered_.find(in) : registered_.end();
  if (reg != registered_.end()) {
    slot = table_ + reg->second;
    path = FDAR_STAT_REGISTERED;
  } else if (in != out && capture_open_ && cs == cudaStreamCaptureStatusActive) {
    const int64_t s = alloc_slot();
    pending_.emplace_back(s, in);
    slot = table_ + s;
    path = FDAR_STAT_GRAPH;
  } else {
    // Also right inside a capture without begin_capture: the staging buffer's
    // address is fixed, so the captured kernel stays valid on replay.
    copy_src = static_cast<const uint4*>(in);
    path = FDAR_STAT_STAGING;
  }

  const int64_t n_vec = bytes / 16;
  const int64_t work = algo == FDAR_ALGO_ONE_SHOT ? n_vec : (n_vec + world_ - 1) / world_;
  const int blocks = (int)std::max<int64_t>(1, std::min<int64_t>(max_blocks_, (work + kThreads - 1) / kThreads));
  uint4* o = static_cast<uint4*>(out);
  switch (world_) {
    case 1: launch_dtype<1>(dtype, algo, blocks, stream, peers_, self_, slot, copy_src, o, n_vec); break;
    case 2: launch_dtype<2>(dtype, algo, blocks, stream, peers_, self_, slot, copy_src, o, n_vec); break;
    case 4: launch_dtype<4>(dtype, algo, blocks, stream, peers_, self_, slot, copy_src, o, n_vec); break;
    case 8: launch_dtype<8>(dtype, algo, blocks, stream, peers_, self_, slot, copy_src, o, n_vec); break;
  }
  check(cudaGetLastError(), "all-reduce launch");
  stats_[path] += 1;
  stats_[algo == FDAR_ALGO_ONE_SHOT ? FDAR_STAT_ONE_SHOT : FDAR_STAT_TWO_SHOT] += 1;
}

namespace {
template <typename U>
void launch_gather(int world, int blocks, cudaStream_t s, const Peers& P, const Self& me, const void* in,
                   void* out, int64_t rows, int64_t in_row, int64_t out_row, int first, int count) {
  const U* i = static_cast<const U*>(in);
  U* o = static_cast<U*>(out);
  switch (world) {
    case 1: gather_kernel<U, 1><<<blocks, kThreads, 0, s>>>(P, me, i, o, rows, in_row, out_row, first, count); break;
    case 2: gather_kernel<U, 2><<<blocks, kThreads, 0, s>>>(P, me, i, o, rows, in_row, out_row, first, count); break;
    case 4: gather_kernel<U, 4><<<blocks, kThreads, 0, s>>>(P, me, i, o, rows, in_row, out_row, first, count); break;
    case 8: gather_kernel<U, 8><<<blocks, kThreads, 0, s>>>(P, me, i, o, rows, in_row, out_row, first, count); break;
  }
}
}  // namespace

// All-gather (root < 0) or broadcast from `root`, through the staging buffers: the input
// is copied in by the kernel, so this is the same launch eagerly and inside a capture.
void Group::gather(const void* in, void* out, int64_t rows, int64_t in_row_bytes, int64_t out_row_bytes,
                   int root, cudaStream_t stream) {
  if (!peers_ready_) throw Error(FDAR_E_NO_PEERS, "peers not opened (fdar_open_peers_ipc / fdar_set_peers_local)");
  const bool bcast = root >= 0;
  if (root >= world_) throw Error(FDAR_E_ARG, "broadcast root out of range");
  if (!out || rows <= 0 || in_row_bytes <= 0) throw Error(FDAR_E_ARG, "empty or null gather");
  if ((!bcast || root == rank_) && !in) throw Error(FDAR_E_ARG, "gather: null input on a rank that sends");
  const int count = bcast ? 1 : world_;
  if (out_row_bytes <= 0 || out_row_bytes > in_row_bytes * count)
    throw Error(FDAR_E_ARG, "gather: output rows must hold 1 to all of the gathered columns");
  if (rows * in_row_bytes > staging_bytes_)
    throw Error(FDAR_E_SIZE, "gather of " + std::to_string(rows * in_row_bytes) + " bytes per rank: above the " +
                                 std::to_string(staging_bytes_) + "-byte staging buffer");
  const bool wide = in_row_bytes % 16 == 0 && out_row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t unit = wide ? 16 : 4;
  if (in_row_bytes % unit || out_row_bytes % unit || reinterpret_cast<uintptr_t>(in) % unit ||
      reinterpret_cast<uintptr_t>(out) % unit)
    throw Error(FDAR_E_ALIGN, "gather: rows and pointers must be multiples of 4 bytes");
  const int64_t n = rows * (in_row_bytes / unit);
  const int blocks = (int)std::max<int64_t>(1, std::min<int64_t>(max_blocks_, (n + kThreads - 1) / kThreads));
  const void* src = bcast && root != rank_ ? nullptr : in;
  const int first = bcast ? root : 0;
  if (wide)
    launch_gather<uint4>(world_, blocks, stream, peers_, self_, src, out, rows, in_row_bytes / 16, out_row_bytes / 16,
                         first, count);
  else
    launch_gather<uint32_t>(world_, blocks, stream, peers_, self_, src, out, rows, in_row_bytes / 4, out_row_bytes / 4,
                            first, count);
  check(cudaGetLastError(), "gather launch");
  stats_[FDAR_STAT_STAGING] += 1;
}

uint32_t Group::device_errors(bool clear) {
  uint32_t v = 0;
  Signal* s = reinterpret_cast<Signal*>(base_);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check(cudaMemcpy(&v, &s->error, sizeof(v), cudaMemcpyDeviceToHost), "cudaMemcpy(error)");
  if (clear) check(cudaMemset(&s->error, 0, sizeof(v)), "cudaMemset(error)");
  return v;
}

// Exposed for fdar_buffer_ipc_meta.
void buffer_ipc_meta(const void* ptr, void* out_handle, int64_t* out_offset) {
  CUdeviceptr start = 0;
  CUresult r = pointer_get_attribute()(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                       reinterpret_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS) throw Error(FDAR_E_ARG, "cuPointerGetAttribute(RANGE_START_ADDR) failed: " + std::to_string((int)r));
  cudaIpcMemHandle_t h;
  check(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(start)), "cudaIpcGetMemHandle(buffer)");
  std::memcpy(out_handle, &h, sizeof(h));
  *out_offset = (int64_t)(reinterpret_cast<uintptr_t>(ptr) - (uintptr_t)start);
}

}  // namespace fdar
