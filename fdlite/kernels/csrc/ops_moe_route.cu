// The router of a mixture-of-experts layer after its gate GEMM: router logits [T, E] -> the k experts each
// token goes to and their weights, as FusedMoE.route (fdlite/layers/moe.py) computes them on the CPU:
//
//   scores = softmax(logits) in fp32 (the logits in the gate's dtype, widened: what `.astype("float32")`
//            does to the gate's output);
//   choose = scores (+ ERNIE's score-correction bias [E], fp32: it changes which experts win, not their weight);
//   ids    = the k largest of choose, largest first; equal values go to the lower expert id;
//   weights = scores[ids], divided by their sum (floored at norm_min when norm_min > 0) with renormalize.
//
// Ties: paddle.topk and torch.topk on the CPU order equal values as their partial sort leaves them
// (measured: eight equal values, k = 2 -> ids 6, 5), not by id; exact ties of fp32 softmax scores need equal
// logits, so the CPU and this kernel agree except on such inputs, where this kernel is the deterministic one.
//
// `balanced` (the startup profiling run, `balanced_routing()`): token t's j-th choice is expert (t k + j) % E
// with weight 1 / k, whatever the logits, so the memory peak measured is that of every expert in use.
//
// One warp per token (4 per block): the token's E scores sit in shared memory, each of the k rounds is a
// warp arg-max over the experts not yet taken (a bit per expert in its owner lane's mask, so E <= 1024).
// A token's result depends on its own logits only; the grid depends only on T (graph-safe).
#include <math_constants.h>

#include <climits>

#include "ops_common.cuh"

namespace fdl {
namespace {

constexpr int kRouteWarps = 4;
constexpr int kRouteMaxExperts = 1024;  // 32 lanes x 32 mask bits

template <typename L>
__global__ void __launch_bounds__(kRouteWarps * 32) moe_route_kernel(const L* __restrict__ logits,
                                                                    const float* __restrict__ bias, int T, int E,
                                                                    int k, bool renormalize, float norm_min,
                                                                    bool balanced, int* __restrict__ ids,
                                                                    float* __restrict__ weights) {
  pdl_trigger();
  pdl_wait();
  extern __shared__ float route_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = blockIdx.x * kRouteWarps + warp;
  if (t >= T) return;  // no block-wide barrier below
  int* tid = ids + (int64_t)t * k;
  float* tw = weights + (int64_t)t * k;
  if (balanced) {
    for (int j = lane; j < k; j += 32) {
      tid[j] = (int)(((int64_t)t * k + j) % E);
      tw[j] = 1.f / (float)k;
    }
    return;
  }
  float* score = route_smem + (size_t)warp * 2 * E;
  float* choose = score + E;
  const L* row = logits + (int64_t)t * E;
  float mx = -CUDART_INF_F;
  for (int e = lane; e < E; e += 32) {
    const float v = to_f<L>(row[e]);
    score[e] = v;
    mx = fmaxf(mx, v);
  }
  mx = warp_max(mx);
  float sum = 0.f;
  for (int e = lane; e < E; e += 32) {
    const float p = expf(score[e] - mx);
    score[e] = p;
    sum += p;
  }
  sum = warp_sum(sum);
  for (int e = lane; e < E; e += 32) {
    const float p = score[e] / sum;
    score[e] = p;
    choose[e] = bias != nullptr ? p + bias[e] : p;
  }
  __syncwarp();
  unsigned taken = 0;  // bit b: expert lane + 32 b is chosen already
  float total = 0.f;
  for (int j = 0; j < k; ++j) {
    float best = 0.f;
    int bi = INT_MAX;  // none yet: the first expert not taken wins whatever its value (NaN, -inf)
    for (int b = 0, e = lane; e < E; ++b, e += 32) {
      if (taken >> b & 1u) continue;
      const float v = choose[e];
      if (bi == INT_MAX || v > best) {  // ascending e: an equal value keeps the lower id
        best = v;
        bi = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (oi != INT_MAX && (bi == INT_MAX || ob > best || (ob == best && oi < bi))) {
        best = ob;
        bi = oi;
      }
    }
    bi = __shfl_sync(0xffffffffu, bi, 0);  // one answer for the warp even if NaNs made the lanes disagree
    if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
    const float w = score[bi];
    total += w;  // in choice order, as every lane sees the same w
    if (lane == 0) {
      tid[j] = bi;
      tw[j] = w;
    }
  }
  if (renormalize && lane == 0) {
    const float d = norm_min > 0.f ? fmaxf(total, norm_min) : total;
    for (int j = 0; j < k; ++j) tw[j] = tw[j] / d;
  }
}

}  // namespace
}  // namespace fdl

using namespace fdl;

// fdl_moe_route(logits [T, E] float32 / float16 / bfloat16, bias [E] float32 (read when has_bias; any GPU
// tensor otherwise), top_k, renormalize, norm_min, has_bias, balanced) -> ids [T, top_k] int32, weights
// [T, top_k] float32.
std::vector<paddle::Tensor> MoeRoute(const paddle::Tensor& logits, const paddle::Tensor& bias, int top_k,
                                     bool renormalize, float norm_min, bool has_bias, bool balanced) {
  const char* op = "fdl_moe_route";
  check_gpu(logits, op, "logits");
  PD_CHECK(logits.shape().size() == 2, op, ": logits must be [T, E]");
  const int64_t T = logits.shape()[0], E = logits.shape()[1];
  PD_CHECK(E >= 1 && E <= kRouteMaxExperts, op, ": the number of experts must be in [1, 1024]");
  PD_CHECK(top_k >= 1 && top_k <= E, op, ": top_k must be in [1, E]");
  PD_CHECK(T < ((int64_t)1 << 31) / top_k, op, ": too many tokens");
  if (has_bias) {
    check_gpu(bias, op, "bias");
    PD_CHECK(bias.dtype() == paddle::DataType::FLOAT32 && bias.numel() == E, op, ": bias must be [E] float32");
  }
  paddle::Tensor ids = paddle::empty({T, (int64_t)top_k}, paddle::DataType::INT32, logits.place());
  paddle::Tensor w = paddle::empty({T, (int64_t)top_k}, paddle::DataType::FLOAT32, logits.place());
  if (T == 0) return {ids, w};
  cudaStream_t s = stream_of(logits);
  const size_t smem = (size_t)kRouteWarps * 2 * E * sizeof(float);  // at most 32 KiB
  const unsigned blocks = (unsigned)ceil_div(T, kRouteWarps);
  const float* b = has_bias ? static_cast<const float*>(bias.data()) : nullptr;
  FDL_FLOAT_SWITCH(logits.dtype(), L, op, {
    launch(op, moe_route_kernel<L>, blocks, kRouteWarps * 32, smem, s, pdl_rows(T), static_cast<const L*>(logits.data()),
           b, (int)T, (int)E, (int)top_k, renormalize, norm_min, balanced, static_cast<int*>(ids.data()),
           static_cast<float*>(w.data()));
  });
  FDL_CHECK_LAUNCH(op);
  return {ids, w};
}

PD_BUILD_OP(fdl_moe_route)
    .Inputs({"Logits", "Bias"})
    .Outputs({"Ids", "Weights"})
    .Attrs({"top_k: int", "renormalize: bool", "norm_min: float", "has_bias: bool", "balanced: bool"})
    .SetKernelFn(PD_KERNEL(MoeRoute));
