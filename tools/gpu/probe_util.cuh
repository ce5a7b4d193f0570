// Shared by the standalone device probes (gemv_pdl_bench.cu, lt_algo_probe.cu, lt_l2_probe.cu; no Paddle): error
// checks, a random bf16 fill, and the median GPU time of a captured CUDA graph (`reps` replays after `warm`).
#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e = (x);                                                               \
    if (e != cudaSuccess) {                                                            \
      printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e), __FILE__, __LINE__, #x); \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)
#define LK(x)                                                                \
  do {                                                                       \
    cublasStatus_t st_ = (x);                                                \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                     \
      printf("cuBLAS error %d at %s:%d: %s\n", (int)st_, __FILE__, __LINE__, #x); \
      exit(1);                                                               \
    }                                                                        \
  } while (0)

using bf16 = __nv_bfloat16;

template <typename F>
float graph_ms(cudaStream_t s, F body, int reps = 20, int warm = 3) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  body();
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < reps + warm; ++i) {
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (i >= warm) t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  return t[t.size() / 2];
}

__global__ void fill_rand(bf16* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned v = (unsigned)(i * 2654435761u) ^ seed;
    v ^= v >> 13;
    v *= 0x5bd1e995u;
    v ^= v >> 15;
    p[i] = __float2bfloat16_rn(((v & 0xffff) / 65536.f - 0.5f) * 0.1f);
  }
}
