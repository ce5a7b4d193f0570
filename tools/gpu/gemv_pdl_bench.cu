// Standalone probe (no Paddle): does a row-dot GEMV over [N, K] weights with programmatic dependent
// launch (PDL, sm_90) beat cuBLASLt for the batch-1 decode projections of a Qwen3-0.6B-shaped model?
//
// Measured as CUDA-graph replays (our events, median of 20 after 3 warm-up), over 28 layers of distinct
// weights (880 MB of bf16, so nothing is served from L2):
//   chain   : 224 tiny dependent kernels, plain launches vs PDL (the per-boundary cost)
//   gemm_*  : the 112 projections of 28 layers at M = 1 / 4, cuBLASLt NN on [K, N] (fdlite today),
//             cuBLASLt TN on [N, K], row-dot GEMV on [N, K] without and with PDL
//   layer_* : the same with 5 tiny kernels between (norm, rope, attention x 2, silu stand-ins)
//   tn_vs_nn: cuBLASLt NN vs TN at M = 16..2048 (does storing [N, K] cost the large batches?)
// Build: nvcc -O3 -std=c++20 -gencode=arch=compute_90,code=sm_90 gemv_pdl_bench.cu -lcublasLt -o b
#include "probe_util.cuh"


__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

template <typename... KA, typename... A>
void launch(void (*k)(KA...), dim3 g, dim3 b, size_t smem, cudaStream_t s, bool pdl, A... args) {
  if (smem > 48 * 1024) CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = g;
  cfg.blockDim = b;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, k, static_cast<KA>(args)...));
}

__global__ void tiny(float* p, int n) {
  pdl_launch();
  pdl_wait();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] += 1.f;
}

__device__ __forceinline__ float dot8(uint4 w, uint4 x, float acc) {
  const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&w);
  const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = __bfloat1622float2(wp[i]), b = __bfloat1622float2(xp[i]);
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
  return acc;
}

// y[m, n] = sum_k x[m, k] W[n, k]; one warp per R rows, NV 16-byte vectors per lane per row (K = 256 NV).
// The weights are loaded before griddepcontrol.wait: under PDL they stream while the previous kernel runs.
// SMEM: the loads go through cp.async into shared memory (each lane reads back only what it copied), so
// the compiler cannot sink them past the wait to save registers.
__device__ __forceinline__ void cp16(void* smem, const void* g) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(g));
}

template <int M, int NV, int R, bool SMEM>
__global__ void __launch_bounds__(256) rowdot(const bf16* __restrict__ W, const bf16* __restrict__ x,
                                              bf16* __restrict__ y, int N, int K) {
  pdl_launch();
  extern __shared__ uint4 wsm[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * 8 + warp) * R;
  uint4 w[R][NV];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int n = min(n0 + r, N - 1);
    const uint4* wr = reinterpret_cast<const uint4*>(W + (size_t)n * K);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (SMEM) cp16(wsm + ((warp * R + r) * NV + i) * 32 + lane, wr + lane + 32 * i);
      else w[r][i] = __ldg(wr + lane + 32 * i);
    }
  }
  if (SMEM) asm volatile("cp.async.commit_group;\n" ::);
  pdl_wait();
  if (SMEM) {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < NV; ++i) w[r][i] = wsm[((warp * R + r) * NV + i) * 32 + lane];
  }
  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)m * K);
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const uint4 xv = xr[lane + 32 * i];
#pragma unroll
      for (int r = 0; r < R; ++r) acc[m][r] = dot8(w[r][i], xv, acc[m][r]);
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = acc[m][r];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0 && n0 + r < N) y[(size_t)m * N + n0 + r] = __float2bfloat16_rn(v);
    }
}

constexpr const Shape* kShapes = kQwen3_06b.shapes;
constexpr int L = kQwen3_06b.layers;

template <int M, int R, bool SMEM = false>
void rowdot_launch(const bf16* W, const bf16* x, bf16* y, int N, int K, cudaStream_t s, bool pdl) {
  const dim3 grid((N + 8 * R - 1) / (8 * R));
  const size_t sm = SMEM ? (size_t)8 * R * K * 2 : 0;
  switch (K / 256) {
    case 4: launch(rowdot<M, 4, R, SMEM>, grid, dim3(256), sm, s, pdl, W, x, y, N, K); break;
    case 8: launch(rowdot<M, 8, R, SMEM>, grid, dim3(256), sm, s, pdl, W, x, y, N, K); break;
    case 12: launch(rowdot<M, 12, R, SMEM>, grid, dim3(256), sm, s, pdl, W, x, y, N, K); break;
    default: printf("bad K %d\n", K); exit(1);
  }
}

struct Lt {
  cublasLtHandle_t h;
  void* ws;
  size_t wsb = 32u << 20;
  struct P {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
  };
  P plan(int M, int N, int K, bool tn) {
    P p;
    LK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = tn ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
    LK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    LK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    if (tn) LK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, K, N, K));
    else LK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, N, K, N));
    LK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, K, M, K));
    LK(cublasLtMatrixLayoutCreate(&p.d, CUDA_R_16BF, N, M, N));
    cublasLtMatmulPreference_t pref;
    LK(cublasLtMatmulPreferenceCreate(&pref));
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
    cublasLtMatmulHeuristicResult_t res{};
    int n = 0;
    LK(cublasLtMatmulAlgoGetHeuristic(h, p.op, p.a, p.b, p.d, p.d, pref, 1, &res, &n));
    if (n == 0) { printf("no algo\n"); exit(1); }
    p.algo = res.algo;
    return p;
  }
  void run(const P& p, const bf16* W, const bf16* x, bf16* y, cudaStream_t s) {
    const float al = 1.f, be = 0.f;
    LK(cublasLtMatmul(h, p.op, &al, W, p.a, x, p.b, &be, y, p.d, y, p.d, &p.algo, ws, wsb, s));
  }
};



// [N, K] from [K, N]
__global__ void transpose_kn(const bf16* a, bf16* b, int K, int N) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)K * N; i += (size_t)gridDim.x * blockDim.x) {
    const size_t k = i / N, n = i % N;
    b[n * K + k] = a[i];
  }
}

int main() {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Lt lt;
  LK(cublasLtCreate(&lt.h));
  CK(cudaMalloc(&lt.ws, lt.wsb));

  // chain of tiny kernels
  float* tp;
  CK(cudaMalloc(&tp, 4096 * sizeof(float)));
  for (int pdl = 0; pdl < 2; ++pdl) {
    const float ms = graph_ms(s, [&] {
      for (int i = 0; i < 224; ++i) launch(tiny, dim3(4), dim3(256), 0, s, pdl, tp, 1024);
    });
    printf("{\"case\":\"chain224\",\"pdl\":%d,\"ms\":%.4f,\"us_per_kernel\":%.3f}\n", pdl, ms, ms * 1e3 / 224);
  }

  // weights: 28 layers, both layouts
  std::vector<bf16*> wkn(4 * L), wnk(4 * L);
  size_t total = 0;
  for (int l = 0; l < L; ++l)
    for (int j = 0; j < 4; ++j) {
      const Shape& sh = kShapes[j];
      const size_t n = (size_t)sh.K * sh.N;
      CK(cudaMalloc(&wkn[l * 4 + j], n * 2));
      CK(cudaMalloc(&wnk[l * 4 + j], n * 2));
      fill_rand<<<1024, 256, 0, s>>>(wkn[l * 4 + j], n, 77 + l * 4 + j);
      transpose_kn<<<1024, 256, 0, s>>>(wkn[l * 4 + j], wnk[l * 4 + j], sh.K, sh.N);
      total += n * 2;
    }
  bf16 *x, *y, *y2;
  CK(cudaMalloc(&x, 2048 * 6144 * 2));
  CK(cudaMalloc(&y, 2048 * 6144 * 2));
  CK(cudaMalloc(&y2, 2048 * 6144 * 2));
  fill_rand<<<1024, 256, 0, s>>>(x, 2048 * 6144, 5);
  CK(cudaStreamSynchronize(s));
  printf("{\"case\":\"weights\",\"MB_per_layout\":%.1f}\n", total / 1e6);

  // correctness: rowdot vs cuBLASLt NN, M = 1 and 4
  for (int j = 0; j < 4; ++j) {
    const Shape& sh = kShapes[j];
    for (int M : {1, 4}) {
      Lt::P p = lt.plan(M, sh.N, sh.K, false);
      lt.run(p, wkn[j], x, y, s);
      if (M == 1) rowdot_launch<1, 1, true>(wnk[j], x, y2, sh.N, sh.K, s, true);
      else rowdot_launch<4, 2>(wnk[j], x, y2, sh.N, sh.K, s, true);
      std::vector<bf16> a((size_t)M * sh.N), b((size_t)M * sh.N);
      CK(cudaMemcpyAsync(a.data(), y, a.size() * 2, cudaMemcpyDeviceToHost, s));
      CK(cudaMemcpyAsync(b.data(), y2, b.size() * 2, cudaMemcpyDeviceToHost, s));
      CK(cudaStreamSynchronize(s));
      float md = 0, mx = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        md = std::max(md, std::abs(__bfloat162float(a[i]) - __bfloat162float(b[i])));
        mx = std::max(mx, std::abs(__bfloat162float(a[i])));
      }
      printf("{\"case\":\"check\",\"shape\":\"%s\",\"M\":%d,\"max_abs_diff\":%.3g,\"max_abs\":%.3g}\n", sh.name, M, md, mx);
    }
  }

  // 112 projections (+ 5 tiny kernels per layer in the layer_* variants)
  for (int M : {1, 4}) {
    Lt::P pn[4], pt[4];
    for (int j = 0; j < 4; ++j) {
      pn[j] = lt.plan(M, kShapes[j].N, kShapes[j].K, false);
      pt[j] = lt.plan(M, kShapes[j].N, kShapes[j].K, true);
    }
    for (int with_tiny = 0; with_tiny < 2; ++with_tiny) {
      const char* tag = with_tiny ? "layer" : "gemm";
      auto tinies = [&](int n, bool pdl) {
        if (with_tiny)
          for (int i = 0; i < n; ++i) launch(tiny, dim3(4), dim3(256), 0, s, pdl, tp, 1024);
      };
      // stand-in order: norm | qkv | rope, attn, attn-reduce | o | norm | gate_up | silu | down
      const int before[4] = {1, 3, 1, 1};
      for (int variant = 0; variant < 7; ++variant) {
        const char* names[7] = {"cublaslt_nn", "cublaslt_tn", "rowdot_r1", "rowdot_r1_pdl", "rowdot_r2_pdl",
                                "rowdot_smem_r1_pdl", "rowdot_smem_r1"};
        const bool pdl = variant >= 3 && variant <= 5;
        const float ms = graph_ms(s, [&] {
          for (int l = 0; l < L; ++l)
            for (int j = 0; j < 4; ++j) {
              tinies(before[j], pdl);
              const Shape& sh = kShapes[j];
              const int wi = l * 4 + j;
              if (variant == 0) lt.run(pn[j], wkn[wi], x, y, s);
              else if (variant == 1) lt.run(pt[j], wnk[wi], x, y, s);
              else if (variant <= 3) {
                if (M == 1) rowdot_launch<1, 1>(wnk[wi], x, y, sh.N, sh.K, s, pdl);
                else rowdot_launch<4, 1>(wnk[wi], x, y, sh.N, sh.K, s, pdl);
              } else if (variant == 4) {
                if (M == 1) rowdot_launch<1, 2>(wnk[wi], x, y, sh.N, sh.K, s, pdl);
                else rowdot_launch<4, 2>(wnk[wi], x, y, sh.N, sh.K, s, pdl);
              } else {
                if (M == 1) rowdot_launch<1, 1, true>(wnk[wi], x, y, sh.N, sh.K, s, pdl);
                else rowdot_launch<4, 1, true>(wnk[wi], x, y, sh.N, sh.K, s, pdl);
              }
            }
        });
        printf("{\"case\":\"%s\",\"M\":%d,\"variant\":\"%s\",\"ms\":%.4f,\"TBps\":%.2f}\n", tag, M, names[variant], ms,
               total / (ms * 1e-3) / 1e12);
      }
    }
  }

  // NN vs TN at larger M (each shape over the 28 layers' weights)
  for (int M : {16, 64, 256, 2048})
    for (int j = 0; j < 4; ++j) {
      const Shape& sh = kShapes[j];
      Lt::P pn = lt.plan(M, sh.N, sh.K, false), pt = lt.plan(M, sh.N, sh.K, true);
      const float a = graph_ms(s, [&] { for (int l = 0; l < L; ++l) lt.run(pn, wkn[l * 4 + j], x, y, s); });
      const float b = graph_ms(s, [&] { for (int l = 0; l < L; ++l) lt.run(pt, wnk[l * 4 + j], x, y, s); });
      printf("{\"case\":\"tn_vs_nn\",\"shape\":\"%s\",\"M\":%d,\"nn_us\":%.2f,\"tn_us\":%.2f}\n", sh.name, M,
             a * 1e3 / L, b * 1e3 / L);
    }
  printf("{\"case\":\"done\"}\n");
  return 0;
}
