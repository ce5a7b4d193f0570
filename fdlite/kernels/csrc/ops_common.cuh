// Shared helpers of fdlite's GPU ops (ops_*.cu): dtype dispatch, vector loads, reductions.
//
// Why hand-written ops at all: PyPI's paddlepaddle-gpu has no sm_90 kernels, so on Hopper every
// Paddle built-in computing kernel silently does nothing; FastDeploy likewise runs its GPU hot path
// on its own compiled custom ops. Every op here runs on the stream of its first GPU tensor
// (x.stream()), allocates only through paddle::empty (the graph pool inside a capture) and never
// synchronizes, so each is safe inside a Paddle CUDAGraph capture. Inputs must be contiguous: the
// Python wrappers (fdlite/kernels/gpu.py) check that, because Paddle would otherwise make them contiguous
// with its own (no-op on sm_90) kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <cstdlib>
#include <utility>
#include <vector>

#include "ops_options.h"
#include "paddle/extension.h"

namespace fdl {

// ---------------------------------------------------------------- host-side checks
#define FDL_CHECK_CUDA(expr, what)                                                  \
  do {                                                                              \
    cudaError_t e_ = (expr);                                                        \
    PD_CHECK(e_ == cudaSuccess, what, ": ", cudaGetErrorString(e_));                \
  } while (0)

// Our cudart's error state only sees our own launches (Paddle's runtime is a separate, static one).
#define FDL_CHECK_LAUNCH(what) FDL_CHECK_CUDA(cudaGetLastError(), what)

inline cudaStream_t stream_of(const paddle::Tensor& t) {
#if defined(PADDLE_WITH_CUDA)
  return reinterpret_cast<cudaStream_t>(t.stream());
#else
  (void)t;
  PD_THROW("fdlite GPU ops: this Paddle build has no CUDA");
  return nullptr;
#endif
}

inline void check_gpu(const paddle::Tensor& t, const char* op, const char* name) {
  PD_CHECK(t.is_gpu(), op, ": ", name, " must be a GPU tensor");
}

// FP8 caches (kv_cache_dtype="fp8"): uint8 e4m3 bits, and a float32 scale per cache row of head_dim d values.
inline void check_fp8_caches(const char* op, const paddle::Tensor& kc, const paddle::Tensor& vc,
                             const paddle::Tensor& ks, const paddle::Tensor& vs, int64_t d) {
  check_gpu(ks, op, "k_scale");
  check_gpu(vs, op, "v_scale");
  PD_CHECK(kc.dtype() == paddle::DataType::UINT8 && vc.dtype() == paddle::DataType::UINT8, op,
           ": FP8 caches must be uint8 (e4m3 bits)");
  PD_CHECK(ks.dtype() == paddle::DataType::FLOAT32 && vs.dtype() == paddle::DataType::FLOAT32 &&
               ks.numel() * d == kc.numel() && vs.numel() * d == vc.numel(),
           op, ": scales must be float32 [blocks, kv_heads, block_size]");
}

inline bool is_float_dtype(paddle::DataType d) {
  return d == paddle::DataType::FLOAT32 || d == paddle::DataType::FLOAT16 ||
         d == paddle::DataType::BFLOAT16;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int num_sms() {
  static int n = [] {
    int dev = 0, v = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
    return v > 0 ? v : 132;
  }();
  return n;
}

// The dynamic shared memory `Kernel` may launch with: a host-side attribute, set once per kernel (also fine during
// a capture).
template <auto Kernel>
void allow_smem(size_t bytes) {
  static bool done = false;
  if (!done) {
    FDL_CHECK_CUDA(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                   "cudaFuncSetAttribute (dynamic shared memory)");
    done = true;
  }
}

// Dispatch on the three float dtypes: FDL_FLOAT_SWITCH(dtype, T, op, { body using T });
#define FDL_FLOAT_SWITCH(dt, T, op, ...)                                            \
  switch (dt) {                                                                     \
    case paddle::DataType::FLOAT32: {                                               \
      using T = float;                                                              \
      __VA_ARGS__;                                                                  \
    } break;                                                                        \
    case paddle::DataType::FLOAT16: {                                               \
      using T = __half;                                                             \
      __VA_ARGS__;                                                                  \
    } break;                                                                        \
    case paddle::DataType::BFLOAT16: {                                              \
      using T = __nv_bfloat16;                                                      \
      __VA_ARGS__;                                                                  \
    } break;                                                                        \
    default:                                                                        \
      PD_THROW(op, ": unsupported dtype (float32, float16, bfloat16)");             \
  }

// The first call of an op that allocates or creates handles (kept for later calls) must not be captured.
inline void require_eager(cudaStream_t s, const char* what) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(s, &st);
  PD_CHECK(st == cudaStreamCaptureStatusNone, what);
}

// ---------------------------------------------------------------- programmatic dependent launch
// Hopper's PDL lets a kernel's blocks start while the kernel before it in the stream is still running:
// each of our kernels signals `pdl_trigger()` on entry (its dependents may be scheduled) and calls
// `pdl_wait()` (griddepcontrol.wait: every earlier kernel has finished and its writes are visible)
// before it touches memory another kernel writes. So the launch and the ramp-up of kernel i + 1 hide
// behind kernel i, and the decode GEMV streams its weights before it waits (ops_linear.cu). Inside a
// CUDA graph the dependencies become programmatic edges. Without the launch attribute, or before sm_90,
// both calls do nothing and launches serialize as usual (FDLITE_PDL=0 turns the attribute off: see `Options`).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The compute capability of the device current at the first call, as 10 major + minor (90: Hopper).
inline int compute_capability() {
  static const int cc = [] {
    int dev = 0, major = 0, minor = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    return 10 * major + minor;
  }();
  return cc;
}

// The PDL mode (`options().pdl`, ops_options.h) in force: the option on sm_90 and later, else 0.
inline int pdl_mode() { return compute_capability() >= 90 ? options().pdl : 0; }

inline bool& last_launch_ours() {
  thread_local bool ours = false;
  return ours;
}

// Whether an op on `rows` tokens launches with PDL: only decode batches of at most 4, where every kernel of
// the step is ours (the GEMV replaces cuBLAS) and each is a few microseconds. Measured on the H100 (docs/
// benchmarks.md, round 14): PDL takes the batch-1 graph body from 1.06 to 0.92 ms, but at batch 16-64 the
// decode-attention kernel launched early made the body 0.2-0.25 ms slower, and at 256 it changed nothing. Again on
// 11-27 (every op at any batch, after cuBLASLt too, with or without the decode attention): bodies within 1%, the
// protocol 0.5% slower.
constexpr int64_t kPdlMaxRows = 4;
inline bool pdl_rows(int64_t rows) { return rows <= kPdlMaxRows; }

// Work enqueued by someone else's code (a cuBLAS GEMM, a memcpy) since our last kernel.
inline void note_foreign_work() { last_launch_ours() = false; }

// kernel<<<grid, block, smem, s>>>(args...), with the PDL attribute when `pdl` is true and the mode allows
// it (the kernel must then call pdl_wait() before reading or writing anything earlier kernels touch).
template <typename... KArgs, typename... Args>
void launch(const char* what, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
            bool pdl, Args&&... args) {
  const int mode = pdl_mode();
  const bool use = pdl && (mode == 1 || (mode == 2 && last_launch_ours()));
  last_launch_ours() = true;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = use ? 1 : 0;
  FDL_CHECK_CUDA(cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(std::forward<Args>(args))...), what);
}

// ---------------------------------------------------------------- device-side conversions
template <typename T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Round a float through T and back: reproduces the framework's rounding after each op.
template <typename T>
__device__ __forceinline__ float round_to(float v) { return to_f<T>(from_f<T>(v)); }

// FP8 (e4m3) KV cache values (kv_cache_dtype="fp8", fdlite/kvcache/fp8_cache.py): bits <-> float, round to
// nearest even, saturated to +-448 (the CPU path's astype(float8_e4m3fn) of values within +-448).
__device__ __forceinline__ float e4m3_to_f(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3)));
}
__device__ __forceinline__ uint8_t f_to_e4m3(float v) { return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

// A KV-cache element as float: the model's dtype, or e4m3 bits (its scale applied by the caller).
template <typename C>
__device__ __forceinline__ float cache_to_f(C v) { return to_f<C>(v); }
template <>
__device__ __forceinline__ float cache_to_f<uint8_t>(uint8_t v) { return e4m3_to_f(v); }

// Two consecutive KV-cache elements as floats, widened together: one 2-element load, and for e4m3 one paired
// conversion (cvt.f16x2.e4m3x2) instead of two. The same values as two cache_to_f calls, bit for bit (every
// e4m3, fp16 and bf16 value is exact in float). `p` is aligned to the pair.
template <typename C>
__device__ __forceinline__ float2 cache_pair_to_f2(const C* p);
template <>
__device__ __forceinline__ float2 cache_pair_to_f2<float>(const float* p) { return *reinterpret_cast<const float2*>(p); }
template <>
__device__ __forceinline__ float2 cache_pair_to_f2<__half>(const __half* p) {
  return __half22float2(*reinterpret_cast<const __half2*>(p));
}
template <>
__device__ __forceinline__ float2 cache_pair_to_f2<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
template <>
__device__ __forceinline__ float2 cache_pair_to_f2<uint8_t>(const uint8_t* p) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(*reinterpret_cast<const __nv_fp8x2_storage_t*>(p), __NV_E4M3);
  return __half22float2(__half2(h));
}

// N elements of T moved as one aligned access (16 bytes when N * sizeof(T) == 16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T>
constexpr int vec16() { return 16 / sizeof(T); }

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// FP8 caches: ROWS staged keys of e4m3 K and V bytes (rows of D, `stride8` bytes apart; scales sc[0, ROWS) for K
// and sc[ROWS, 2 ROWS) for V) widened to T as value x scale into kw / vw (rows `strideT` elements apart), the
// block's NTH threads sharing the 16-byte pieces: the tensor-core attention kernel's tiles then hold model-dtype
// values (attention_mma.cuh).
template <typename T, int D, int ROWS, int NTH>
__device__ __forceinline__ void widen_e4m3_rows(const uint8_t* k8, const uint8_t* v8, int stride8, const float* sc,
                                                T* kw, T* vw, int strideT) {
  constexpr int V8 = D / 16;
  for (int i = threadIdx.x; i < 2 * ROWS * V8; i += NTH) {
    const int kv = i / (ROWS * V8), u = i - kv * (ROWS * V8);
    const int key = u / V8, c = u - key * V8;
    const uint4 raw = *reinterpret_cast<const uint4*>((kv ? v8 : k8) + key * stride8 + c * 16);
    const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw);
    const float f = sc[kv * ROWS + key];
    Vec<T, 8> lo, hi;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      lo.v[e] = from_f<T>(e4m3_to_f(b[e]) * f);
      hi.v[e] = from_f<T>(e4m3_to_f(b[8 + e]) * f);
    }
    T* dst = (kv ? vw : kw) + key * strideT + c * 16;
    *reinterpret_cast<Vec<T, 8>*>(dst) = lo;
    *reinterpret_cast<Vec<T, 8>*>(dst + 8) = hi;
  }
}

// Row of key position kk of a paged sequence (block table btab) for KV head j, in a cache viewed as rows of
// head_dim: [num_blocks + 1, kv_heads, block_size, head_dim] (FastDeploy's layout).
__device__ __forceinline__ int cache_row(const int* btab, int kvh, int j, int bs, int kk) {
  return (btab[kk / bs] * kvh + j) * bs + kk % bs;
}

// ---------------------------------------------------------------- asynchronous copies to shared memory
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  const int n = valid ? 16 : 0;  // 0: fill the 16 bytes with zeros, read nothing
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
// 4 bytes (an FP8 cache row's scale); zeros when !valid.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// "memory": shared-memory reads after it may not be moved above it (no block barrier needs to follow).
// Until at most N of this thread's most recent commit groups are still in flight (multi-stage pipelines).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { cp_async_wait<0>(); }

// ---------------------------------------------------------------- reductions
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// `WarpOp` (warp_sum, warp_max) over the block (blockDim.x a multiple of 32, at most 1024): each warp's part, then
// the parts in warp 0 (`idle` for the warps the block does not have); every thread gets the result.
template <float (*WarpOp)(float)>
__device__ __forceinline__ float block_reduce(float v, float idle) {
  __shared__ float part[32];
  __shared__ float total;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = WarpOp(v);
  if (lane == 0) part[wid] = v;
  __syncthreads();
  if (wid == 0) {
    float s = lane < nw ? part[lane] : idle;
    s = WarpOp(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

__device__ __forceinline__ float block_sum(float v) { return block_reduce<warp_sum>(v, 0.f); }
__device__ __forceinline__ float block_max(float v) { return block_reduce<warp_max>(v, -__int_as_float(0x7f800000)); }

}  // namespace fdl
