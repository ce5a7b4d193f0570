// Linear layers: y[M, N] = x[M, K] @ W (+ bias), fp32 accumulation.
//
// W is [K, N], or [N, K] with trans_w (fdlite's GPU Linear layout, and a tied embedding as LM head).
// - M <= 4 with trans_w (decode at batch 1-4): our GEMV kernel, one warp per output row. Its weights
//   are copied into shared memory before it waits for the previous kernel (programmatic dependent
//   launch, ops_common.cuh), so weight streaming overlaps the kernels before it. Measured on the H100
//   for Qwen3-0.6B's 112 projections at M = 1: 0.40 ms against cuBLASLt's 0.68 ms (docs/benchmarks.md).
// - otherwise cuBLASLt, the bias in its epilogue. Paddle's own matmul does nothing on sm_90 with PyPI's
//   wheel (ops_common.cuh); measured on the H100 (docs/design.md, "The GPU host framework"), cuBLAS from a custom op runs at torch.matmul's speed.
//
// Capture safety: the handles and the workspace (plain cudaMalloc, outside Paddle's allocator) are
// made by the first call on each device, which must be eager (checked); later calls, inside a
// capture too, only create host-side descriptors (cached per shape) and enqueue on x's stream.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <map>
#include <mutex>
#include <tuple>

#include "ops_common.cuh"

namespace fdl {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // cuBLASLt's recommendation for Hopper
constexpr int kMaxDevices = 16;

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;  // false: no cuBLASLt algorithm, fall back to cublasGemmEx + bias kernel
};

// (M, N, K, in dtype, out dtype, trans_w, has_bias, alignment bits of A/B/D/bias)
using Key = std::tuple<int64_t, int64_t, int64_t, int, int, bool, bool, int>;

struct DeviceCtx {
  cublasLtHandle_t lt = nullptr;
  cublasHandle_t blas = nullptr;
  void* ws = nullptr;
  std::map<Key, Plan> plans;
};

std::mutex g_mu;
DeviceCtx g_ctx[kMaxDevices];

DeviceCtx& device_ctx(cudaStream_t s) {
  int dev = 0;
  FDL_CHECK_CUDA(cudaGetDevice(&dev), "fdl_linear: cudaGetDevice");
  PD_CHECK(dev >= 0 && dev < kMaxDevices, "fdl_linear: device index out of range");
  DeviceCtx& c = g_ctx[dev];
  if (c.lt == nullptr) {
    require_eager(s, "fdl_linear: the first call on a device must run eagerly (it creates cuBLAS handles and the workspace)");
    PD_CHECK(cublasLtCreate(&c.lt) == CUBLAS_STATUS_SUCCESS, "fdl_linear: cublasLtCreate failed");
    PD_CHECK(cublasCreate(&c.blas) == CUBLAS_STATUS_SUCCESS, "fdl_linear: cublasCreate failed");
    FDL_CHECK_CUDA(cudaMalloc(&c.ws, kWorkspaceBytes), "fdl_linear: workspace cudaMalloc");
  }
  return c;
}

cudaDataType_t cuda_type(paddle::DataType t) {
  switch (t) {
    case paddle::DataType::FLOAT32: return CUDA_R_32F;
    case paddle::DataType::FLOAT16: return CUDA_R_16F;
    case paddle::DataType::BFLOAT16: return CUDA_R_16BF;
    default: PD_THROW("fdl_linear: unsupported dtype (float32, float16, bfloat16)");
  }
  return CUDA_R_32F;
}

int align_bits(const void* p) {  // 16/8/4/2-byte alignment, as cuBLASLt's preference wants it
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  return (v & 15) == 0 ? 16 : (v & 7) == 0 ? 8 : (v & 3) == 0 ? 4 : 2;
}

template <typename T>
__global__ void add_bias_kernel(T* __restrict__ y, const T* __restrict__ b, int64_t m, int64_t n) {
  pdl_trigger();
  pdl_wait();
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < m * n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] = from_f<T>(to_f<T>(y[i]) + to_f<T>(b[i % n]));
}

// ------------------------------------------------------------------ decode GEMV (M <= 4, W [N, K])
constexpr int kGemvMaxM = 4;
constexpr int kGemvSmem = 96 * 1024;  // weight rows staged per block, at most

// y[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]): one warp per row n, blockDim.x / 32 rows per block.
// Each lane copies its own 16-byte pieces of the row into shared memory (cp.async) and reads back only
// those, so no block barrier is needed. The copies are issued before pdl_wait(): W must not be written by
// a kernel still in flight (true of weights; callers pass static_w only then, else no PDL launch).
template <typename T, typename O, int M>
__global__ void __launch_bounds__(256) gemv_kernel(O* __restrict__ y, const T* __restrict__ x,
                                                   const T* __restrict__ W, const T* __restrict__ bias, int N,
                                                   int K) {
  extern __shared__ uint4 gemv_smem[];
  constexpr int VE = 16 / sizeof(T);
  const int nv = K / VE;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = blockIdx.x * (blockDim.x >> 5) + warp;
  uint4* ws = gemv_smem + (size_t)warp * nv;
  if (n < N) {
    const uint4* wr = reinterpret_cast<const uint4*>(W + (size_t)n * K);
    for (int v = lane; v < nv; v += 32) cp_async16(ws + v, wr + v);
  }
  cp_async_commit();
  pdl_trigger();
  pdl_wait();
  cp_async_wait_all();
  if (n >= N) return;
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
#pragma unroll 4
  for (int v = lane; v < nv; v += 32) {
    const Vec<T, VE> w = reinterpret_cast<const Vec<T, VE>*>(ws)[v];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const Vec<T, VE> xv = reinterpret_cast<const Vec<T, VE>*>(x + (size_t)m * K)[v];
#pragma unroll
      for (int e = 0; e < VE; ++e) acc[m] = fmaf(to_f<T>(w.v[e]), to_f<T>(xv.v[e]), acc[m]);
    }
  }
  const float b = bias != nullptr ? to_f<T>(bias[n]) : 0.f;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float v = warp_sum(acc[m]);
    if (lane == 0) y[(size_t)m * N + n] = from_f<O>(v + b);
  }
}

bool gemv_enabled() { return options().gemv; }

// Rows of W per block: up to 8 warps, as many as kGemvSmem holds; 0 = the row does not fit.
int gemv_warps(int64_t K, size_t elem) { return (int)std::min<int64_t>(8, kGemvSmem / (K * (int64_t)elem)); }

template <typename T, typename O>
void launch_gemv(O* y, const T* x, const T* w, const T* bias, int64_t M, int64_t N, int64_t K, bool pdl,
                 cudaStream_t s) {
  const int warps = gemv_warps(K, sizeof(T));
  const size_t smem = (size_t)warps * K * sizeof(T);
  const dim3 grid((unsigned)ceil_div(N, warps)), block(warps * 32);
  using Kernel = void (*)(O*, const T*, const T*, const T*, int, int);
  static const Kernel kernels[kGemvMaxM] = {gemv_kernel<T, O, 1>, gemv_kernel<T, O, 2>, gemv_kernel<T, O, 3>,
                                            gemv_kernel<T, O, 4>};
  static bool init = false;
  if (!init) {  // host-side attributes, once per instantiation (also fine during a capture)
    for (Kernel k : kernels)
      FDL_CHECK_CUDA(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kGemvSmem),
                     "fdl_linear: cudaFuncSetAttribute");
    init = true;
  }
  launch("fdl_linear (gemv)", kernels[M - 1], grid, block, smem, s, pdl, y, x, w, bias, (int)N, (int)K);
}

#define LT_OK(expr) PD_CHECK((expr) == CUBLAS_STATUS_SUCCESS, "fdl_linear: ", #expr, " failed")

Plan& get_plan(DeviceCtx& c, const Key& key, cudaDataType_t tin, cudaDataType_t tout, int64_t M, int64_t N, int64_t K,
               bool trans_w, bool has_bias, const void* x, const void* w, const void* y, const void* bias) {
  auto it = c.plans.find(key);
  if (it != c.plans.end()) return it->second;
  Plan p;
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;  // fp32 accumulate; no TF32 for fp32 inputs
  LT_OK(cublasLtMatmulDescCreate(&p.op, compute, CUDA_R_32F));
  // Column-major view: y^T [N, M] = W' [N, K] * x^T [K, M], W' = W^T of the row-major [K, N] weight.
  cublasOperation_t ta = trans_w ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
  LT_OK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  LT_OK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (has_bias) {
    cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
    LT_OK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof(ep)));
  }
  if (trans_w)
    LT_OK(cublasLtMatrixLayoutCreate(&p.a, tin, K, N, K));  // embedding [N, K] row-major = [K, N] col-major
  else
    LT_OK(cublasLtMatrixLayoutCreate(&p.a, tin, N, K, N));
  LT_OK(cublasLtMatrixLayoutCreate(&p.b, tin, K, M, K));
  LT_OK(cublasLtMatrixLayoutCreate(&p.d, tout, N, M, N));
  cublasLtMatmulPreference_t pref = nullptr;
  LT_OK(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws = kWorkspaceBytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  uint32_t aa = align_bits(w), ab = align_bits(x), ad = align_bits(y);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof(aa));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof(ab));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ad, sizeof(ad));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ad, sizeof(ad));
  cublasLtMatmulHeuristicResult_t res{};
  int n = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(c.lt, p.op, p.a, p.b, p.d, p.d, pref, 1, &res, &n);
  cublasLtMatmulPreferenceDestroy(pref);
  p.ok = st == CUBLAS_STATUS_SUCCESS && n > 0;
  if (p.ok) p.algo = res.algo;
  (void)bias;
  return c.plans.emplace(key, p).first->second;
}

void linear(const paddle::Tensor& x, const paddle::Tensor& w, const paddle::Tensor& bias, paddle::Tensor& y,
            bool trans_w, bool has_bias, bool static_w, const char* opname) {
  check_gpu(x, opname, "x");
  check_gpu(w, opname, "weight");
  check_gpu(y, opname, "out");
  PD_CHECK(x.dtype() == w.dtype(), opname, ": x and weight dtypes differ");
  const auto& ws = w.shape();
  PD_CHECK(ws.size() == 2, opname, ": weight must be 2-D");
  const int64_t K = trans_w ? ws[1] : ws[0], N = trans_w ? ws[0] : ws[1];
  PD_CHECK(!x.shape().empty() && x.shape().back() == K, opname, ": x.shape[-1] must equal the weight's in-features");
  const int64_t M = x.numel() / K;
  PD_CHECK(y.numel() == M * N, opname, ": out must hold M x N elements");
  const bool mixed = y.dtype() != x.dtype();
  PD_CHECK(!mixed || y.dtype() == paddle::DataType::FLOAT32, opname, ": out dtype must be x's or float32");
  if (has_bias) {
    check_gpu(bias, opname, "bias");
    PD_CHECK(!mixed, opname, ": a bias needs out in x's dtype");
    PD_CHECK(bias.numel() == N && bias.dtype() == x.dtype(), opname, ": bias must be [N] of x's dtype");
  }
  if (M == 0 || N == 0) return;
  cudaStream_t s = stream_of(x);
  const size_t elem = x.dtype() == paddle::DataType::FLOAT32 ? 4 : 2;
  if (trans_w && M <= kGemvMaxM && gemv_enabled() && (K * (int64_t)elem) % 16 == 0 && gemv_warps(K, elem) > 0 &&
      N < (int64_t)1 << 31 && aligned16(x.data()) && aligned16(w.data())) {
    const void* b = has_bias ? bias.data() : nullptr;
    FDL_FLOAT_SWITCH(x.dtype(), T, opname, {
      if (mixed)
        launch_gemv<T, float>(static_cast<float*>(y.data()), static_cast<const T*>(x.data()),
                              static_cast<const T*>(w.data()), static_cast<const T*>(b), M, N, K, static_w, s);
      else
        launch_gemv<T, T>(static_cast<T*>(y.data()), static_cast<const T*>(x.data()), static_cast<const T*>(w.data()),
                          static_cast<const T*>(b), M, N, K, static_w, s);
    });
    return;
  }
  note_foreign_work();  // cuBLAS's kernels do not take part in PDL: the kernel after them launches normally
  cudaDataType_t tin = cuda_type(x.dtype()), tout = cuda_type(y.dtype());
  std::lock_guard<std::mutex> lock(g_mu);
  DeviceCtx& c = device_ctx(s);
  const int al = align_bits(x.data()) | (align_bits(w.data()) << 5) | (align_bits(y.data()) << 10) |
                 (has_bias ? align_bits(bias.data()) << 15 : 0);
  Key key{M, N, K, (int)tin, (int)tout, trans_w, has_bias, al};
  Plan& p = get_plan(c, key, tin, tout, M, N, K, trans_w, has_bias, x.data(), w.data(), y.data(),
                     has_bias ? bias.data() : nullptr);
  const float alpha = 1.f, beta = 0.f;
  if (p.ok) {
    if (has_bias) {
      const void* bp = bias.data();
      LT_OK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)));
    }
    const cublasStatus_t st = cublasLtMatmul(c.lt, p.op, &alpha, w.data(), p.a, x.data(), p.b, &beta, y.data(), p.d,
                                             y.data(), p.d, &p.algo, c.ws, kWorkspaceBytes, s);
    PD_CHECK(st == CUBLAS_STATUS_SUCCESS, opname, ": cublasLtMatmul failed with status ", (int)st);
    return;
  }
  // Fallback: plain GemmEx, then the bias in a second kernel.
  PD_CHECK(cublasSetStream(c.blas, s) == CUBLAS_STATUS_SUCCESS, opname, ": cublasSetStream");
  // cublasSetStream resets the workspace to cuBLAS's own pool, which may allocate: set ours again.
  PD_CHECK(cublasSetWorkspace(c.blas, c.ws, kWorkspaceBytes) == CUBLAS_STATUS_SUCCESS, opname, ": cublasSetWorkspace");
  const cublasStatus_t st =
      cublasGemmEx(c.blas, trans_w ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, (int)N, (int)M, (int)K, &alpha, w.data(),
                   tin, trans_w ? (int)K : (int)N, x.data(), tin, (int)K, &beta, y.data(), tout, (int)N,
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  PD_CHECK(st == CUBLAS_STATUS_SUCCESS, opname, ": cublasGemmEx failed with status ", (int)st);
  if (has_bias) {
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>(ceil_div(M * N, threads), (int64_t)num_sms() * 8);
    FDL_FLOAT_SWITCH(x.dtype(), T, opname,
                     launch("add_bias_kernel", add_bias_kernel<T>, (unsigned)blocks, threads, 0, s, false, static_cast<T*>(y.data()),
                                                                             static_cast<const T*>(bias.data()), M, N));
    FDL_CHECK_LAUNCH(opname);
  }
}

std::vector<int64_t> out_shape(const std::vector<int64_t>& xs, const std::vector<int64_t>& ws, bool trans_w) {
  std::vector<int64_t> ys(xs);
  ys.back() = trans_w ? ws[0] : ws[1];
  return ys;
}

}  // namespace
}  // namespace fdl

using namespace fdl;

// fdl_linear(x [..., K], w, bias, trans_w, has_bias, static_w) -> y [..., N] in x's dtype.
// w is [K, N], or [N, K] with trans_w (fdlite's GPU Linear layout; a tied embedding as LM head).
// bias [N] is read only when has_bias (pass any GPU tensor otherwise). static_w: no kernel still in
// flight writes w (model weights), so the GEMV may start reading it before the previous kernel ends.
std::vector<paddle::Tensor> Linear(const paddle::Tensor& x, const paddle::Tensor& w, const paddle::Tensor& bias,
                                   bool trans_w, bool has_bias, bool static_w) {
  PD_CHECK(w.shape().size() == 2, "fdl_linear: weight must be 2-D");
  paddle::Tensor y = paddle::empty(out_shape(x.shape(), w.shape(), trans_w), x.dtype(), x.place());
  linear(x, w, bias, y, trans_w, has_bias, static_w, "fdl_linear");
  return {y};
}

PD_BUILD_OP(fdl_linear)
    .Inputs({"X", "W", "Bias"})
    .Outputs({"Out"})
    .Attrs({"trans_w: bool", "has_bias: bool", "static_w: bool"})
    .SetKernelFn(PD_KERNEL(Linear));

// fdl_linear_(out, x, w, bias, trans_w, has_bias): into a preallocated out, which may be float32
// for half inputs (logits straight from the LM head, no cast pass).
std::vector<paddle::Tensor> LinearInplace(paddle::Tensor& out, const paddle::Tensor& x, const paddle::Tensor& w,
                                          const paddle::Tensor& bias, bool trans_w, bool has_bias, bool static_w) {
  linear(x, w, bias, out, trans_w, has_bias, static_w, "fdl_linear_");
  return {};
}

PD_BUILD_OP(fdl_linear_)
    .Inputs({"Out", "X", "W", "Bias"})
    .Outputs({"OutRef"})
    .Attrs({"trans_w: bool", "has_bias: bool", "static_w: bool"})
    .SetInplaceMap({{"Out", "OutRef"}})
    .SetKernelFn(PD_KERNEL(LinearInplace));
