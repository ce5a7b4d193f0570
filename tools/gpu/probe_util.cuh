// Shared by the standalone device probes (gemv_pdl_bench.cu, lt_algo_probe.cu, lt_l2_probe.cu, lt_search_probe.cu;
// no Paddle): error checks, a random bf16 fill, the median GPU time of a captured CUDA graph (`reps` replays after
// `warm`), the dense models' decode projections, random per-layer weights, fdl_linear's cuBLASLt GEMM form and what
// the cuBLASLt probes set up.
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

// A decode projection (weight [N, K]) and the dense models the probes measure: their layers' four projections.
struct Shape {
  const char* name;
  int K, N;
};
struct Model {
  const char* name;
  int layers;
  Shape shapes[4];
};
constexpr Model kQwen3_06b = {
    "qwen3_0.6b", 28, {{"qkv", 1024, 4096}, {"o_proj", 2048, 1024}, {"gate_up", 1024, 6144}, {"down", 3072, 1024}}};
constexpr Model kLlama31_8b = {
    "llama31_8b", 32, {{"qkv", 4096, 6144}, {"o_proj", 4096, 4096}, {"gate_up", 4096, 28672}, {"down", 14336, 4096}}};

// Random bf16 weights [N, K] for `layers` layers of the projections `shapes` (any type with K and N), layer-major:
// w[l * n + j], each its own allocation (so a layer's are not served from L2 when the next is read).
template <typename S>
std::vector<bf16*> layer_weights(int layers, const S* shapes, int n, cudaStream_t s) {
  std::vector<bf16*> w(layers * n);
  for (int l = 0; l < layers; ++l)
    for (int j = 0; j < n; ++j) {
      const size_t elems = (size_t)shapes[j].K * shapes[j].N;  // not `e`: CK's own variable
      CK(cudaMalloc(&w[l * n + j], elems * 2));
      fill_rand<<<1024, 256, 0, s>>>(w[l * n + j], elems, 77 + l * n + j);
    }
  return w;
}

// fdl_linear's cuBLASLt GEMM for M > 4 (ops_linear.cu): the weight W [N, K] row-major, run as the transposed A of the
// column-major y^T [N, M] = W' x^T; bf16 in and out, fp32 accumulation. destroy() frees the descriptors.
struct TnGemm {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;

  TnGemm(int K, int N, int M) {
    LK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    LK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, K, N, K));
    LK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, K, M, K));
    LK(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, N, M, N));
  }

  // The heuristic's first `max` algorithms for a workspace of `ws` bytes into res; returns how many it gave.
  int heuristics(cublasLtHandle_t h, size_t ws, int max, cublasLtMatmulHeuristicResult_t* res) const {
    cublasLtMatmulPreference_t pref;
    LK(cublasLtMatmulPreferenceCreate(&pref));
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    int n = 0;
    LK(cublasLtMatmulAlgoGetHeuristic(h, op, a, b, d, d, pref, max, res, &n));
    cublasLtMatmulPreferenceDestroy(pref);
    return n;
  }

  // y = x W^T with `algo` on stream s (queued, or captured); cuBLASLt's status
  cublasStatus_t run(cublasLtHandle_t h, const cublasLtMatmulAlgo_t& algo, const bf16* w, const bf16* x, bf16* y,
                     void* ws, size_t ws_bytes, cudaStream_t s) const {
    const float al = 1.f, be = 0.f;
    return cublasLtMatmul(h, op, &al, w, a, x, b, &be, y, d, y, d, &algo, ws, ws_bytes, s);
  }

  void destroy() {
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(d);
    cublasLtMatmulDescDestroy(op);
  }
};

// What the cuBLASLt probes set up: a stream, a cuBLASLt handle, a workspace of `ws_bytes`, and activations x (random)
// and y of `elems` bf16 each. Nothing is freed: the process ends.
struct LtProbe {
  cudaStream_t s;
  cublasLtHandle_t h;
  void* ws;
  size_t ws_bytes;
  bf16 *x, *y;

  LtProbe(size_t ws_bytes_, size_t elems) : ws_bytes(ws_bytes_) {
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    LK(cublasLtCreate(&h));
    CK(cudaMalloc(&ws, ws_bytes));
    CK(cudaMalloc(&x, elems * 2));
    CK(cudaMalloc(&y, elems * 2));
    fill_rand<<<1024, 256, 0, s>>>(x, elems, 5);
  }
};
