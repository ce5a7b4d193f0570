// The routed experts of a mixture-of-experts layer: fdl_moe_experts(x, ids, weights, w13, w2) = for each
// token t, sum over its k choices j of weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j];
// FusedMoE.forward_cpu's semantics (fdlite/layers/moe.py), vLLM fused_moe's structure (no code copied):
//
//   1. align (moe_align.cuh): the T k choices sorted by expert, each expert's rows padded to the GEMM's M
//      tile BM, and each M tile's expert, on the device (no host read of the counts, which a CUDA graph
//      could not contain);
//   2. gate/up GEMM per M tile with SiLU-and-multiply in its epilogue -> act [rows, I];
//   3. down GEMM per M tile, the choice's router weight applied in its epilogue -> y [T k, H], each choice
//      at its own row t k + j;
//   4. un-permute: out[t] = sum of y[t k + j] over j = 0 .. k - 1 in that order (+ shared[t], an optional
//      addend: ERNIE's shared experts, folded in here rather than added by a pass of its own), in fp32, rounded
//      once.
// bf16 / fp16 run the GEMMs on tensor cores: Hopper wgmma with 128 x 256 tiles where the GPU runs sm_90a code
// (moe_gemm_wgmma.cuh), mma.sync elsewhere (moe_gemm_mma.cuh); fp32 on CUDA cores in true fp32 (moe_gemm_fma.cuh).
//
// Why our own grouped GEMM rather than cuBLAS's grouped batched GEMM (12.5+) or CUTLASS: both take the
// per-expert row counts on the host, and here they exist only on the device (step 1), inside graphs; the
// gather of A rows and both epilogues would be extra passes there.
//
// BM (`block_m`, 0 = automatic): 128 (the wgmma kernels) for bf16 / fp16 where the GPU runs sm_90a code, at
// every size (decode too: their deeper pipeline streams the touched experts' weights at 80-86% of HBM speed
// against the mma.sync kernels' 54-61%, measured; padding rows cost MMA time there, not memory traffic);
// otherwise 16 when an expert gets at most 16 rows on average (each touched expert's weights are then read once
// per step, as one M tile), else 64. The choice depends only on (T, k, E, dtype), so a captured graph keeps it.
// Every grid depends only on (T, k, E, BM, H, I); scratch comes from paddle::empty (the graph's pool inside a
// capture), sized by T: the profiling run at max_num_batched_tokens sees the peak.
#include <algorithm>
#include <type_traits>

#include "moe_align.cuh"
#include "moe_gemm_mma.cuh"
#include "moe_gemm_wgmma.cuh"
#include "moe_gemm_fma.cuh"

namespace fdl {
namespace {

inline int moe_block_m(int64_t n, int64_t E) { return n <= 16 * E ? 16 : 64; }

// out[t, :] = sum_j y[t k + j, :] (choices whose id is outside [0, E) skipped), fp32 sum in order of j, then
// + shared[t, :] when shared is not null; rounded once.
template <typename T, int VEC>
__global__ void moe_sum_kernel(T* __restrict__ out, const T* __restrict__ y, const T* __restrict__ shared,
                               const int* __restrict__ ids, int64_t tokens, int k, int hidden, int E) {
  pdl_trigger();
  pdl_wait();
  using V = Vec<T, VEC>;
  const int nv = hidden / VEC;
  const int64_t total = tokens * nv;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / nv;
    const int c = (int)(i - t * nv);
    float acc[VEC];
#pragma unroll
    for (int q = 0; q < VEC; ++q) acc[q] = 0.f;
    for (int j = 0; j < k; ++j) {
      const int64_t row = t * k + j;
      if ((unsigned)ids[row] >= (unsigned)E) continue;
      const V v = reinterpret_cast<const V*>(y + row * hidden)[c];
#pragma unroll
      for (int q = 0; q < VEC; ++q) acc[q] += to_f<T>(v.v[q]);
    }
    if (shared) {
      const V v = reinterpret_cast<const V*>(shared + t * hidden)[c];
#pragma unroll
      for (int q = 0; q < VEC; ++q) acc[q] += to_f<T>(v.v[q]);
    }
    V o;
#pragma unroll
    for (int q = 0; q < VEC; ++q) o.v[q] = from_f<T>(acc[q]);
    reinterpret_cast<V*>(out + t * hidden)[c] = o;
  }
}

// Tile configurations: <BM, BN, warps along M, warps along N, gated, stages>.
using MmaUp16 = MoeMmaCfg<16, 64, 1, 4, true, 4>;
using MmaDown16 = MoeMmaCfg<16, 128, 1, 4, false, 4>;
using MmaUp64 = MoeMmaCfg<64, 64, 2, 2, true, 3>;
using MmaDown64 = MoeMmaCfg<64, 128, 2, 2, false, 3>;

template <typename T, typename C>
void launch_mma(const MoeGemmArgs& a, int64_t tiles, bool pdl, cudaStream_t s) {
  allow_smem<moe_gemm_mma_kernel<T, C>>(C::smem_bytes);
  const dim3 grid((unsigned)tiles, (unsigned)ceil_div(a.N, C::BN));
  launch("moe_gemm_mma_kernel", moe_gemm_mma_kernel<T, C>, grid, C::NTH, C::smem_bytes, s, pdl, a);
}

// E: experts (the weights' rows are E (2) N); the down GEMM's A (act) has tiles BM rows.
template <typename T, typename C>
void launch_wgmma(const MoeGemmArgs& a, int64_t tiles, int64_t E, bool pdl, cudaStream_t s) {
  allow_smem<moe_gemm_wgmma_kernel<T, C>>(C::bytes);
  const int64_t nblocks = ceil_div(a.N, C::OUT_N), items = tiles * nblocks;  // at most: tiles past the real ones
  MoeTmaps tm = {};
  const char* op = "fdl_moe_experts";
  tm.b = tma_map_2d(a.w, E * (C::GATED ? 2 : 1) * a.N, a.K, C::B_BOX, op);
  if (!C::GATED) tm.a = tma_map_2d(a.a, tiles * C::BM, a.K, C::BM, op);
  launch("moe_gemm_wgmma_kernel", moe_gemm_wgmma_kernel<T, C>, (unsigned)std::min<int64_t>(items, num_sms()), C::NTH,
         C::bytes, s, pdl, a, (int)tiles, (int)nblocks, tm);  // persistent: one block per SM at most
}

template <int BM, bool GATED>
void launch_fma(const MoeGemmArgs& a, int64_t tiles, bool pdl, cudaStream_t s) {
  const dim3 grid((unsigned)tiles, (unsigned)ceil_div(a.N, kFmaBN));
  launch("moe_gemm_fma_kernel", moe_gemm_fma_kernel<BM, GATED>, grid, kFmaThreads, 0, s, pdl, a);
}

// The wgmma kernels' 16-byte epilogue (moe_gemm_wgmma.cuh) pays from a quarter tile of rows per expert on average
// (T k >= 32 E: Qwen3-30B-A3B from 512 tokens, ERNIE-4.5-21B-A3B from 342). Measured side by side against the
// per-pair epilogue: 1.7-2.1% faster at 1,024 tokens (T k = 64 E, 96 E), 0.1-0.7% slower at 256 (16 E, 24 E), up to
// 4.9% slower below. A function of (T k, E): a captured graph keeps its choice.
inline bool moe_wide_stores(int64_t n, int64_t E) { return n >= MoeWgCfg<true, true>::BM * E / 4; }

template <typename T>
void launch_gemms(MoeGemmArgs up, MoeGemmArgs down, int bm, int64_t tiles, int64_t E, bool wide, bool pdl,
                  cudaStream_t s) {
  if constexpr (std::is_same<T, float>::value) {
    if (bm == 16) {
      launch_fma<16, true>(up, tiles, pdl, s);
      launch_fma<16, false>(down, tiles, pdl, s);
    } else {
      launch_fma<64, true>(up, tiles, pdl, s);
      launch_fma<64, false>(down, tiles, pdl, s);
    }
  } else {
    if (bm == 16) {
      launch_mma<T, MmaUp16>(up, tiles, pdl, s);
      launch_mma<T, MmaDown16>(down, tiles, pdl, s);
    } else if (bm == 128 && wide) {
      launch_wgmma<T, MoeWgCfg<true, true>>(up, tiles, E, pdl, s);
      launch_wgmma<T, MoeWgCfg<false, true>>(down, tiles, E, pdl, s);
    } else if (bm == 128) {
      launch_wgmma<T, MoeWgCfg<true, false>>(up, tiles, E, pdl, s);
      launch_wgmma<T, MoeWgCfg<false, false>>(down, tiles, E, pdl, s);
    } else {
      launch_mma<T, MmaUp64>(up, tiles, pdl, s);
      launch_mma<T, MmaDown64>(down, tiles, pdl, s);
    }
  }
}

// The M tile of fdl_moe_align (wgmma: whether the caller's GEMMs may take 128-row tiles; the align op alone
// chooses as for fp32, and takes 128 only when asked).
int pick_block_m(int block_m, int64_t n, int64_t E, bool wgmma, const char* op) {
  PD_CHECK(block_m == 0 || block_m == 16 || block_m == 64 || block_m == 128, op,
           ": block_m must be 0 (automatic), 16, 64 or 128");
  if (block_m) return block_m;
  if (wgmma) return 128;
  return moe_block_m(n, E);
}

void check_ids(const paddle::Tensor& ids, const char* op) {
  check_gpu(ids, op, "ids");
  PD_CHECK(ids.dtype() == paddle::DataType::INT32 && ids.shape().size() == 2, op, ": ids must be [T, k] int32");
}

}  // namespace
}  // namespace fdl

using namespace fdl;

// fdl_moe_align(ids [T, k] int32, num_experts, block_m) -> sorted_rows [tiles_max * BM] int32, tile_expert
// [tiles_max] int32 (moe_align.cuh; block_m 0 = the automatic choice). What fdl_moe_experts runs first, as
// an op of its own for the checks.
std::vector<paddle::Tensor> MoeAlignOp(const paddle::Tensor& ids, int num_experts, int block_m) {
  const char* op = "fdl_moe_align";
  check_ids(ids, op);
  PD_CHECK(num_experts >= 1 && num_experts <= kMaxExperts, op, ": num_experts must be in [1, 1024]");
  const int64_t n = ids.numel(), E = num_experts;
  const int bm = pick_block_m(block_m, n, E, false, op);
  const int64_t tiles = moe_tiles_max(n, E, bm);
  paddle::Tensor sorted = paddle::empty({tiles * bm}, paddle::DataType::INT32, ids.place());
  paddle::Tensor tile_expert = paddle::empty({tiles}, paddle::DataType::INT32, ids.place());
  if (n == 0) return {sorted, tile_expert};
  paddle::Tensor scratch = paddle::empty({moe_align_scratch(n, E)}, paddle::DataType::INT32, ids.place());
  int* sp = static_cast<int*>(scratch.data());
  const MoeAlign a{static_cast<int*>(sorted.data()), static_cast<int*>(tile_expert.data()), sp, sp + E};
  launch_moe_align(static_cast<const int*>(ids.data()), n, E, bm, a, pdl_rows(ids.shape()[0]), stream_of(ids));
  FDL_CHECK_LAUNCH(op);
  return {sorted, tile_expert};
}

PD_BUILD_OP(fdl_moe_align)
    .Inputs({"Ids"})
    .Outputs({"SortedRows", "TileExpert"})
    .Attrs({"num_experts: int", "block_m: int"})
    .SetKernelFn(PD_KERNEL(MoeAlignOp));

// fdl_moe_experts(x [T, H], ids [T, k] int32, weights [T, k] float32, w13 [E, 2I, H], w2 [E, H, I], shared [T, H]
// (read when has_shared; any GPU tensor otherwise), block_m, has_shared) -> out [T, H] in x's dtype (float32 /
// float16 / bfloat16; the weights and shared the same dtype), + shared before the rounding. Expert weights are
// [E, out, in]: w13[e] holds the gate rows then the up rows. H and I multiples of 8.
std::vector<paddle::Tensor> MoeExperts(const paddle::Tensor& x, const paddle::Tensor& ids, const paddle::Tensor& weights,
                                       const paddle::Tensor& w13, const paddle::Tensor& w2,
                                       const paddle::Tensor& shared, int block_m, bool has_shared) {
  const char* op = "fdl_moe_experts";
  check_gpu(x, op, "x");
  check_ids(ids, op);
  check_gpu(weights, op, "weights");
  check_gpu(w13, op, "w13");
  check_gpu(w2, op, "w2");
  PD_CHECK(x.shape().size() == 2 && w13.shape().size() == 3 && w2.shape().size() == 3, op,
           ": x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]");
  const int64_t T = x.shape()[0], H = x.shape()[1], E = w13.shape()[0], I = w13.shape()[1] / 2;
  const int64_t k = ids.shape()[1];
  PD_CHECK(w13.dtype() == x.dtype() && w2.dtype() == x.dtype(), op, ": x, w13 and w2 must share a dtype");
  PD_CHECK(w13.shape()[1] == 2 * I && w13.shape()[2] == H, op, ": w13 must be [E, 2I, H]");
  PD_CHECK(w2.shape()[0] == E && w2.shape()[1] == H && w2.shape()[2] == I, op, ": w2 must be [E, H, I]");
  PD_CHECK(ids.shape()[0] == T && weights.dtype() == paddle::DataType::FLOAT32 && weights.numel() == T * k, op,
           ": ids and weights must be [T, k] (int32, float32)");
  PD_CHECK(H % 8 == 0 && I % 8 == 0 && I > 0, op, ": the hidden size and the expert width must be multiples of 8");
  PD_CHECK(E >= 1 && E <= kMaxExperts, op, ": at most 1024 experts");
  PD_CHECK(aligned16(x.data()) && aligned16(w13.data()) && aligned16(w2.data()), op,
           ": x, w13 and w2 must be 16-byte aligned");
  if (has_shared) {
    check_gpu(shared, op, "shared");
    PD_CHECK(shared.dtype() == x.dtype() && shared.shape() == x.shape(), op, ": shared must be [T, H] in x's dtype");
    PD_CHECK(aligned16(shared.data()), op, ": shared must be 16-byte aligned");
  }
  const int64_t n = T * k;
  PD_CHECK(n + E * 128 < ((int64_t)1 << 31) && (n + E * 128) * std::max(H, I) < ((int64_t)1 << 40), op,
           ": too many tokens");
  paddle::Tensor out = paddle::empty({T, H}, x.dtype(), x.place());
  if (T == 0) return {out};
  const bool wgmma = x.dtype() != paddle::DataType::FLOAT32 && wgmma_ready();
  PD_CHECK(block_m != 128 || wgmma, op, ": block_m 128 (the wgmma kernels) needs bf16 / fp16 on an sm_90 GPU and a "
           "library built for sm_90a");
  const int bm = pick_block_m(block_m, n, E, wgmma, op);
  const int64_t tiles = moe_tiles_max(n, E, bm), rows = tiles * bm;
  paddle::Tensor ints = paddle::empty({rows + tiles + moe_align_scratch(n, E)}, paddle::DataType::INT32, x.place());
  paddle::Tensor act = paddle::empty({rows, I}, x.dtype(), x.place());
  paddle::Tensor y = paddle::empty({n, H}, x.dtype(), x.place());
  int* ip = static_cast<int*>(ints.data());
  const MoeAlign a{ip, ip + rows, ip + rows + tiles, ip + rows + tiles + E};
  cudaStream_t s = stream_of(x);
  const bool pdl = pdl_rows(T);
  const int* idp = static_cast<const int*>(ids.data());
  launch_moe_align(idp, n, E, bm, a, pdl, s);
  MoeGemmArgs up{x.data(), w13.data(), act.data(), a.sorted_rows, a.tile_expert, nullptr, (int)I, (int)H, (int)k};
  MoeGemmArgs down{act.data(), w2.data(), y.data(), a.sorted_rows, a.tile_expert,
                   static_cast<const float*>(weights.data()), (int)H, (int)I, (int)k};
  FDL_FLOAT_SWITCH(x.dtype(), T_, op, {
    launch_gemms<T_>(up, down, bm, tiles, E, moe_wide_stores(n, E), pdl, s);
    constexpr int V16 = vec16<T_>();
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>(ceil_div(T * (H / V16), threads), (int64_t)num_sms() * 8);
    launch("moe_sum_kernel", moe_sum_kernel<T_, V16>, (unsigned)blocks, threads, 0, s, pdl, static_cast<T_*>(out.data()),
           static_cast<const T_*>(y.data()), has_shared ? static_cast<const T_*>(shared.data()) : nullptr, idp, T,
           (int)k, (int)H, (int)E);
  });
  FDL_CHECK_LAUNCH(op);
  return {out};
}

PD_BUILD_OP(fdl_moe_experts)
    .Inputs({"X", "Ids", "Weights", "W13", "W2", "Shared"})
    .Outputs({"Out"})
    .Attrs({"block_m: int", "has_shared: bool"})
    .SetKernelFn(PD_KERNEL(MoeExperts));
