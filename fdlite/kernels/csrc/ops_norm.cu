// RMSNorm, fused residual-add + RMSNorm, and SiLU-and-mul: the per-token elementwise ops of a
// decoder layer, hand-written because Paddle's own kernels do nothing on sm_90 (ops_common.cuh).
//
// Rounding follows Hugging Face / fdlite's CPU path in the model dtype T: RMSNorm computes
// x * rsqrt(mean(x^2) + eps) in float32, rounds to T, then multiplies by the weight (rounded again);
// the residual sum is rounded to T before its norm is taken; silu(gate) is rounded to T before the
// product with up.
#include "ops_common.cuh"

namespace fdl {
namespace {

// One block per row. VEC elements per access (16 bytes when the row and addresses allow it).
template <typename T, int VEC, bool ADD>
__global__ void rms_norm_kernel(T* out, T* residual, const T* x, const T* __restrict__ w, int hidden,
                                float eps) {
  pdl_trigger();
  pdl_wait();  // out aliases x in the fused in-place form
  using V = Vec<T, VEC>;
  const int64_t row = blockIdx.x;
  const int nv = hidden / VEC;
  const V* xr = reinterpret_cast<const V*>(x + row * hidden);
  V* rr = reinterpret_cast<V*>(residual + row * hidden);
  float ss = 0.f;
  for (int i = threadIdx.x; i < nv; i += blockDim.x) {
    V a = xr[i];
    if (ADD) {
      V r = rr[i];
#pragma unroll
      for (int k = 0; k < VEC; ++k) a.v[k] = from_f<T>(to_f<T>(a.v[k]) + to_f<T>(r.v[k]));
      rr[i] = a;  // the new residual stream
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float f = to_f<T>(a.v[k]);
      ss += f * f;
    }
  }
  const float inv = rsqrtf(block_sum(ss) / (float)hidden + eps);
  const V* wv = reinterpret_cast<const V*>(w);
  V* orow = reinterpret_cast<V*>(out + row * hidden);
  // Second pass re-reads the row (this thread's own elements: L1/L2 hits, and with ADD its own writes).
  const V* src = ADD ? rr : xr;
  for (int i = threadIdx.x; i < nv; i += blockDim.x) {
    V a = src[i], wt = wv[i], o;
#pragma unroll
    for (int k = 0; k < VEC; ++k) o.v[k] = from_f<T>(round_to<T>(to_f<T>(a.v[k]) * inv) * to_f<T>(wt.v[k]));
    orow[i] = o;
  }
}

template <typename T, bool ADD>
void launch_rms(T* out, T* residual, const T* x, const T* w, int64_t rows, int hidden, float eps, cudaStream_t s) {
  if (rows == 0) return;
  constexpr int V16 = vec16<T>();
  const bool vec = hidden % V16 == 0 && aligned16(out) && aligned16(x) && aligned16(w) && (!ADD || aligned16(residual));
  const int nv = vec ? hidden / V16 : hidden;
  const int threads = (int)std::min<int64_t>(1024, std::max<int64_t>(32, ceil_div(nv, 32) * 32));
  if (vec)
    launch("rms_norm_kernel", rms_norm_kernel<T, V16, ADD>, (unsigned)rows, threads, 0, s, pdl_rows(rows), out, residual, x, w, hidden, eps);
  else
    launch("rms_norm_kernel", rms_norm_kernel<T, 1, ADD>, (unsigned)rows, threads, 0, s, pdl_rows(rows), out, residual, x, w, hidden, eps);
}

// out[t, i] = round(silu(gate)) * up with gate = x[t, i], up = x[t, I + i].
template <typename T, int VEC>
__global__ void silu_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t tokens, int inter) {
  pdl_trigger();
  pdl_wait();
  using V = Vec<T, VEC>;
  const int nv = inter / VEC;
  const int64_t total = tokens * nv;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / nv;
    const int c = (int)(i - t * nv);
    const V* row = reinterpret_cast<const V*>(x + t * 2 * (int64_t)inter);
    V g = row[c], u = row[nv + c], o;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float gf = to_f<T>(g.v[k]);
      const float sg = round_to<T>(gf / (1.f + expf(-gf)));
      o.v[k] = from_f<T>(sg * to_f<T>(u.v[k]));
    }
    reinterpret_cast<V*>(out + t * (int64_t)inter)[c] = o;
  }
}

template <typename T>
void launch_silu_mul(T* out, const T* x, int64_t tokens, int inter, cudaStream_t s) {
  if (tokens == 0 || inter == 0) return;
  constexpr int V16 = vec16<T>();
  const bool vec = inter % V16 == 0 && aligned16(out) && aligned16(x);
  const int64_t work = tokens * (vec ? inter / V16 : inter);
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>(ceil_div(work, threads), (int64_t)num_sms() * 8);
  if (vec)
    launch("silu_mul_kernel", silu_mul_kernel<T, V16>, (unsigned)blocks, threads, 0, s, pdl_rows(tokens), out, x, tokens, inter);
  else
    launch("silu_mul_kernel", silu_mul_kernel<T, 1>, (unsigned)blocks, threads, 0, s, pdl_rows(tokens), out, x, tokens, inter);
}

void check_norm_args(const paddle::Tensor& x, const paddle::Tensor& w, const char* op) {
  check_gpu(x, op, "x");
  check_gpu(w, op, "weight");
  PD_CHECK(x.dtype() == w.dtype(), op, ": x and weight dtypes differ");
  PD_CHECK(!x.shape().empty() && w.numel() == x.shape().back(), op, ": weight must have hidden = x.shape[-1] elements");
}

}  // namespace
}  // namespace fdl

using namespace fdl;

// fdl_rms_norm(x [..., H], w [H], epsilon) -> y
std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x, const paddle::Tensor& w, float eps) {
  check_norm_args(x, w, "fdl_rms_norm");
  const int hidden = (int)x.shape().back();
  const int64_t rows = hidden ? x.numel() / hidden : 0;
  paddle::Tensor y = paddle::empty(x.shape(), x.dtype(), x.place());
  FDL_FLOAT_SWITCH(x.dtype(), T, "fdl_rms_norm",
                   launch_rms<T, false>(static_cast<T*>(y.data()), nullptr, static_cast<const T*>(x.data()),
                                        static_cast<const T*>(w.data()), rows, hidden, eps, stream_of(x)));
  FDL_CHECK_LAUNCH("fdl_rms_norm");
  return {y};
}

std::vector<std::vector<int64_t>> SameAsFirst2(const std::vector<int64_t>& x, const std::vector<int64_t>&) { return {x}; }
std::vector<paddle::DataType> DtypeFirst2(const paddle::DataType& x, const paddle::DataType&) { return {x}; }

PD_BUILD_OP(fdl_rms_norm)
    .Inputs({"X", "W"})
    .Outputs({"Out"})
    .Attrs({"epsilon: float"})
    .SetKernelFn(PD_KERNEL(RmsNorm))
    .SetInferShapeFn(PD_INFER_SHAPE(SameAsFirst2))
    .SetInferDtypeFn(PD_INFER_DTYPE(DtypeFirst2));

// fdl_fused_add_rms_norm_(x, residual, w, epsilon), both in place (vLLM's fused_add_rms_norm):
//   residual = round(x + residual);  x = rms_norm(residual) * w
std::vector<paddle::Tensor> FusedAddRmsNorm(paddle::Tensor& x, paddle::Tensor& residual, const paddle::Tensor& w,
                                            float eps) {
  check_norm_args(x, w, "fdl_fused_add_rms_norm_");
  check_gpu(residual, "fdl_fused_add_rms_norm_", "residual");
  PD_CHECK(residual.numel() == x.numel() && residual.dtype() == x.dtype(),
           "fdl_fused_add_rms_norm_: residual must match x");
  const int hidden = (int)x.shape().back();
  const int64_t rows = hidden ? x.numel() / hidden : 0;
  FDL_FLOAT_SWITCH(x.dtype(), T, "fdl_fused_add_rms_norm_",
                   launch_rms<T, true>(static_cast<T*>(x.data()), static_cast<T*>(residual.data()),
                                       static_cast<const T*>(x.data()), static_cast<const T*>(w.data()), rows, hidden,
                                       eps, stream_of(x)));
  FDL_CHECK_LAUNCH("fdl_fused_add_rms_norm_");
  return {};
}

PD_BUILD_OP(fdl_fused_add_rms_norm_)
    .Inputs({"X", "Residual", "W"})
    .Outputs({"XOut", "ResidualOut"})
    .Attrs({"epsilon: float"})
    .SetInplaceMap({{"X", "XOut"}, {"Residual", "ResidualOut"}})
    .SetKernelFn(PD_KERNEL(FusedAddRmsNorm));

// fdl_silu_and_mul(x [T, 2I]) -> [T, I]
std::vector<paddle::Tensor> SiluAndMul(const paddle::Tensor& x) {
  check_gpu(x, "fdl_silu_and_mul", "x");
  PD_CHECK(!x.shape().empty() && x.shape().back() % 2 == 0, "fdl_silu_and_mul: last dimension must be even");
  std::vector<int64_t> shape = x.shape();
  const int inter = (int)(shape.back() / 2);
  shape.back() = inter;
  const int64_t tokens = inter ? x.numel() / (2 * inter) : 0;
  paddle::Tensor y = paddle::empty(shape, x.dtype(), x.place());
  FDL_FLOAT_SWITCH(x.dtype(), T, "fdl_silu_and_mul",
                   launch_silu_mul<T>(static_cast<T*>(y.data()), static_cast<const T*>(x.data()), tokens, inter,
                                      stream_of(x)));
  FDL_CHECK_LAUNCH("fdl_silu_and_mul");
  return {y};
}

std::vector<std::vector<int64_t>> HalfLast(const std::vector<int64_t>& x) {
  std::vector<int64_t> s(x);
  s.back() /= 2;
  return {s};
}
std::vector<paddle::DataType> SameDtype(const paddle::DataType& x) { return {x}; }

PD_BUILD_OP(fdl_silu_and_mul)
    .Inputs({"X"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(SiluAndMul))
    .SetInferShapeFn(PD_INFER_SHAPE(HalfLast))
    .SetInferDtypeFn(PD_INFER_DTYPE(SameDtype));
