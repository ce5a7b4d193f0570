// Log-probabilities on the GPU: for each asked row of float32 logits, the log-softmax at a target token (the
// sampled token, or the next prompt token for prompt logprobs), the target's rank and the top-k tokens with
// their log-probabilities. Only these [rows, 2 + 2k] numbers leave the device, in the same buffer as the step's
// sampled ids (one copy per step); before, a row asking for logprobs copied its 600 KB of logits to the host.
//
// One block per row, two passes over its vocabulary: the maximum, then the sum of exp(x - max), the count of
// tokens at least as likely as the target (its rank, the CPU sampler's rule) and each thread's best K
// candidates in registers; then k rounds of a block argmax over the threads' heads. Ties go to the lower token
// id. Every reduction has a fixed order over the row's own data, so a row's numbers do not depend on its batch.
// Values are raw logprobs (vLLM's default): x - (max + log(sum exp(x - max))) in float32.
#include <math_constants.h>

#include <climits>

#include "ops_common.cuh"

namespace fdl {
namespace {

constexpr int NT = 512;
constexpr int kMaxTop = 20;  // vLLM's max_logprobs default; the engine refuses more

__device__ __forceinline__ float clean(float f) { return isnan(f) ? -CUDART_INF_F : f; }

__device__ __forceinline__ bool better(float av, int ai, float bv, int bi) { return av > bv || (av == bv && ai < bi); }

// The block's best (value, index), lowest index among equals; every thread gets it.
__device__ __forceinline__ void block_argmax(float& bv, int& bi) {
  __shared__ float fv[32];
  __shared__ int fi[32];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  __syncthreads();  // the previous round's readers are done with fv / fi
  if (lane == 0) fv[wid] = bv, fi[wid] = bi;
  __syncthreads();
  bv = lane < nw ? fv[lane] : -CUDART_INF_F;
  bi = lane < nw ? fi[lane] : INT_MAX;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
}

// out int32: [M] the targets (echoed: the step's sampled ids), then per row a [2 + 2k] record: the target's
// logprob (float bits), its rank, k token ids, their logprobs (float bits).
template <int K>
__global__ void __launch_bounds__(NT) logprobs_kernel(int32_t* __restrict__ out, const float* __restrict__ logits, int V,
                                                      const int64_t* __restrict__ rows, const int64_t* __restrict__ targets,
                                                      int64_t M, const int64_t* __restrict__ target_of, int k) {
  for (int64_t i = (int64_t)blockIdx.x * NT + threadIdx.x; i < M; i += (int64_t)gridDim.x * NT) out[i] = (int32_t)targets[i];
  const float* x = logits + rows[blockIdx.x] * (int64_t)V;
  const int64_t t = targets[target_of[blockIdx.x]];
  const float xt = (t >= 0 && t < V) ? clean(x[t]) : -CUDART_INF_F;

  float m = -CUDART_INF_F;
  for (int v = threadIdx.x; v < V; v += NT) m = fmaxf(m, clean(x[v]));
  m = block_max(m);
  const float shift = m == -CUDART_INF_F ? 0.f : m;

  float sum = 0.f, at_least = 0.f;  // counts up to 2^24 are exact in float32
  float tv[K];
  int ti[K];
#pragma unroll
  for (int j = 0; j < K; ++j) tv[j] = -CUDART_INF_F, ti[j] = INT_MAX;
  for (int v = threadIdx.x; v < V; v += NT) {
    const float xv = clean(x[v]);
    sum += expf(xv - shift);
    at_least += xv >= xt ? 1.f : 0.f;
    if (better(xv, v, tv[K - 1], ti[K - 1])) {  // sorted insertion, unrolled so the lists stay in registers
      tv[K - 1] = xv, ti[K - 1] = v;
#pragma unroll
      for (int j = K - 1; j > 0; --j)
        if (better(tv[j], ti[j], tv[j - 1], ti[j - 1])) {
          const float fv = tv[j];
          const int fi = ti[j];
          tv[j] = tv[j - 1], ti[j] = ti[j - 1];
          tv[j - 1] = fv, ti[j - 1] = fi;
        }
    }
  }
  sum = block_sum(sum);
  at_least = block_sum(at_least);
  const float lse = shift + logf(sum);
  int32_t* rec = out + M + (int64_t)blockIdx.x * (2 + 2 * k);
  if (threadIdx.x == 0) {
    rec[0] = __float_as_int(xt - lse);
    rec[1] = (int32_t)at_least;
  }
  for (int r = 0; r < k; ++r) {
    float bv = tv[0];
    int bi = ti[0];
    block_argmax(bv, bi);
    if (ti[0] == bi) {  // the winner pops its head (token ids are unique; INT_MAX only once V < k)
#pragma unroll
      for (int j = 0; j < K - 1; ++j) tv[j] = tv[j + 1], ti[j] = ti[j + 1];
      tv[K - 1] = -CUDART_INF_F, ti[K - 1] = INT_MAX;
    }
    if (threadIdx.x == 0) {
      rec[2 + r] = bi;
      rec[2 + k + r] = __float_as_int(bv - lse);
    }
  }
}

}  // namespace
}  // namespace fdl

using namespace fdl;

// fdl_logprobs(logits [N, V] f32, rows [A] i64, targets [M] i64, target_of [A] i64, k) -> int32
// [M + A * (2 + 2k)]: the targets as int32, then for each a in [0, A) on row rows[a] of logits with target
// targets[target_of[a]]: the target's logprob (float32 bits), its rank (tokens with a logit >= the target's),
// the top-k ids and their logprobs (float32 bits), best first. 0 <= k <= 20.
std::vector<paddle::Tensor> Logprobs(const paddle::Tensor& logits, const paddle::Tensor& rows,
                                     const paddle::Tensor& targets, const paddle::Tensor& target_of, int k) {
  const char* op = "fdl_logprobs";
  check_gpu(logits, op, "logits");
  PD_CHECK(logits.dtype() == paddle::DataType::FLOAT32 && logits.shape().size() == 2, op,
           ": logits must be [N, V] float32");
  const int V = (int)logits.shape()[1];
  PD_CHECK(k >= 0 && k <= kMaxTop && k <= V, op, ": k must be in [0, min(20, V)], got ", k);
  const int64_t A = rows.numel(), M = targets.numel();
  for (const paddle::Tensor* t : {&rows, &targets, &target_of}) {
    check_gpu(*t, op, "index");
    PD_CHECK(t->dtype() == paddle::DataType::INT64, op, ": rows, targets and target_of must be int64");
  }
  PD_CHECK(A > 0 && target_of.numel() == A, op, ": at least one row, and one target_of entry per row");
  paddle::Tensor out = paddle::empty({M + A * (2 + 2 * k)}, paddle::DataType::INT32, logits.place());
  cudaStream_t s = stream_of(logits);
  {
#define FDL_LOGPROBS_LAUNCH(KK)                                                                                  \
  launch("logprobs_kernel", logprobs_kernel<KK>, (unsigned)A, NT, 0, s, false, out.data<int32_t>(),              \
         logits.data<float>(), V, rows.data<int64_t>(), targets.data<int64_t>(), M, target_of.data<int64_t>(), k)
    if (k <= 1) FDL_LOGPROBS_LAUNCH(1);
    else if (k <= 5) FDL_LOGPROBS_LAUNCH(5);
    else FDL_LOGPROBS_LAUNCH(20);
#undef FDL_LOGPROBS_LAUNCH
  }
  FDL_CHECK_LAUNCH(op);
  return {out};
}

PD_BUILD_OP(fdl_logprobs)
    .Inputs({"Logits", "Rows", "Targets", "TargetOf"})
    .Outputs({"Out"})
    .Attrs({"k: int"})
    .SetKernelFn(PD_KERNEL(Logprobs));
