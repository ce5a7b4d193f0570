// Tensor-core tile kernel of fdl_paged_attention (ops_attention.cu) for bf16 / fp16 and head_dim 64 / 128:
// the prefill and chunked-prefill rows (q_len > kDecodeMaxQ), FlashAttention-2 style on `mma.sync`
// m16n8k16 with fp32 accumulation. Included by ops_attention.cu after `Args` and `for_each_prefill_segment`;
// fp32 and head_dim 256 keep the CUDA-core tile kernel there.
//
// Why mma.sync and not Hopper's wgmma + TMA: the tile's rows are (token, query head) pairs gathered from
// a flat varlen batch and its keys come through a block table, which TMA's dense tensor maps do not
// describe; mma.sync with cp.async gathers keep the kernel one page long. Measured against the H100's
// limits in docs/benchmarks.md.
//
// Work split, as in the CUDA-core kernel (so graphs replay it for any batch of the captured token count):
// grid (ceil(T / tile_tokens), kv_heads); block b takes tokens [b * tile_tokens, ...) of the flat axis
// (blocks in reverse, so the last and usually longest tiles of a prompt start first) and works through
// the row segments inside it. A tile holds BM = 128 query rows (token x query head of one KV head:
// GQA heads share every K/V byte), 4 warps of 2 x 16 rows, against chunks of BN keys streamed through
// shared memory with cp.async double buffering. Scores are scaled in fp32 (log2 units, exp2); the
// probabilities go to bf16 / fp16 for the P V product, as FlashAttention does; row sums stay fp32.
//
// FP8 caches (kv_cache_dtype="fp8"): each chunk's e4m3 bytes and per-row scales stream through a staging buffer
// (cp.async double buffering, half the bytes), and are widened to the model dtype as value x scale into single
// K / V tiles before the MMAs, which then run as for a model-dtype cache (the product rounded to bf16 / fp16 costs
// far less than e4m3's own rounding).
//
// A row's result depends only on its own query and keys: every row sees its keys in chunks from key 0
// in the same order whatever else shares its tile, and masked keys contribute exact zeros.
#pragma once

#include "mma_sync.cuh"

namespace fdl {
namespace {

template <int D, bool F8 = false>
struct MmaTile {
  static constexpr int NW = 4;              // warps
  static constexpr int NTH = NW * 32;
  static constexpr int MT = 2;              // 16-row m-tiles per warp
  static constexpr int BM = NW * MT * 16;   // query rows per tile
  static constexpr int BN = D == 64 ? 64 : 32;  // keys per chunk (128: keeps the S tile in registers)
  static constexpr int VPR = D / 8;         // 16-byte vectors per row
  static constexpr int ROW = D + 8;         // padded smem row (elements): ldmatrix's 8 rows hit distinct banks
  static constexpr int Q_ELEMS = BM * ROW;
  static constexpr int KV_ELEMS = BN * ROW; // one chunk of K (or V)
  static constexpr int CPT = BN * VPR / NTH;  // 16-byte copies per thread per chunk, of K and of V each
  static_assert(BN * VPR % NTH == 0, "chunk must split evenly over the block");
  // FP8: a staging buffer holds one chunk's K and V bytes (BN x D each) and their 2 x BN scales
  static constexpr int VPR8 = D / 16;          // 16-byte vectors per e4m3 row
  static constexpr int CPT8 = BN * VPR8 / NTH; // 16-byte copies per thread per chunk, of K and of V each
  static_assert(BN * VPR8 % NTH == 0 && BN <= NTH, "FP8 chunk must split evenly over the block");
  static constexpr int STAGE_BYTES = 2 * BN * D + 2 * BN * 4;
  // model-dtype caches: Q + double-buffered K, V tiles; FP8: Q + single K, V tiles + two staging buffers
  static constexpr size_t bytes = F8 ? (size_t)(Q_ELEMS + 2 * KV_ELEMS) * 2 + 2 * (size_t)STAGE_BYTES
                                     : (size_t)(Q_ELEMS + 4 * KV_ELEMS) * 2;
};

// FP8: cache rows of the 16-byte e4m3 vectors this thread copies per chunk, and (threads < BN) the row of key
// k0 + threadIdx.x for its scales; the copies land in a staging buffer [K bytes | V bytes | K scales | V scales].
template <int D>
struct MmaChunkRows8 {
  using C = MmaTile<D, true>;
  int row[C::CPT8];
  int srow;

  __device__ __forceinline__ void compute(const int* btab, int kvh, int j, int bs, int k0, int k_end) {
#pragma unroll
    for (int n = 0; n < C::CPT8; ++n) {
      const int kk = k0 + (int)(threadIdx.x + n * C::NTH) / C::VPR8;
      row[n] = kk < k_end ? cache_row(btab, kvh, j, bs, kk) : -1;
    }
    const int kk = k0 + (int)threadIdx.x;
    srow = threadIdx.x < C::BN && kk < k_end ? cache_row(btab, kvh, j, bs, kk) : -1;
  }

  __device__ __forceinline__ void issue(uint8_t* stage, const uint8_t* kc, const uint8_t* vc, const float* ksc,
                                        const float* vsc) const {
#pragma unroll
    for (int n = 0; n < C::CPT8; ++n) {
      const int i = threadIdx.x + n * C::NTH;
      const int kr = i / C::VPR8, c = i - kr * C::VPR8;
      const bool valid = row[n] >= 0;  // invalid: zeros (value 0, scale 0)
      cp_async16(stage + kr * D + c * 16, valid ? kc + (int64_t)row[n] * D + c * 16 : kc, valid);
      cp_async16(stage + C::BN * D + kr * D + c * 16, valid ? vc + (int64_t)row[n] * D + c * 16 : vc, valid);
    }
    if (threadIdx.x < C::BN) {
      float* sc = reinterpret_cast<float*>(stage + 2 * C::BN * D);
      const bool valid = srow >= 0;
      cp_async4(sc + threadIdx.x, valid ? ksc + srow : ksc, valid);
      cp_async4(sc + C::BN + threadIdx.x, valid ? vsc + srow : vsc, valid);
    }
    cp_async_commit();
  }
};

// Cache rows of the keys this thread copies for the chunk starting at k0 (-1: past k_end), computed one
// chunk ahead of the copy so the block-table loads are in flight while the current chunk is computed.
template <int D>
struct MmaChunkRows {
  using C = MmaTile<D>;
  int row[C::CPT];

  __device__ __forceinline__ void compute(const int* btab, int kvh, int j, int bs, int k0, int k_end) {
#pragma unroll
    for (int n = 0; n < C::CPT; ++n) {
      const int kk = k0 + (int)(threadIdx.x + n * C::NTH) / C::VPR;
      row[n] = kk < k_end ? cache_row(btab, kvh, j, bs, kk) : -1;
    }
  }

  template <typename T>
  __device__ __forceinline__ void issue(T* ks, T* vs, const T* kc, const T* vc) const {
#pragma unroll
    for (int n = 0; n < C::CPT; ++n) {
      const int i = threadIdx.x + n * C::NTH;
      const int kr = i / C::VPR, c = i - kr * C::VPR;
      const bool valid = row[n] >= 0;  // invalid: zero-filled (V rows must not be NaN: 0 * NaN)
      const T* sk = valid ? kc + (int64_t)row[n] * D + c * 8 : kc;
      const T* sv = valid ? vc + (int64_t)row[n] * D + c * 8 : vc;
      cp_async16(ks + kr * C::ROW + c * 8, sk, valid);
      cp_async16(vs + kr * C::ROW + c * 8, sv, valid);
    }
    cp_async_commit();
  }
};

template <typename T, int D, bool F8>
__device__ void mma_segment(const Args& a, T* smem, int r, int64_t ts, int64_t te) {
  using C = MmaTile<D, F8>;
  constexpr int BN = C::BN, MT = C::MT, NTN = BN / 8, NTD = D / 8;
  const int j = blockIdx.y, g = a.g;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row_start = a.cu[r], q_len = a.cu[r + 1] - row_start, kv_len = a.seq_lens[r];
  const int ntok = (int)(te - ts), M = ntok * g;
  const int pos0 = kv_len - q_len + (int)(ts - row_start);  // position of the segment's first token
  const int kv_end = max(0, min(kv_len, pos0 + ntok));
  const int nchunks = (kv_end + BN - 1) / BN;

  T* Qs = smem;
  T* kbuf = Qs + C::Q_ELEMS;
  T* vbuf = kbuf + (F8 ? 1 : 2) * C::KV_ELEMS;
  uint8_t* stage = reinterpret_cast<uint8_t*>(vbuf + (F8 ? 1 : 2) * C::KV_ELEMS);  // F8: 2 x STAGE_BYTES

  __syncthreads();  // the previous segment is done with smem
  // Q rows (token-major, the g heads of KV head j for each token), zeros past M; one commit group
  // with the first K/V chunk.
  const T* q = static_cast<const T*>(a.q);
  for (int i = threadIdx.x; i < C::BM * C::VPR; i += C::NTH) {
    const int m = i / C::VPR, c = i - m * C::VPR;
    const bool valid = m < M;
    const int tok = valid ? m / g : 0, hh = valid ? m - tok * g : 0;
    cp_async16(Qs + m * C::ROW + c * 8, q + ((ts + tok) * a.h + (int64_t)j * g + hh) * D + c * 8, valid);
  }
  const int* btab = a.block_tables + (int64_t)r * a.max_blocks;
  using KV = typename std::conditional<F8, uint8_t, T>::type;  // the caches' element type
  const KV* kc = static_cast<const KV*>(a.kc);
  const KV* vc = static_cast<const KV*>(a.vc);
  typename std::conditional<F8, MmaChunkRows8<D>, MmaChunkRows<D>>::type rows;
  if (nchunks > 0) {
    rows.compute(btab, a.kvh, j, a.bs, 0, kv_end);
    if constexpr (F8) rows.issue(stage, kc, vc, a.ksc, a.vsc);
    else rows.issue(kbuf, vbuf, kc, vc);
    if (nchunks > 1) rows.compute(btab, a.kvh, j, a.bs, BN, kv_end);
  } else {
    cp_async_commit();
  }

  // This thread's rows: m = m0 + mt * 16 + 8 * hf.
  const int m0 = warp * MT * 16 + (lane >> 2);
  float o[MT][NTD][4], mx[MT][2], ls[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      mx[mt][hf] = -CUDART_INF_F;
      ls[mt][hf] = 0.f;
    }
#pragma unroll
    for (int n = 0; n < NTD; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
  }
  // ldmatrix lane addressing: A / V^T tiles (row = lane % 8 + 8 * (lane / 8 % 2), col = 8 * (lane / 16));
  // K tiles (key = lane % 8 + 8 * (lane / 16), col = 8 * (lane / 8 % 2)).
  const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 8 * (lane >> 4);
  const int k_row = (lane & 7) + 8 * (lane >> 4), k_col = 8 * ((lane >> 3) & 1);
  const T* q_base = Qs + (warp * MT * 16 + a_row) * C::ROW + a_col;

  for (int c = 0; c < nchunks; ++c) {
    cp_async_wait_all();
    __syncthreads();  // chunk c (and Q) landed; every warp is done with chunk c - 1
    const int kb = c * BN;
    if (c + 1 < nchunks) {
      // FP8: that staging buffer's chunk (c - 1) was widened before the last barrier
      if constexpr (F8) rows.issue(stage + ((c + 1) & 1) * C::STAGE_BYTES, kc, vc, a.ksc, a.vsc);
      else rows.issue(kbuf + ((c + 1) & 1) * C::KV_ELEMS, vbuf + ((c + 1) & 1) * C::KV_ELEMS, kc, vc);
      if (c + 2 < nchunks) rows.compute(btab, a.kvh, j, a.bs, kb + 2 * BN, kv_end);
    }
    const T* ks = kbuf + (F8 ? 0 : (c & 1) * C::KV_ELEMS);
    const T* vs = vbuf + (F8 ? 0 : (c & 1) * C::KV_ELEMS);
    if constexpr (F8) {
      const uint8_t* st = stage + (c & 1) * C::STAGE_BYTES;  // [K bytes | V bytes | K scales | V scales]
      widen_e4m3_rows<T, D, BN, C::NTH>(st, st + BN * D, D, reinterpret_cast<const float*>(st + 2 * BN * D), kbuf,
                                        vbuf, C::ROW);
      __syncthreads();  // the widened tiles are complete
    }

    // S = Q K^T
    float s[MT][NTN][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < NTN; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t af[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldsm_x4(af[mt], q_base + mt * 16 * C::ROW + kk * 16);
#pragma unroll
      for (int np = 0; np < NTN / 2; ++np) {
        uint32_t bf[4];
        ldsm_x4(bf, ks + (np * 16 + k_row) * C::ROW + kk * 16 + k_col);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(s[mt][2 * np], af[mt], bf[0], bf[1]);
          mma16816<T>(s[mt][2 * np + 1], af[mt], bf[2], bf[3]);
        }
      }
    }

    // scale (log2 units), mask, online softmax; a row's BN keys sit in the 4 lanes of its quad
    const bool masked = kb + BN > min(kv_end, pos0 + 1);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float cm = -CUDART_INF_F;
        // keys this row may see end before `lim` (recomputed here: registers are short); padding rows see none
        const int m = m0 + mt * 16 + 8 * hf;
        const int lim = m < M ? min(kv_end, pos0 + m / g + 1) : 0;
#pragma unroll
        for (int n = 0; n < NTN; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float v = s[mt][n][hf * 2 + e] * a.scale_log2;
            if (masked && kb + n * 8 + 2 * (lane & 3) + e >= lim) v = -CUDART_INF_F;
            s[mt][n][hf * 2 + e] = v;
            cm = fmaxf(cm, v);
          }
        cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 1));
        cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 2));
        const float m_new = fmaxf(mx[mt][hf], cm);
        const float al = m_new == -CUDART_INF_F ? 1.f : exp2f(mx[mt][hf] - m_new);
        mx[mt][hf] = m_new;
        float ps = 0.f;
#pragma unroll
        for (int n = 0; n < NTN; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = m_new == -CUDART_INF_F ? 0.f : exp2f(s[mt][n][hf * 2 + e] - m_new);
            s[mt][n][hf * 2 + e] = p;
            ps += p;
          }
        ls[mt][hf] = ls[mt][hf] * al + ps;
#pragma unroll
        for (int n = 0; n < NTD; ++n) {
          o[mt][n][hf * 2] *= al;
          o[mt][n][hf * 2 + 1] *= al;
        }
      }

    // O += P V (P from the S accumulators, re-packed as the A operand)
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t pf[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pf[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pf[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pf[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pf[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < NTD / 2; ++dp) {
        uint32_t bf[4];
        ldsm_x4_t(bf, vs + (kk * 16 + a_row) * C::ROW + dp * 16 + a_col);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(o[mt][2 * dp], pf[mt], bf[0], bf[1]);
          mma16816<T>(o[mt][2 * dp + 1], pf[mt], bf[2], bf[3]);
        }
      }
    }
  }

  cp_async_wait_all();  // nothing left in flight into smem the next segment reuses (nchunks 0: Q's copies)
  // out = O / l (l summed over the quad); rows past M are padding
  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float l = ls[mt][hf];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int m = m0 + mt * 16 + 8 * hf;
      if (m < M) {
        const int tok = m / g, hh = m - tok * g;
        const float inv = l > 0.f ? 1.f / l : 0.f;
        T* orow = out + ((ts + tok) * a.h + (int64_t)j * g + hh) * D + 2 * (lane & 3);
#pragma unroll
        for (int n = 0; n < NTD; ++n)
          *reinterpret_cast<uint32_t*>(orow + n * 8) = pack2<T>(o[mt][n][hf * 2] * inv, o[mt][n][hf * 2 + 1] * inv);
      }
    }
}

template <typename T, int D, bool F8>
__global__ void __launch_bounds__(MmaTile<D>::NTH, 2) attn_mma_kernel(Args a, int tile_tokens) {
  pdl_trigger();
  pdl_wait();
  extern __shared__ float4 smem4[];
  const int64_t t_begin = (int64_t)(gridDim.x - 1 - blockIdx.x) * tile_tokens;  // last tiles first
  for_each_prefill_segment(a, t_begin, tile_tokens, [&](int r, int64_t t, int64_t end) {
    mma_segment<T, D, F8>(a, reinterpret_cast<T*>(smem4), r, t, end);
  });
}

}  // namespace
}  // namespace fdl
