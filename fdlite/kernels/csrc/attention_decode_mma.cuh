// Tensor-core per-token ("decode") kernel of fdl_paged_attention (ops_attention.cu) for bf16 / fp16 queries at
// head_dim 64 / 128, over model-dtype caches or FP8 (e4m3) ones: attn_decode_kernel's grid, KV splits and merge,
// with the g query heads of a KV head as the rows of `mma.sync` tiles. Included by ops_attention.cu after
// attn_decode_kernel and decode_merge_splits.
//
// Why: the CUDA-core kernel does 2 g head_dim FMAs per key, its operands out of shared memory, and from g = 4
// (Llama-3.1-8B, Qwen3-30B-A3B: g = 8) that work, not the KV bytes, bounds it (g = 8: 36-43% of the HBM bandwidth
// g = 2 reaches, measured); over FP8 caches (half the bytes) it bounds it at g = 2 too.
//
// Each of the 4 warps owns 8 keys of every 32-key chunk and runs its own pipeline over them, with no block barrier
// until the end: it copies those keys' K / V rows into its own shared-memory ring (cp.async, STAGES chunks deep, the
// block-table entry of a chunk loaded a chunk before its copies), computes S = Q K^T (one 16 x 8 tile: Q's fragments
// stay in registers), keeps its own online softmax (max, sum, O) and adds P V (m16n8k8: its 8 keys are the k
// dimension). At the end the warps' states are combined in shared memory in warp order, and the block writes the
// output, or its split's partial for decode_merge_splits, as attn_decode_kernel. (The kernel this replaced shared
// each chunk's copies over the block, two barriers a chunk, and recomputed every copy's address: Nsight Compute
// counted ~560 instructions per warp and chunk there, a quarter of them IMADs, and its top stall on the barrier.)
// g <= 8 (R = 1): the tile's rows 8-15 are zero queries, never formed: their A registers are zero and their
// accumulators are not kept. O is rescaled only in a chunk where some row's running max grew (elsewhere the factor
// is exactly 1: the same bits).
//
// FP8 caches: the chunks stay e4m3 in shared memory and widen (cvt.f16x2.e4m3x2, exact) straight into fragment
// registers, the MMAs in fp16 (q converted, clamped to fp16's range): S's K fragment from 4 consecutive bytes of a
// key's row, Q's fragment holding the same 4 columns (the dot product sums over d, so any order of d serves); P V's
// V fragment from two keys' rows at D / 8 consecutive columns, which makes O's columns a permutation (d = D / 8 x
// column + tile) put back when O goes to shared memory. A key's score is multiplied by its K scale and its
// probability by its V scale times 2^8, O by 2^-8 when it leaves the registers (exact): V scales are amax / 448, so
// P x scale alone sat in fp16's subnormal range for V of magnitude below ~1 (a few significant bits a key). The
// product is clamped to fp16's largest value, which only V of amax above ~114,000 reaches.
#pragma once

#include "mma_sync.cuh"

namespace fdl {
namespace {

// Shared memory of attn_decode_mma_kernel for query type T, cache element C, head_dim D and R 8-row groups of heads.
template <typename T, typename C, int D, int R>
struct DecodeMma {
  static constexpr bool F8 = std::is_same<C, uint8_t>::value;
  using M = typename std::conditional<F8, __half, T>::type;  // the MMAs' operand type
  static constexpr int NW = NT / 32;                         // warps
  static constexpr int WK = KC / NW;                         // a warp's keys of each chunk: S's 8 columns
  static_assert(WK == 8, "a warp's keys of a chunk are one 8-column tile");
  static constexpr int STAGES = F8 ? 3 : 2;                  // a warp's chunks in its ring
  static constexpr int RBYTES = D * (int)sizeof(C);          // a cache row
  static constexpr int RB = RBYTES + 16;  // its padded copy: ldmatrix's and LDS.128's 8 rows on distinct banks
  static constexpr int VB = RBYTES / 16;  // 16-byte pieces of a row
  static constexpr int KPC = 32 / VB;     // rows one round of a warp's copies covers
  static constexpr int CP = WK / KPC;     // rounds per chunk, of K and of V each
  static_assert(WK % KPC == 0, "a warp's rows split evenly over its lanes");
  static constexpr int SC_OFF = 2 * WK * RB;                 // FP8: the rows' 8 K scales, then 8 V scales
  static constexpr int SB = SC_OFF + (F8 ? 2 * WK * 4 : 0);  // one stage: K rows | V rows | scales
  static constexpr int ROWS = 8 * R;                         // query rows kept per warp
  static constexpr int OROW = D + 4;                         // a row of a warp's O at the end (floats)
  static constexpr size_t RING = (size_t)NW * STAGES * SB;
  static constexpr size_t OW = (size_t)NW * ROWS * OROW * 4;  // then (m, l) [NW][ROWS]
  static constexpr size_t MERGE = (size_t)(MAXG * 64 + MAXG) * 4;  // decode_merge_splits' scratch
  static constexpr size_t bytes = std::max(std::max(RING, OW + (size_t)NW * ROWS * 8), MERGE);
};

// One warp's copies: the K / V rows (and FP8 scales) of its 8 keys of the next chunk into a stage of its ring.
// AB: the block size is a multiple of 8, so those keys are 8 consecutive rows of one cache block, found from one
// block-table entry that is loaded a chunk ahead; otherwise each row's entry is read as it is copied.
template <typename T, typename C, int D, int R, bool AB>
struct WarpCopies {
  using L = DecodeMma<T, C, D, R>;
  const uint8_t* kl;  // this lane's first piece of cache row 0 (K; V at vl): row r's is at + r RBYTES
  const uint8_t* vl;
  const float* ksc;
  const float* vsc;
  const int* btab;
  int jbs;   // j bs: row of key 0 of a cache block's KV head j, within the block
  int kvbs;  // kvh bs: rows of one cache block
  int bs, k1;
  int kg;    // the first of the warp's keys in the next chunk to copy
  int gi;    // AB: kg / bs
  int goff;  // AB: kg % bs
  int ent;   // AB: btab[gi], 0 when kg >= k1

  __device__ __forceinline__ void start(const Args& a, const int* tab, int j, int k_first, int k_end) {
    const int lane = threadIdx.x & 31, kr = lane / L::VB, v = lane - kr * L::VB;
    kl = static_cast<const uint8_t*>(a.kc) + kr * L::RBYTES + v * 16;
    vl = static_cast<const uint8_t*>(a.vc) + kr * L::RBYTES + v * 16;
    ksc = a.ksc;
    vsc = a.vsc;
    btab = tab;
    bs = a.bs;
    jbs = j * bs;
    kvbs = a.kvh * bs;
    k1 = k_end;
    kg = k_first;
    if constexpr (AB) {
      gi = kg / bs;
      goff = kg - gi * bs;
      ent = kg < k1 ? btab[gi] : 0;
    }
  }

  // Copies into stage `st` and commits them (an empty group past the end, so the ring's counting stays uniform).
  __device__ __forceinline__ void issue(uint8_t* st) {
    const int lane = threadIdx.x & 31;
    const int kr = lane / L::VB;
    const int nk = k1 - kg;  // the warp's keys of this chunk before k_end (may be <= 0)
    uint8_t* sk = st + kr * L::RB + (lane - kr * L::VB) * 16;
    if constexpr (AB) {
      // every address stays inside block `ent` (block 0 when nothing is left): rows past k_end read nothing
      const int row0 = ent * kvbs + jbs + goff;  // cache rows fit 32 bits (ChunkRows)
      const int64_t off = (int64_t)row0 * L::RBYTES;
#pragma unroll
      for (int n = 0; n < L::CP; ++n) {
        const bool valid = kr + n * L::KPC < nk;
        cp_async16(sk + n * L::KPC * L::RB, kl + off + n * L::KPC * L::RBYTES, valid);
        cp_async16(sk + L::WK * L::RB + n * L::KPC * L::RB, vl + off + n * L::KPC * L::RBYTES, valid);
      }
      if constexpr (L::F8) {
        if (lane < 2 * L::WK) {
          const int i = lane & (L::WK - 1);
          cp_async4(st + L::SC_OFF + lane * 4, (lane < L::WK ? ksc : vsc) + row0 + i, i < nk);
        }
      }
    } else {
#pragma unroll
      for (int n = 0; n < L::CP; ++n) {
        const int key = kr + n * L::KPC;
        const bool valid = key < nk;
        const int kk = kg + key;
        const int row = valid ? (btab[kk / bs] * kvbs + jbs + kk % bs) - key : 0;  // kl is already `kr` rows in
        const int64_t off = (int64_t)row * L::RBYTES + n * L::KPC * L::RBYTES;
        cp_async16(sk + n * L::KPC * L::RB, kl + off, valid);
        cp_async16(sk + L::WK * L::RB + n * L::KPC * L::RB, vl + off, valid);
      }
      if constexpr (L::F8) {
        if (lane < 2 * L::WK) {
          const int i = lane & (L::WK - 1);
          const bool valid = i < nk;
          const int kk = kg + i;
          const int row = valid ? btab[kk / bs] * kvbs + jbs + kk % bs : 0;
          cp_async4(st + L::SC_OFF + lane * 4, (lane < L::WK ? ksc : vsc) + row, valid);
        }
      }
    }
    cp_async_commit();
    kg += KC;
    if constexpr (AB) {
      goff += KC;
      while (goff >= bs) {
        goff -= bs;
        ++gi;
      }
      ent = kg < k1 ? btab[gi] : 0;  // the next chunk's entry, in flight while this one is computed
    }
  }
};

// e4m3 pair (low byte first) -> fp16 pair (exact).
__device__ __forceinline__ uint32_t e4m3x2_to_h2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two & 0xffffu), __NV_E4M3);
  return (uint32_t)h.x | ((uint32_t)h.y << 16);
}

// FP8 caches: P times the V scale is formed as P x (scale x 2^8) in fp16, O taken back by 2^-8 (the header).
constexpr float kVScaleUp = 256.f;

// Q's A fragments of this lane for every k16 step: qf[kk] = {rows r (, r + 8)} at columns (2q, 2q + 1) then at
// (2q + 8, 2q + 9), r = lane / 4, q = lane % 4; rows past g are zero. FP8: the columns are the permuted ones the K
// fragments use (D / 4 x q + 4 kk + {0, 1} and + {2, 3}), converted to fp16.
template <typename T, typename C, int D, int R>
__device__ __forceinline__ void load_q_fragments(const T* q, int g, uint32_t (&qf)[D / 16][2 * R]) {
  using L = DecodeMma<T, C, D, R>;
  const int lane = threadIdx.x & 31, qd = lane & 3;
#pragma unroll
  for (int hf = 0; hf < R; ++hf) {
    const int row = (lane >> 2) + 8 * hf;
    const bool valid = row < g;
    const T* qr = q + (int64_t)(valid ? row : 0) * D;
    if constexpr (L::F8) {
      constexpr int NV = D / 4 / 8;  // 16-byte loads of this lane's D / 4 columns
#pragma unroll
      for (int u = 0; u < NV; ++u) {
        const uint4 raw = valid ? *reinterpret_cast<const uint4*>(qr + (D / 4) * qd + 8 * u) : make_uint4(0, 0, 0, 0);
        const T* e = reinterpret_cast<const T*>(&raw);
        float f[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = fminf(fmaxf(to_f<T>(e[i]), -65504.f), 65504.f);
        qf[2 * u][hf] = pack2<__half>(f[0], f[1]);
        qf[2 * u][R + hf] = pack2<__half>(f[2], f[3]);
        qf[2 * u + 1][hf] = pack2<__half>(f[4], f[5]);
        qf[2 * u + 1][R + hf] = pack2<__half>(f[6], f[7]);
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        qf[kk][hf] = valid ? *reinterpret_cast<const uint32_t*>(qr + 16 * kk + 2 * qd) : 0u;
        qf[kk][R + hf] = valid ? *reinterpret_cast<const uint32_t*>(qr + 16 * kk + 8 + 2 * qd) : 0u;
      }
    }
  }
}

// R = 1 when g <= 8; AB: block size a multiple of 8 (WarpCopies).
template <typename T, typename C, int D, int R, bool AB>
__global__ void __launch_bounds__(NT, 4) attn_decode_mma_kernel(Args a) {
  pdl_trigger();
  pdl_wait();
  using L = DecodeMma<T, C, D, R>;
  using M = typename L::M;
  constexpr int NTD = D / 8;  // 8-column tiles of O
  const int j = blockIdx.y, g = a.g;
  __shared__ DecodeItem sjob;  // read back after the chunks: not held in registers through them
  {
    DecodeItem job;
    if (!decode_block_start<T, D>(a, job)) return;  // no decode token in this slot
    if (threadIdx.x == 0) sjob = job;
  }
  __syncthreads();
  const int k0 = sjob.k0, k1 = sjob.k1;

  extern __shared__ float4 smem4[];
  uint8_t* sm = reinterpret_cast<uint8_t*>(smem4);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, qd = lane & 3;
  uint8_t* ring = sm + (size_t)warp * L::STAGES * L::SB;
  const int nchunks = k1 > k0 ? (k1 - k0 + KC - 1) / KC : 0;

  WarpCopies<T, C, D, R, AB> cp;
  cp.start(a, a.block_tables + (int64_t)sjob.r * a.max_blocks, j, k0 + L::WK * warp, k1);
#pragma unroll
  for (int s = 0; s < L::STAGES - 1; ++s) {
    if (s < nchunks) cp.issue(ring + s * L::SB);
    else cp_async_commit();
  }

  uint32_t qf[D / 16][2 * R];
  load_q_fragments<T, C, D, R>(static_cast<const T*>(a.q) + ((int64_t)sjob.t * a.h + (int64_t)j * g) * D, g, qf);
  float o[NTD][2 * R], mx[R], ls[R];
#pragma unroll
  for (int hf = 0; hf < R; ++hf) {
    mx[hf] = -CUDART_INF_F;
    ls[hf] = 0.f;
  }
#pragma unroll
  for (int n = 0; n < NTD; ++n)
#pragma unroll
    for (int e = 0; e < 2 * R; ++e) o[n][e] = 0.f;

#pragma unroll 1
  for (int c = 0; c < nchunks; ++c) {
    cp_async_wait<L::STAGES - 2>();
    __syncwarp();  // chunk c landed (every lane's copies); every lane is done with chunk c - 1's stage
    if (c + L::STAGES - 1 < nchunks) cp.issue(ring + ((c + L::STAGES - 1) % L::STAGES) * L::SB);
    else cp_async_commit();
    const uint8_t* st = ring + (c % L::STAGES) * L::SB;
    const int left = k1 - (k0 + c * KC + L::WK * warp);  // this warp's keys of the chunk before k1

    // S (this warp's 8 keys as columns) = Q K^T
    float sc[2 * R];
#pragma unroll
    for (int e = 0; e < 2 * R; ++e) sc[e] = 0.f;
    if constexpr (L::F8) {
      // key lane / 4, bytes [D / 4 x q, + D / 4): 4 bytes a k16 step
      uint32_t kw[D / 16];
      const uint8_t* kr = st + (lane >> 2) * L::RB + (D / 4) * qd;
#pragma unroll
      for (int u = 0; u < D / 64; ++u) {
        const uint4 v = *reinterpret_cast<const uint4*>(kr + 16 * u);
        kw[4 * u] = v.x;
        kw[4 * u + 1] = v.y;
        kw[4 * u + 2] = v.z;
        kw[4 * u + 3] = v.w;
      }
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        mma16816_rows<M, R>(sc, qf[kk], e4m3x2_to_h2(kw[kk]), e4m3x2_to_h2(kw[kk] >> 16));
    } else {
      // ldmatrix x4 covers two k16 steps of the 8 key rows
#pragma unroll
      for (int k2 = 0; k2 < D / 32; ++k2) {
        uint32_t bf[4];
        ldsm_x4(bf, st + (lane & 7) * L::RB + (k2 * 32 + 8 * (lane >> 3)) * 2);
        mma16816_rows<M, R>(sc, qf[2 * k2], bf[0], bf[1]);
        mma16816_rows<M, R>(sc, qf[2 * k2 + 1], bf[2], bf[3]);
      }
    }
    // scale (log2 units; FP8: times the key's K scale), keys past k1 masked, online softmax; a row's 8 keys sit in
    // its quad (this lane: keys 2q, 2q + 1)
    float ksl0 = a.scale_log2, ksl1 = a.scale_log2;
    if constexpr (L::F8) {
      const float2 ks = *reinterpret_cast<const float2*>(st + L::SC_OFF + 8 * qd);
      ksl0 *= ks.x;
      ksl1 *= ks.y;
    }
    float p[R][2], mnew[R];
    bool grew = false;
#pragma unroll
    for (int hf = 0; hf < R; ++hf) {
      p[hf][0] = sc[2 * hf] * ksl0;
      p[hf][1] = sc[2 * hf + 1] * ksl1;
      if (left < L::WK) {
        if (2 * qd >= left) p[hf][0] = -CUDART_INF_F;
        if (2 * qd + 1 >= left) p[hf][1] = -CUDART_INF_F;
      }
      float cm = fmaxf(p[hf][0], p[hf][1]);
      cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 1));
      cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 2));
      mnew[hf] = fmaxf(mx[hf], cm);
      grew |= mnew[hf] > mx[hf];
    }
    if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
      for (int hf = 0; hf < R; ++hf) {
        const float al = mnew[hf] == -CUDART_INF_F ? 1.f : exp2f(mx[hf] - mnew[hf]);
        ls[hf] *= al;
#pragma unroll
        for (int n = 0; n < NTD; ++n) {
          o[n][2 * hf] *= al;
          o[n][2 * hf + 1] *= al;
        }
      }
    }
    uint32_t pa[R];
    float vs0 = 1.f, vs1 = 1.f;
    if constexpr (L::F8) {
      const float2 vs = *reinterpret_cast<const float2*>(st + L::SC_OFF + 4 * L::WK + 8 * qd);
      vs0 = fminf(vs.x * kVScaleUp, 65504.f);
      vs1 = fminf(vs.y * kVScaleUp, 65504.f);
    }
#pragma unroll
    for (int hf = 0; hf < R; ++hf) {
      mx[hf] = mnew[hf];
#pragma unroll
      for (int e = 0; e < 2; ++e) p[hf][e] = mnew[hf] == -CUDART_INF_F ? 0.f : exp2f(p[hf][e] - mnew[hf]);
      ls[hf] = ls[hf] + p[hf][0] + p[hf][1];
      if constexpr (L::F8) pa[hf] = pack2<M>(p[hf][0] * vs0, p[hf][1] * vs1);  // V's scale folded into P
      else pa[hf] = pack2<M>(p[hf][0], p[hf][1]);
    }

    // O += P V: this warp's 8 keys are the k dimension
    const uint8_t* vrows = st + L::WK * L::RB;
    if constexpr (L::F8) {
      // keys 2q and 2q + 1, columns [D / 8 x (lane / 4), + D / 8): tile n's B column lane / 4 is column D / 8 x
      // (lane / 4) + n, so O's column c of tile n is d = D / 8 x c + n
      constexpr int NWD = D / 32;  // 4-byte words of D / 8 columns
      uint32_t v0[NWD], v1[NWD];
      const uint8_t* vr = vrows + 2 * qd * L::RB + (D / 8) * (lane >> 2);
      if constexpr (NWD == 4) {
        const uint4 x = *reinterpret_cast<const uint4*>(vr), y = *reinterpret_cast<const uint4*>(vr + L::RB);
        v0[0] = x.x, v0[1] = x.y, v0[2] = x.z, v0[3] = x.w;
        v1[0] = y.x, v1[1] = y.y, v1[2] = y.z, v1[3] = y.w;
      } else {
        const uint2 x = *reinterpret_cast<const uint2*>(vr), y = *reinterpret_cast<const uint2*>(vr + L::RB);
        v0[0] = x.x, v0[1] = x.y;
        v1[0] = y.x, v1[1] = y.y;
      }
#pragma unroll
      for (int w = 0; w < NWD; ++w) {
        const uint32_t lo = __byte_perm(v0[w], v1[w], 0x5140), hi = __byte_perm(v0[w], v1[w], 0x7362);
        mma1688_rows<M, R>(o[4 * w], pa, e4m3x2_to_h2(lo));
        mma1688_rows<M, R>(o[4 * w + 1], pa, e4m3x2_to_h2(lo >> 16));
        mma1688_rows<M, R>(o[4 * w + 2], pa, e4m3x2_to_h2(hi));
        mma1688_rows<M, R>(o[4 * w + 3], pa, e4m3x2_to_h2(hi >> 16));
      }
    } else {
#pragma unroll
      for (int dq = 0; dq < NTD / 4; ++dq) {  // ldmatrix x4 (transposed): b0 of four 8-column tiles
        uint32_t bf[4];
        ldsm_x4_t(bf, vrows + (lane & 7) * L::RB + (dq * 32 + 8 * (lane >> 3)) * 2);
#pragma unroll
        for (int u = 0; u < 4; ++u) mma1688_rows<M, R>(o[dq * 4 + u], pa, bf[u]);
      }
    }
  }
  cp_async_wait_all();  // nothing in flight into the ring reused below
  __syncthreads();      // every warp is done with its ring

  // The warps' states into shared memory: (max, quad-summed sum) per row and O [warp][row][D] (columns in place).
  float* ow = reinterpret_cast<float*>(sm);
  float2* mlw = reinterpret_cast<float2*>(sm + L::OW);
#pragma unroll
  for (int hf = 0; hf < R; ++hf) {
    const int row = (lane >> 2) + 8 * hf;
    float l = ls[hf];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (qd == 0) mlw[warp * L::ROWS + row] = make_float2(mx[hf], l);
    float* orow = ow + (warp * L::ROWS + row) * L::OROW;
#pragma unroll
    for (int n = 0; n < NTD; ++n) {
      if constexpr (L::F8) {  // undo the 2^8 of P's V scale (exact)
        orow[(D / 8) * (2 * qd) + n] = o[n][2 * hf] * (1.f / kVScaleUp);
        orow[(D / 8) * (2 * qd + 1) + n] = o[n][2 * hf + 1] * (1.f / kVScaleUp);
      } else {
        *reinterpret_cast<float2*>(orow + n * 8 + 2 * qd) = make_float2(o[n][2 * hf], o[n][2 * hf + 1]);
      }
    }
  }
  __syncthreads();
  // Combined in warp order: O = sum_w O_w 2^(m_w - M), l = sum_w l_w 2^(m_w - M), M = max_w m_w.
  const DecodeItem job = sjob;
  const int64_t t = job.t;
  const int items = g * D / 2;
  for (int it = threadIdx.x; it < items; it += NT) {
    const int hh = it / (D / 2), dp = it - hh * (D / 2);
    float Mx = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < L::NW; ++w) Mx = fmaxf(Mx, mlw[w * L::ROWS + hh].x);
    float l = 0.f, o0 = 0.f, o1 = 0.f;
#pragma unroll
    for (int w = 0; w < L::NW; ++w) {
      const float2 ml = mlw[w * L::ROWS + hh];
      const float wt = Mx == -CUDART_INF_F ? 0.f : exp2f(ml.x - Mx);  // 0 for a warp that saw no key
      const float2 v = *reinterpret_cast<const float2*>(ow + (w * L::ROWS + hh) * L::OROW + dp * 2);
      l += ml.y * wt;
      o0 += v.x * wt;
      o1 += v.y * wt;
    }
    const int64_t head = (int64_t)j * g + hh;
    if (job.n == 1) {
      const float inv = l > 0.f ? 1.f / l : 0.f;
      *reinterpret_cast<uint32_t*>(static_cast<T*>(a.out) + (t * a.h + head) * D + dp * 2) = pack2<T>(o0 * inv, o1 * inv);
    } else {
      decode_write_partial<D>(a, job, head, dp, o0, o1, Mx, l);
    }
  }
  if (job.n == 1) return;
  decode_merge_splits<T, D>(a, job, j, reinterpret_cast<float*>(sm));
}

}  // namespace
}  // namespace fdl
