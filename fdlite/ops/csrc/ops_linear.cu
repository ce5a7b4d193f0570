// Linear layers through cuBLASLt: y[M, N] = x[M, K] @ W (+ bias), fp32 accumulation.
//
// fdlite stores Linear weights as Paddle's [in, out] = [K, N]; a tied LM head reads the embedding
// [N, K] transposed (trans_w). The bias rides in cuBLASLt's epilogue. Paddle's own matmul does
// nothing on sm_90 with PyPI's wheel (ops_common.cuh); measured in SPIKE2, cuBLAS from a custom op
// runs at torch.matmul's speed.
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
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(s, &st);
    PD_CHECK(st == cudaStreamCaptureStatusNone,
             "fdl_linear: the first call on a device must run eagerly (it creates cuBLAS handles and the workspace)");
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
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < m * n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] = from_f<T>(to_f<T>(y[i]) + to_f<T>(b[i % n]));
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
            bool trans_w, bool has_bias, const char* opname) {
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
                     add_bias_kernel<T><<<(unsigned)blocks, threads, 0, s>>>(static_cast<T*>(y.data()),
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

// fdl_linear(x [..., K], w, bias, trans_w, has_bias) -> y [..., N] in x's dtype.
// w is [K, N] (fdlite's Linear layout), or [N, K] with trans_w (a tied embedding as LM head).
// bias [N] is read only when has_bias (pass any GPU tensor otherwise).
std::vector<paddle::Tensor> Linear(const paddle::Tensor& x, const paddle::Tensor& w, const paddle::Tensor& bias,
                                   bool trans_w, bool has_bias) {
  PD_CHECK(w.shape().size() == 2, "fdl_linear: weight must be 2-D");
  paddle::Tensor y = paddle::empty(out_shape(x.shape(), w.shape(), trans_w), x.dtype(), x.place());
  linear(x, w, bias, y, trans_w, has_bias, "fdl_linear");
  return {y};
}

PD_BUILD_OP(fdl_linear)
    .Inputs({"X", "W", "Bias"})
    .Outputs({"Out"})
    .Attrs({"trans_w: bool", "has_bias: bool"})
    .SetKernelFn(PD_KERNEL(Linear));

// fdl_linear_(out, x, w, bias, trans_w, has_bias): into a preallocated out, which may be float32
// for half inputs (logits straight from the LM head, no cast pass).
std::vector<paddle::Tensor> LinearInplace(paddle::Tensor& out, const paddle::Tensor& x, const paddle::Tensor& w,
                                          const paddle::Tensor& bias, bool trans_w, bool has_bias) {
  linear(x, w, bias, out, trans_w, has_bias, "fdl_linear_");
  return {};
}

PD_BUILD_OP(fdl_linear_)
    .Inputs({"Out", "X", "W", "Bias"})
    .Outputs({"OutRef"})
    .Attrs({"trans_w: bool", "has_bias: bool"})
    .SetInplaceMap({{"Out", "OutRef"}})
    .SetKernelFn(PD_KERNEL(LinearInplace));
