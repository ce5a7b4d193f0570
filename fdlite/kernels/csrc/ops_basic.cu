// Fill, cast, copy and row-gather ops: the helpers the GPU runner needs in place of Paddle's
// built-ins (paddle.full / astype / setitem / gather), which compute nothing on sm_90 with PyPI's
// paddlepaddle-gpu. Also the embedding lookup (a row gather with a vocabulary offset for
// tensor-parallel shards). See ops_common.cuh for the rules every op here follows.
#include "ops_common.cuh"

namespace fdl {
namespace {

// ---------------------------------------------------------------- fill
template <typename T>
__global__ void fill_kernel(T* __restrict__ x, int64_t n, T v) {
  pdl_trigger();
  pdl_wait();
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    x[i] = v;
}

template <typename T>
void launch_fill(void* x, int64_t n, T v, cudaStream_t s) {
  if (n == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>(ceil_div(n, threads), 4 * 1024);
  launch("fill_kernel", fill_kernel<T>, (unsigned)blocks, threads, 0, s, false, static_cast<T*>(x), n, v);
}

// ---------------------------------------------------------------- cast (any of 5 dtypes to any)
template <typename T>
struct Conv {  // through float for the float types
  __device__ static float get(T v) { return to_f<T>(v); }
  __device__ static T put(float v) { return from_f<T>(v); }
};

template <typename D, typename S>
__device__ __forceinline__ D convert(S v) {
  return Conv<D>::put(Conv<S>::get(v));
}
// Integer <-> integer keeps every bit of int64; integer <-> float goes through float (as astype).
template <>
__device__ __forceinline__ int64_t convert<int64_t, int64_t>(int64_t v) { return v; }
template <>
__device__ __forceinline__ int32_t convert<int32_t, int32_t>(int32_t v) { return v; }
template <>
__device__ __forceinline__ int32_t convert<int32_t, int64_t>(int64_t v) { return (int32_t)v; }
template <>
__device__ __forceinline__ int64_t convert<int64_t, int32_t>(int32_t v) { return v; }
template <>
struct Conv<int32_t> {
  __device__ static float get(int32_t v) { return (float)v; }
  __device__ static int32_t put(float v) { return (int32_t)v; }
};
template <>
struct Conv<int64_t> {
  __device__ static float get(int64_t v) { return (float)v; }
  __device__ static int64_t put(float v) { return (int64_t)v; }
};

template <typename D, typename S>
__global__ void cast_kernel(D* __restrict__ dst, const S* __restrict__ src, int64_t n) {
  pdl_trigger();
  pdl_wait();
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = convert<D, S>(src[i]);
}

template <typename D, typename S>
void launch_cast(void* dst, const void* src, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>(ceil_div(n, threads), 4 * 1024);
  launch("cast_kernel", cast_kernel<D, S>, (unsigned)blocks, threads, 0, s, false, static_cast<D*>(dst), static_cast<const S*>(src), n);
}

#define FDL_ANY_SWITCH(dt, T, op, ...)                                              \
  switch (dt) {                                                                     \
    case paddle::DataType::FLOAT32: { using T = float; __VA_ARGS__; } break;        \
    case paddle::DataType::FLOAT16: { using T = __half; __VA_ARGS__; } break;       \
    case paddle::DataType::BFLOAT16: { using T = __nv_bfloat16; __VA_ARGS__; } break; \
    case paddle::DataType::INT32: { using T = int32_t; __VA_ARGS__; } break;        \
    case paddle::DataType::INT64: { using T = int64_t; __VA_ARGS__; } break;        \
    default: PD_THROW(op, ": unsupported dtype (float32, float16, bfloat16, int32, int64)"); \
  }

// ---------------------------------------------------------------- row gather
// out[i, :] = src[idx[i] - offset, :], or zeros where that row is outside [0, rows): the
// vocabulary-parallel embedding looks up only the ids its shard holds.
template <typename V, typename I>
__global__ void gather_rows_kernel(V* __restrict__ out, const V* __restrict__ src, const I* __restrict__ idx,
                                   int64_t rows, int64_t row_vecs, int64_t offset) {
  pdl_trigger();
  pdl_wait();
  const int64_t i = blockIdx.x;
  const int64_t r = (int64_t)idx[i] - offset;
  V* o = out + i * row_vecs;
  if (r < 0 || r >= rows) {
    V z;
    memset(&z, 0, sizeof(V));
    for (int64_t c = threadIdx.x; c < row_vecs; c += blockDim.x) o[c] = z;
    return;
  }
  const V* s = src + r * row_vecs;
  for (int64_t c = threadIdx.x; c < row_vecs; c += blockDim.x) o[c] = s[c];
}

template <typename I>
void launch_gather(void* out, const void* src, const void* idx, int64_t m, int64_t rows, int64_t row_bytes,
                   int64_t offset, cudaStream_t s) {
  if (m == 0) return;
  // Move rows in the widest unit that divides the row and both base addresses.
  auto go = [&](auto unit) {
    using V = decltype(unit);
    const int64_t vecs = row_bytes / (int64_t)sizeof(V);
    const int threads = (int)std::min<int64_t>(256, std::max<int64_t>(32, ceil_div(vecs, 32) * 32));
    launch("gather_rows_kernel", gather_rows_kernel<V, I>, (unsigned)m, threads, 0, s, pdl_rows(m), static_cast<V*>(out), static_cast<const V*>(src),
                                                            static_cast<const I*>(idx), rows, vecs, offset);
  };
  const uintptr_t a = reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(src) | (uintptr_t)row_bytes;
  if ((a & 15) == 0) go(int4{});
  else if ((a & 7) == 0) go(int2{});
  else if ((a & 3) == 0) go(int{});
  else if ((a & 1) == 0) go(short{});
  else go(char{});
}

void gather_into(paddle::Tensor& out, const paddle::Tensor& src, const paddle::Tensor& idx, int64_t offset,
                 const char* op) {
  check_gpu(src, op, "src");
  check_gpu(idx, op, "index");
  PD_CHECK(src.shape().size() >= 1, op, ": src needs at least one dimension");
  const int64_t rows = src.shape()[0];
  const int64_t row_elems = rows > 0 ? src.numel() / rows : 0;
  const int64_t m = idx.numel();
  PD_CHECK(out.numel() == m * row_elems && out.dtype() == src.dtype(), op, ": out must be [len(index), ...] of src's dtype");
  const int64_t row_bytes = row_elems * (int64_t)phi::SizeOf(src.dtype());
  cudaStream_t s = stream_of(src);
  if (idx.dtype() == paddle::DataType::INT64)
    launch_gather<int64_t>(out.data(), src.data(), idx.data(), m, rows, row_bytes, offset, s);
  else if (idx.dtype() == paddle::DataType::INT32)
    launch_gather<int32_t>(out.data(), src.data(), idx.data(), m, rows, row_bytes, offset, s);
  else
    PD_THROW(op, ": index must be int32 or int64");
  FDL_CHECK_LAUNCH(op);
}

}  // namespace
}  // namespace fdl

using namespace fdl;

// fdl_fill_(x, value, ivalue): every element of x = value (float dtypes) or ivalue (int32 / int64).
std::vector<paddle::Tensor> FillInplace(paddle::Tensor& x, float value, int64_t ivalue) {
  check_gpu(x, "fdl_fill_", "x");
  cudaStream_t s = stream_of(x);
  const int64_t n = x.numel();
  switch (x.dtype()) {
    case paddle::DataType::FLOAT32: launch_fill<float>(x.data(), n, value, s); break;
    case paddle::DataType::FLOAT16: launch_fill<__half>(x.data(), n, __float2half_rn(value), s); break;
    case paddle::DataType::BFLOAT16: launch_fill<__nv_bfloat16>(x.data(), n, __float2bfloat16_rn(value), s); break;
    case paddle::DataType::INT32: launch_fill<int32_t>(x.data(), n, (int32_t)ivalue, s); break;
    case paddle::DataType::INT64: launch_fill<int64_t>(x.data(), n, ivalue, s); break;
    case paddle::DataType::UINT8:
    case paddle::DataType::BOOL: launch_fill<uint8_t>(x.data(), n, (uint8_t)ivalue, s); break;
    default: PD_THROW("fdl_fill_: unsupported dtype");
  }
  FDL_CHECK_LAUNCH("fdl_fill_");
  return {};
}

PD_BUILD_OP(fdl_fill_)
    .Inputs({"X"})
    .Outputs({"Out"})
    .Attrs({"value: float", "ivalue: int64_t"})
    .SetInplaceMap({{"X", "Out"}})
    .SetKernelFn(PD_KERNEL(FillInplace));

// fdl_cast_(dst, src): dst = src converted to dst's dtype (float32/float16/bfloat16/int32/int64).
std::vector<paddle::Tensor> CastInplace(paddle::Tensor& dst, const paddle::Tensor& src) {
  check_gpu(dst, "fdl_cast_", "dst");
  check_gpu(src, "fdl_cast_", "src");
  PD_CHECK(dst.numel() == src.numel(), "fdl_cast_: dst and src sizes differ");
  cudaStream_t s = stream_of(dst);
  FDL_ANY_SWITCH(dst.dtype(), D, "fdl_cast_",
                 FDL_ANY_SWITCH(src.dtype(), S, "fdl_cast_", launch_cast<D, S>(dst.data(), src.data(), src.numel(), s)));
  FDL_CHECK_LAUNCH("fdl_cast_");
  return {};
}

PD_BUILD_OP(fdl_cast_)
    .Inputs({"Dst", "Src"})
    .Outputs({"Out"})
    .SetInplaceMap({{"Dst", "Out"}})
    .SetKernelFn(PD_KERNEL(CastInplace));

// fdl_add_(dst, src): dst += src elementwise (same float dtype and size), the sum in float32 rounded once to
// dst's dtype, as Paddle's add does: a MoE block's routed and shared experts (fdlite/models/moe.py).
template <typename T>
__global__ void add_kernel(T* __restrict__ dst, const T* __restrict__ src, int64_t n) {
  pdl_trigger();
  pdl_wait();
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = from_f<T>(to_f<T>(dst[i]) + to_f<T>(src[i]));
}

std::vector<paddle::Tensor> AddInplace(paddle::Tensor& dst, const paddle::Tensor& src) {
  check_gpu(dst, "fdl_add_", "dst");
  check_gpu(src, "fdl_add_", "src");
  PD_CHECK(dst.numel() == src.numel() && dst.dtype() == src.dtype(), "fdl_add_: size or dtype mismatch");
  const int64_t n = dst.numel();
  if (n == 0) return {};
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>(ceil_div(n, threads), 4 * 1024);
  FDL_FLOAT_SWITCH(dst.dtype(), T, "fdl_add_", {
    launch("add_kernel", add_kernel<T>, (unsigned)blocks, threads, 0, stream_of(dst), false, static_cast<T*>(dst.data()),
           static_cast<const T*>(src.data()), n);
  });
  FDL_CHECK_LAUNCH("fdl_add_");
  return {};
}

PD_BUILD_OP(fdl_add_)
    .Inputs({"Dst", "Src"})
    .Outputs({"Out"})
    .SetInplaceMap({{"Dst", "Out"}})
    .SetKernelFn(PD_KERNEL(AddInplace));

// fdl_copy_(dst, src): bytes of src into dst on dst's stream. src may be on the host (pinned memory
// also inside a capture; pageable memory only eagerly, where the copy is synchronous anyway).
std::vector<paddle::Tensor> CopyInplace(paddle::Tensor& dst, const paddle::Tensor& src) {
  check_gpu(dst, "fdl_copy_", "dst");
  PD_CHECK(dst.numel() == src.numel() && dst.dtype() == src.dtype(), "fdl_copy_: size or dtype mismatch");
  const size_t bytes = (size_t)dst.numel() * phi::SizeOf(dst.dtype());
  if (bytes == 0) return {};
  note_foreign_work();
  FDL_CHECK_CUDA(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDefault, stream_of(dst)), "fdl_copy_");
  return {};
}

PD_BUILD_OP(fdl_copy_)
    .Inputs({"Dst", "Src"})
    .Outputs({"Out"})
    .SetInplaceMap({{"Dst", "Out"}})
    .SetKernelFn(PD_KERNEL(CopyInplace));

// fdl_gather_rows(src [N, ...], index [M], offset) -> [M, ...]: rows index - offset of src, zeros
// for rows outside [0, N). With offset = 0 this is the embedding lookup and the LM head's row pick.
std::vector<paddle::Tensor> GatherRows(const paddle::Tensor& src, const paddle::Tensor& idx, int64_t offset) {
  std::vector<int64_t> shape = src.shape();
  PD_CHECK(!shape.empty(), "fdl_gather_rows: src needs at least one dimension");
  shape[0] = idx.numel();
  paddle::Tensor out = paddle::empty(shape, src.dtype(), src.place());
  gather_into(out, src, idx, offset, "fdl_gather_rows");
  return {out};
}

std::vector<std::vector<int64_t>> GatherRowsShape(const std::vector<int64_t>& src, const std::vector<int64_t>& idx) {
  std::vector<int64_t> s(src);
  int64_t m = 1;
  for (auto d : idx) m *= d;
  s[0] = m;
  return {s};
}
std::vector<paddle::DataType> GatherRowsDtype(const paddle::DataType& src, const paddle::DataType&) { return {src}; }

PD_BUILD_OP(fdl_gather_rows)
    .Inputs({"Src", "Index"})
    .Outputs({"Out"})
    .Attrs({"offset: int64_t"})
    .SetKernelFn(PD_KERNEL(GatherRows))
    .SetInferShapeFn(PD_INFER_SHAPE(GatherRowsShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(GatherRowsDtype));

// fdl_gather_rows_(out, src, index, offset): the same into a preallocated out.
std::vector<paddle::Tensor> GatherRowsInplace(paddle::Tensor& out, const paddle::Tensor& src, const paddle::Tensor& idx,
                                              int64_t offset) {
  check_gpu(out, "fdl_gather_rows_", "out");
  gather_into(out, src, idx, offset, "fdl_gather_rows_");
  return {};
}

PD_BUILD_OP(fdl_gather_rows_)
    .Inputs({"Out", "Src", "Index"})
    .Outputs({"OutRef"})
    .Attrs({"offset: int64_t"})
    .SetInplaceMap({{"Out", "OutRef"}})
    .SetKernelFn(PD_KERNEL(GatherRowsInplace));
