// Tensor-core per-token ("decode") kernel of fdl_paged_attention (ops_attention.cu) for bf16 / fp16 at head_dim
// 64 / 128 over model-dtype caches: attn_decode_kernel's grid, KV splits, chunk loads (ChunkRows) and merge, with
// the g query heads of a KV head as the rows of one 16-row `mma.sync` tile. Included by ops_attention.cu after
// attn_decode_kernel and decode_merge_splits.
//
// Why: the CUDA-core kernel does 2 g head_dim FMAs per key, its operands out of shared memory, and from g = 4
// (Llama-3.1-8B, Qwen3-30B-A3B: g = 8) that work, not the KV bytes, bounds it (g = 8: 36-43% of the HBM bandwidth
// g = 2 reaches, measured). Here a 32-key chunk is 24 MMAs per warp.
//
// Each of the 4 warps takes 8 keys of every chunk and keeps its own online softmax (max, sum, O) over them:
// S = Q K^T is one 16 x 8 tile (Q's fragments loaded once), P V the k16 MMA with the other 8 keys' probabilities
// zero (so no exchange between warps per chunk). At the end the warps' states are combined in shared memory in warp
// order, and the block writes the output, or its split's partial for decode_merge_splits, as attn_decode_kernel.
// Rows g..15 of the tile are zero queries whose results are never written.
#pragma once

#include "mma_sync.cuh"

namespace fdl {
namespace {

template <typename T, int D>
struct DecodeMma {
  static constexpr int ROW = Layout<T, D>::ROW;  // padded smem row (elements): ldmatrix's 8 rows hit distinct banks
  static constexpr int NW = NT / 32;             // warps, 8 keys of each chunk each
  static_assert(NW * 8 == KC, "each warp takes 8 keys of a chunk");
  // Q [16][ROW] | K, V double buffers (attn_decode_kernel's, filled by ChunkRows) | (m, l) of each warp's rows.
  // After the chunks, the K / V buffers hold each warp's O [NW][16][D] floats, then decode_merge_splits' weights.
  static constexpr size_t KV_OFF = (16 * ROW * sizeof(T) + 15) / 16 * 16;
  static constexpr size_t KV_BYTES = 2 * (size_t)Layout<T, D>::KV_ELEMS * sizeof(T);
  static_assert((size_t)NW * 16 * D * sizeof(float) <= KV_BYTES, "the warps' O must fit the K / V buffers");
  static constexpr size_t ML_OFF = KV_OFF + KV_BYTES;
  static constexpr size_t bytes = ML_OFF + NW * 16 * sizeof(float2);
};

// CB: the cache's block size is a multiple of KC, so each chunk's rows come from one block-table entry (ChunkBlock).
template <typename T, int D, bool CB>
__global__ void __launch_bounds__(NT, 4) attn_decode_mma_kernel(Args a) {
  pdl_trigger();
  pdl_wait();
  using L = Layout<T, D>;
  using C = DecodeMma<T, D>;
  constexpr int NTD = D / 8;  // 8-column tiles of O
  const int j = blockIdx.y, g = a.g;
  DecodeItem job;
  if (!decode_block_start<T, D>(a, job)) return;  // no decode token in this slot
  const int t = job.t, r = job.r, k0 = job.k0, k1 = job.k1;

  extern __shared__ float4 smem4[];
  uint8_t* sm = reinterpret_cast<uint8_t*>(smem4);
  T* Qs = reinterpret_cast<T*>(sm);
  T* kbuf = reinterpret_cast<T*>(sm + C::KV_OFF);
  T* vbuf = kbuf + L::KV_ELEMS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  // Q rows 0..g-1: the token's heads j g .. j g + g - 1; zeros below (committed with the first chunk)
  const T* q = static_cast<const T*>(a.q) + (t * a.h + (int64_t)j * g) * D;
  for (int i = threadIdx.x; i < 16 * L::VPR; i += NT) {
    const int m = i / L::VPR, c = i - m * L::VPR;
    cp_async16(Qs + m * C::ROW + c * L::VE, m < g ? q + m * D + c * L::VE : q, m < g);
  }
  const int* btab = a.block_tables + (int64_t)r * a.max_blocks;
  const T* kc = static_cast<const T*>(a.kc);
  const T* vc = static_cast<const T*>(a.vc);
  const int nchunks = k1 > k0 ? (k1 - k0 + KC - 1) / KC : 0;
  typename std::conditional<CB, ChunkBlock<T, D>, ChunkRows<T, D>>::type rows;
  if (nchunks > 0) {
    rows.compute(btab, a.kvh, j, a.bs, k0, k1);
    rows.issue(kbuf, vbuf, kc, vc);
    if (nchunks > 1) rows.compute(btab, a.kvh, j, a.bs, k0 + KC, k1);
  } else {
    cp_async_commit();
  }

  uint32_t qf[D / 16][4];
  float o[NTD][4], mx[2] = {-CUDART_INF_F, -CUDART_INF_F}, ls[2] = {0.f, 0.f};
#pragma unroll
  for (int n = 0; n < NTD; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 8 * (lane >> 4);
  // this warp's 8 keys of a chunk, as ldmatrix rows: key 8 warp + lane % 8, column block lane / 8
  const int w_row = 8 * warp + (lane & 7), w_col = 8 * (lane >> 3);

  for (int c = 0; c < nchunks; ++c) {
    cp_async_wait_all();
    __syncthreads();  // chunk c (and Q) landed; every warp is done with chunk c - 1
    if (c == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) ldsm_x4(qf[kk], Qs + a_row * C::ROW + kk * 16 + a_col);
    }
    const int kb = k0 + c * KC;
    if (c + 1 < nchunks) {
      rows.issue(kbuf + ((c + 1) & 1) * KC * C::ROW, vbuf + ((c + 1) & 1) * KC * C::ROW, kc, vc);
      if (c + 2 < nchunks) rows.compute(btab, a.kvh, j, a.bs, kb + 2 * KC, k1);
    }
    const T* ks = kbuf + (c & 1) * KC * C::ROW;
    const T* vs = vbuf + (c & 1) * KC * C::ROW;

    // S (16 rows x this warp's 8 keys) = Q K^T: ldmatrix x4 covers two k16 steps of the 8 key rows
    float sc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int k2 = 0; k2 < D / 32; ++k2) {
      uint32_t bf[4];
      ldsm_x4(bf, ks + w_row * C::ROW + k2 * 32 + w_col);
      mma16816<T>(sc, qf[2 * k2], bf[0], bf[1]);
      mma16816<T>(sc, qf[2 * k2 + 1], bf[2], bf[3]);
    }
    // scale (log2 units), keys past the split's end masked, online softmax; a row's 8 keys sit in its quad
    float p[2][2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float cm = -CUDART_INF_F;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = sc[hf * 2 + e] * a.scale_log2;
        if (kb + 8 * warp + 2 * (lane & 3) + e >= k1) v = -CUDART_INF_F;
        p[hf][e] = v;
        cm = fmaxf(cm, v);
      }
      cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 1));
      cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 2));
      const float m_new = fmaxf(mx[hf], cm);
      const float al = m_new == -CUDART_INF_F ? 1.f : exp2f(mx[hf] - m_new);
      mx[hf] = m_new;
#pragma unroll
      for (int e = 0; e < 2; ++e) p[hf][e] = m_new == -CUDART_INF_F ? 0.f : exp2f(p[hf][e] - m_new);
      ls[hf] = ls[hf] * al + p[hf][0] + p[hf][1];
#pragma unroll
      for (int n = 0; n < NTD; ++n) {
        o[n][hf * 2] *= al;
        o[n][hf * 2 + 1] *= al;
      }
    }
    // O += P V: P is 16 x 16 with this warp's keys in k 0-7 and zeros in k 8-15, so b1 (V rows 8-15) is zero too
    const uint32_t pf[4] = {pack2<T>(p[0][0], p[0][1]), pack2<T>(p[1][0], p[1][1]), 0u, 0u};
#pragma unroll
    for (int dq = 0; dq < NTD / 4; ++dq) {  // ldmatrix x4 (transposed): b0 of four 8-column tiles
      uint32_t bf[4];
      ldsm_x4_t(bf, vs + w_row * C::ROW + dq * 32 + w_col);
#pragma unroll
      for (int u = 0; u < 4; ++u) mma16816<T>(o[dq * 4 + u], pf, bf[u], 0u);
    }
  }
  cp_async_wait_all();  // nothing in flight into the buffers reused below (nchunks 0: Q's copies)
  __syncthreads();      // every warp is done with the K / V buffers

  // The warps' states into shared memory: (max, quad-summed sum) per row and O [warp][row][D].
  float* ow = reinterpret_cast<float*>(sm + C::KV_OFF);
  float2* mlw = reinterpret_cast<float2*>(sm + C::ML_OFF);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int row = (lane >> 2) + 8 * hf;
    float l = ls[hf];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if ((lane & 3) == 0) mlw[warp * 16 + row] = make_float2(mx[hf], l);
#pragma unroll
    for (int n = 0; n < NTD; ++n)
      *reinterpret_cast<float2*>(ow + (warp * 16 + row) * D + n * 8 + 2 * (lane & 3)) =
          make_float2(o[n][hf * 2], o[n][hf * 2 + 1]);
  }
  __syncthreads();
  // Combined in warp order: O = sum_w O_w 2^(m_w - M), l = sum_w l_w 2^(m_w - M), M = max_w m_w.
  const int items = g * D / 2;
  for (int it = threadIdx.x; it < items; it += NT) {
    const int hh = it / (D / 2), dp = it - hh * (D / 2);
    float M = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < C::NW; ++w) M = fmaxf(M, mlw[w * 16 + hh].x);
    float l = 0.f, o0 = 0.f, o1 = 0.f;
#pragma unroll
    for (int w = 0; w < C::NW; ++w) {
      const float2 ml = mlw[w * 16 + hh];
      const float wt = M == -CUDART_INF_F ? 0.f : exp2f(ml.x - M);  // 0 for a warp that saw no key
      const float2 v = *reinterpret_cast<const float2*>(ow + (w * 16 + hh) * D + dp * 2);
      l += ml.y * wt;
      o0 += v.x * wt;
      o1 += v.y * wt;
    }
    const int64_t head = (int64_t)j * g + hh;
    if (job.n == 1) {
      const float inv = l > 0.f ? 1.f / l : 0.f;
      *reinterpret_cast<uint32_t*>(static_cast<T*>(a.out) + (t * a.h + head) * D + dp * 2) = pack2<T>(o0 * inv, o1 * inv);
    } else {
      decode_write_partial<D>(a, job, head, dp, o0, o1, M, l);
    }
  }
  if (job.n == 1) return;
  decode_merge_splits<T, D>(a, job, j, reinterpret_cast<float*>(sm + C::KV_OFF));
}

}  // namespace
}  // namespace fdl
