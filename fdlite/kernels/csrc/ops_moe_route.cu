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
// One warp per token (4 per block); lane l holds experts l, l + 32, l + 64, ... (its slots, in that order):
// in registers when E <= 256 (a kernel per slot count, 1, 2, 4 or 8), else in shared memory (2 E floats per
// warp). The softmax is the first version's arithmetic, operation for operation, so its bits do not move:
// max by warp_max, expf(x - max), each lane's sum over its slots in slot order then warp_sum, p = e / sum (an
// IEEE division), choose = p + bias[e].
//
// Selection. Each choosing value becomes an order-preserving unsigned key (`route_key`: for numbers, a > b
// exactly when key(a) > key(b), and equal keys exactly for values equal as floats, -0.0 and +0.0 included).
// A lane's register slots are sorted once by key, largest first, equal keys in slot order (a stable sort), so
// its head is its best expert not taken yet, the lower id first among equal values. Each of the k rounds is
// then two warp reductions (redux.sync on sm_80+): the largest head key, and the smallest id among the lanes
// whose head has it (equal values go to the lower expert id, as before); the winner's p comes from its lane by
// one shuffle (without a bias from the top key itself, p's own bits), and only that lane pops its head.
// (Shared-memory slots: a lane keeps its best slot not taken, and only the winner's lane rescans its slots.)
// Lane j % 32 keeps the j-th choice, and k lanes store at once (in chunks of 32 when k > 32), dividing by the
// renormalising total (the chosen p summed in choice order). A 5-step (value, id) shuffle arg-max per round
// over every slot, with lane 0 storing the k weights one by one, took 3.6x longer (22.7 vs 6.2 us for 8,192
// tokens of Qwen3-30B-A3B, H100).
//
// NaN: a NaN choosing value ranks below every number, -inf included, and among NaNs the lower expert id comes
// first. NaN appears for a NaN bias entry, and in every p of a row holding a NaN or +inf logit or only -inf
// ones: such a row gives experts 0, 1, ..., k - 1 with NaN weights. So the k ids are always distinct experts
// in [0, E). A token's result depends on its own logits only; the grid depends only on T (graph-safe).
#include <math_constants.h>

#include "ops_common.cuh"

namespace fdl {
namespace {

constexpr int kRouteWarps = 4;
constexpr int kRouteMaxExperts = 1024;  // 32 lanes x 32 slots
constexpr int kRouteMaxRegSlots = 8;    // experts per lane kept in registers: E <= 256

// The order-preserving key of a choosing value: sign-magnitude bits made monotone (negative values' bits
// inverted, positive values' top bit set), -0.0 first turned into +0.0 (equal as floats, so equal keys).
// Numbers map to keys >= 0x007fffff (-inf), NaN to 1, and 0 is "no expert" (a slot taken, or past E).
__device__ __forceinline__ unsigned route_key(float v) {
  const unsigned u = v == 0.f ? 0u : __float_as_uint(v);
  const unsigned key = u ^ ((unsigned)((int)u >> 31) | 0x80000000u);
  return v != v ? 1u : key;
}

// The warp's largest (MAX) or smallest unsigned: one redux.sync on sm_80+, a shuffle butterfly before.
template <bool MAX>
__device__ __forceinline__ unsigned warp_reduce_u32(unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return MAX ? __reduce_max_sync(0xffffffffu, v) : __reduce_min_sync(0xffffffffu, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned w = __shfl_xor_sync(0xffffffffu, v, o);
    v = MAX ? max(v, w) : min(v, w);
  }
  return v;
#endif
}

// A lane's experts in registers (S per lane, E <= 32 S), sorted once by key, largest first, by a stable sort
// (odd-even transposition: equal keys keep their order, the lower id first); a round takes the head. Without a
// bias the key is p's own bits (p >= +0: key = bits | 0x80000000, NaN -> 1), so the winner's weight comes from
// the warp's top key and the lane keeps no p: fewer registers, one shuffle less per round.
template <int S, bool kBias>
struct RegLane {
  unsigned key[S], id[S];  // key 0: no expert (past E, or taken)
  float p[kBias ? S : 1];
  __device__ __forceinline__ unsigned head_key() const { return key[0]; }
  __device__ __forceinline__ unsigned head_id() const { return id[0]; }
  __device__ __forceinline__ float weight(unsigned top, unsigned win) const {
    if constexpr (kBias) {
      return __shfl_sync(0xffffffffu, p[0], win & 31);
    } else {
      return __uint_as_float(top == 1u ? 0x7fffffffu : top & 0x7fffffffu);
    }
  }
  __device__ __forceinline__ void sort() {
#pragma unroll
    for (int r = 0; r < S; ++r) {
#pragma unroll
      for (int i = r & 1; i + 1 < S; i += 2) {
        if (key[i + 1] > key[i]) {
          const unsigned k0 = key[i], i0 = id[i];
          key[i] = key[i + 1], id[i] = id[i + 1];
          key[i + 1] = k0, id[i + 1] = i0;
          if constexpr (kBias) {
            const float p0 = p[i];
            p[i] = p[i + 1];
            p[i + 1] = p0;
          }
        }
      }
    }
  }
  __device__ __forceinline__ void pop() {
#pragma unroll
    for (int i = 0; i + 1 < S; ++i) {
      key[i] = key[i + 1], id[i] = id[i + 1];
      if constexpr (kBias) p[i] = p[i + 1];
    }
    key[S - 1] = 0;
  }
};

// A lane's experts in shared memory (E > 256: up to 32 per lane, p at [e] and key at [E + e] of the warp's part):
// the best one not taken is cached, and found again by a scan of the lane's slots after each of its experts is taken.
struct SmemLane {
  float* p_;
  unsigned* key_;
  int n, lane;
  unsigned taken = 0;  // bit b: slot b (expert lane + 32 b) chosen already
  unsigned bk = 0, bid = 0;
  float bp = 0.f;
  __device__ __forceinline__ unsigned head_key() const { return bk; }
  __device__ __forceinline__ unsigned head_id() const { return bid; }
  __device__ __forceinline__ float weight(unsigned, unsigned win) const {
    return __shfl_sync(0xffffffffu, bp, win & 31);
  }
  __device__ __forceinline__ void scan() {  // the largest key, the lowest slot among equal keys
    bk = 0;
    for (int b = 0; b < n; ++b) {
      const unsigned key = taken >> b & 1u ? 0u : key_[32 * b];
      if (key > bk) {
        bk = key;
        bid = lane + 32 * b;
        bp = p_[32 * b];
      }
    }
  }
  __device__ __forceinline__ void pop() {
    taken |= 1u << (bid >> 5);
    scan();
  }
};

// The k rounds and the stores: each round the largest head key of the warp, the lowest id among the lanes holding
// it, its p (`weight`); the winner's lane pops its head. Lane c keeps choice j0 + c of each chunk of 32.
template <typename Lane>
__device__ __forceinline__ void route_select(Lane& ln, int lane, int k, bool renormalize, float norm_min,
                                             int* __restrict__ tid, float* __restrict__ tw) {
  float total = 0.f;
  for (int j0 = 0; j0 < k; j0 += 32) {
    const int m = min(32, k - j0);
    int my_id = 0;
    float my_w = 0.f;
    for (int c = 0; c < m; ++c) {
      // an expert is left (k <= E), so top >= 1: lanes with none left (head key 0) never offer their id
      const unsigned top = warp_reduce_u32<true>(ln.head_key());
      const unsigned win = warp_reduce_u32<false>(ln.head_key() == top ? ln.head_id() : 0xffffffffu);
      const float w = ln.weight(top, win);
      total += w;  // in choice order, as every lane sees the same w
      if (lane == c) {
        my_id = (int)win;
        my_w = w;
      }
      if (lane == (int)(win & 31)) ln.pop();
    }
    if (lane < m) {
      float w = my_w;
      if (renormalize && j0 + m == k) {  // the last chunk: the total is complete
        const float d = norm_min > 0.f ? fmaxf(total, norm_min) : total;
        w = w / d;
      }
      tid[j0 + lane] = my_id;
      tw[j0 + lane] = w;
    }
  }
  if (renormalize && k > 32) {  // the chunks before the last were stored before the total was known
    const float d = norm_min > 0.f ? fmaxf(total, norm_min) : total;
    for (int j = lane; j < ((k - 1) & ~31); j += 32) tw[j] = tw[j] / d;  // each lane rereads its own stores
  }
}

// S > 0: S experts per lane in registers (E <= 32 S); S == 0: in shared memory (2 E floats per warp). kBias:
// whether `bias` is given (S == 0: read at run time).
template <typename L, int S, bool kBias>
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
  const int n = lane < E ? (E - 1 - lane) / 32 + 1 : 0;  // this lane's experts: lane + 32 b for b < n
  const L* row = logits + (int64_t)t * E + lane;
  if constexpr (S > 0) {
    // Slots past n hold -inf: fmaxf keeps the max, and their expf(-inf - max) = +0 adds nothing to the sum (when
    // the max is -inf or +inf the row's p are NaN whatever they add). Their keys are 0.
    RegLane<S, kBias> ln;
    float v[S], bv[kBias ? S : 1];
#pragma unroll
    for (int b = 0; b < S; ++b) {  // the bias with the logits: one memory latency, not two
      v[b] = b < n ? to_f<L>(row[32 * b]) : -CUDART_INF_F;
      if constexpr (kBias) bv[b] = b < n ? bias[lane + 32 * b] : 0.f;
    }
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int b = 0; b < S; ++b) mx = fmaxf(mx, v[b]);
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int b = 0; b < S; ++b) {
      v[b] = expf(v[b] - mx);
      sum += v[b];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int b = 0; b < S; ++b) {
      const float p = v[b] / sum;  // past n: +0 (or NaN), its key replaced by 0 below
      unsigned key;
      if constexpr (kBias) {
        ln.p[b] = p;
        key = route_key(p + bv[b]);
      } else {
        key = p != p ? 1u : __float_as_uint(p) | 0x80000000u;  // route_key(p) for p >= +0 (or NaN)
      }
      ln.key[b] = b < n ? key : 0u;
      ln.id[b] = lane + 32 * b;
    }
    ln.sort();
    route_select(ln, lane, k, renormalize, norm_min, tid, tw);
  } else {
    // The softmax of the register path again, over shared-memory slots. Not one storage-generic helper for both:
    // that changed the code of the E <= 32 kernels with a bias (their logit and bias loads no longer under one branch).
    SmemLane ln;
    ln.p_ = route_smem + (size_t)warp * 2 * E + lane;
    ln.key_ = reinterpret_cast<unsigned*>(ln.p_ + E);
    ln.n = n;
    ln.lane = lane;
    float mx = -CUDART_INF_F;
    for (int b = 0; b < n; ++b) {
      const float v = to_f<L>(row[32 * b]);
      ln.p_[32 * b] = v;
      mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);
    float sum = 0.f;
    for (int b = 0; b < n; ++b) {
      const float e = expf(ln.p_[32 * b] - mx);
      ln.p_[32 * b] = e;
      sum += e;
    }
    sum = warp_sum(sum);
    for (int b = 0; b < n; ++b) {
      const float p = ln.p_[32 * b] / sum;
      ln.p_[32 * b] = p;
      ln.key_[32 * b] = route_key(bias != nullptr ? p + bias[lane + 32 * b] : p);
    }
    ln.scan();  // each lane reads only its own slots: no __syncwarp needed
    route_select(ln, lane, k, renormalize, norm_min, tid, tw);
  }
}

template <typename L>
void launch_route(const char* op, int64_t T, int64_t E, cudaStream_t s, const L* logits, const float* bias,
                  int top_k, bool renormalize, float norm_min, bool balanced, int* ids, float* w) {
  const unsigned blocks = (unsigned)ceil_div(T, kRouteWarps);
  const int slots = (int)ceil_div(E, 32);
  auto go = [&](auto kernel, size_t smem) {
    launch(op, kernel, blocks, kRouteWarps * 32, smem, s, pdl_rows(T), logits, bias, (int)T, (int)E, top_k,
           renormalize, norm_min, balanced, ids, w);
  };
  static_assert(kRouteMaxRegSlots == 8, "the cases below");
  const bool b = bias != nullptr;
  if (slots <= 1) {
    go(b ? moe_route_kernel<L, 1, true> : moe_route_kernel<L, 1, false>, 0);
  } else if (slots <= 2) {
    go(b ? moe_route_kernel<L, 2, true> : moe_route_kernel<L, 2, false>, 0);
  } else if (slots <= 4) {
    go(b ? moe_route_kernel<L, 4, true> : moe_route_kernel<L, 4, false>, 0);
  } else if (slots <= 8) {
    go(b ? moe_route_kernel<L, 8, true> : moe_route_kernel<L, 8, false>, 0);
  } else {
    go(moe_route_kernel<L, 0, true>, (size_t)kRouteWarps * 2 * E * sizeof(float));  // at most 32 KiB
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
  const float* b = has_bias ? static_cast<const float*>(bias.data()) : nullptr;
  FDL_FLOAT_SWITCH(logits.dtype(), L, op, {
    launch_route<L>(op, T, E, s, static_cast<const L*>(logits.data()), b, top_k, renormalize, norm_min, balanced,
                    static_cast<int*>(ids.data()), static_cast<float*>(w.data()));
  });
  FDL_CHECK_LAUNCH(op);
  return {ids, w};
}

PD_BUILD_OP(fdl_moe_route)
    .Inputs({"Logits", "Bias"})
    .Outputs({"Ids", "Weights"})
    .Attrs({"top_k: int", "renormalize: bool", "norm_min: float", "has_bias: bool", "balanced: bool"})
    .SetKernelFn(PD_KERNEL(MoeRoute));
