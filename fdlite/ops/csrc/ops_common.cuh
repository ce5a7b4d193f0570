// Shared helpers of fdlite's GPU ops (ops_*.cu): dtype dispatch, vector loads, reductions.
//
// Why hand-written ops at all: PyPI's paddlepaddle-gpu has no sm_90 kernels, so on Hopper every
// Paddle built-in computing kernel silently does nothing; FastDeploy likewise runs its GPU hot path
// on its own compiled custom ops. Every op here runs on the stream of its first GPU tensor
// (x.stream()), allocates only through paddle::empty (the graph pool inside a capture) and never
// synchronizes, so each is safe inside a Paddle CUDAGraph capture. Inputs must be contiguous: the
// Python wrappers (fdlite/ops/gpu) check that, because Paddle would otherwise make them contiguous
// with its own (no-op on sm_90) kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <vector>

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

// N elements of T moved as one aligned access (16 bytes when N * sizeof(T) == 16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T>
constexpr int vec16() { return 16 / sizeof(T); }

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

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

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
  __shared__ float total;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) part[wid] = v;
  __syncthreads();
  if (wid == 0) {
    float s = lane < nw ? part[lane] : 0.f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

}  // namespace fdl
