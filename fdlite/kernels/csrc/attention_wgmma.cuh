// Hopper tensor-core tile kernel of fdl_paged_attention (ops_attention.cu) for bf16 / fp16 at head_dim 64 / 128,
// over model-dtype or FP8 (e4m3) caches: the prefill and chunked-prefill rows on `wgmma` (sm_90a),
// FlashAttention-3's instruction with fdlite's paged, varlen tiles. Included by ops_attention.cu after
// attention_mma.cuh (the `mma.sync` kernel, which builds without sm_90a keep; FDLITE_ATTN_MMA=1 selects it for
// side-by-side runs).
//
// Why wgmma without TMA: TMA's tensor maps describe dense boxes, while a tile's rows are (token, query head)
// pairs of a flat varlen batch and its keys come through a block table; cp.async gathers write the same
// 128-byte-swizzled layout TMA would, and a warpgroup-wide MMA then reads Q, K and V from shared memory
// without ldmatrix and at twice mma.sync's rate.
//
// Work split: tiles of BM = 128 query rows (token x query head of one KV head: GQA heads share every K / V byte)
// over fixed slices of the flat token axis, as in the mma.sync kernel, so graphs replay it for any batch of the
// captured token count. The grid is persistent (min(SMs, tiles x kv_heads) blocks) and takes (tile, KV head)
// items from a global queue, longest tiles first (causal tiles differ 32-fold in work). A block is
// warp-specialized as FlashAttention-3's is: warpgroup 0 gathers Q (two buffers: the next tile's Q loads while
// the last one's rows finish) and chunks of BN = 64 keys into four shared-memory stages, mbarriers handing each
// stage over and back; warpgroups 1 and 2 take 64 rows each and take turns issuing their MMAs (ping-pong), so
// one's softmax runs while the other's MMAs do. Per chunk and computing warpgroup: S = Q K^T (A and B from shared
// memory), the online softmax in registers (O rescaled only when a row's max moves by more than 2^8), O += P V (P
// from registers: the S accumulators re-packed as the A operand; V read N-major straight from its [key][d] layout),
// left in flight until the next chunk's S is issued.
// Measured against the H100's limits (and the mma.sync kernel) in docs/benchmarks.md.
//
// Shared-memory layout (all 128-byte swizzled, Swizzle<3,4,3>: the 16-byte piece c of row r sits at piece
// c ^ (r % 8), in 1024-byte-aligned panels): Q [D / 64 panels][BM rows][64 columns], and per stage K and V
// [D / 64 panels][BN keys][64 columns]. Q and K are K-major operands; V is the N-major B operand of P V.
//
// A row's result depends only on its own query and keys: every row sees its keys in chunks from key 0 in the
// same order whatever else shares its tile, and masked keys contribute exact zeros.
//
// FP8 caches (F8): the loader copies each chunk's e4m3 rows and their scales into a raw slot of its own (cp.async,
// half a model-dtype chunk's bytes), and one chunk later widens them as value x scale into the model dtype (the
// mma.sync kernel's widen_e4m3_rows, the same values) in the stage's swizzled layout, then marks the stage full: the
// computing warpgroups run unchanged on model-dtype tiles. Each loader thread widens exactly the pieces (and reads
// exactly the scales) it copied itself, so its own cp.async wait orders everything. Three stages and one chunk of lag
// (the raw slots take the fourth stage's room).
#pragma once

#include "mma_sync.cuh"
#include "wgmma.cuh"

namespace fdl {
namespace {

template <int D, bool F8 = false>
struct WgTile {
  static constexpr int WG = 128;             // threads of a warpgroup
  static constexpr int CONSUMERS = 2;        // warpgroups computing, 64 query rows each; warpgroup 0 loads
  static constexpr int NTH = WG * (1 + CONSUMERS);
  static constexpr int BM = 64 * CONSUMERS;  // query rows per tile
  static constexpr int BN = 64;              // keys per chunk
  static constexpr int STAGES = F8 ? 3 : 4;  // chunks of K and V in shared memory
  static constexpr int LAG = F8 ? 1 : 2;     // chunks whose copies the loader keeps in flight before signalling
  static constexpr int PANELS = D / 64;      // 64-column (128-byte) panels of a row
  static constexpr int VPR = D / 8;          // 16-byte pieces per row
  static constexpr int Q_PANEL = BM * 128;   // bytes of one panel of Q
  static constexpr int KV_PANEL = BN * 128;  // bytes of one panel of a K or V chunk
  static constexpr int KV_BYTES = PANELS * KV_PANEL;
  static constexpr int STAGE = 2 * KV_BYTES; // K then V
  static constexpr int Q_BYTES = PANELS * Q_PANEL;  // one of two Q buffers (segments alternate)
  static constexpr int CPT = BN * VPR / WG;  // 16-byte copies per loader thread per chunk, of K and of V each
  static_assert(BN * VPR % WG == 0, "chunk must split evenly over the loader");
  // the computing warpgroups release chunk c - 1 once chunk c is full (its S issued first), and the loader marks
  // chunk c full after issuing chunk c + LAG, which needs chunk c + LAG - STAGES released: no cycle iff
  // LAG <= STAGES - 2
  static_assert(LAG <= STAGES - 2, "the stage hand-over would deadlock");
  static constexpr int ITEMS = 4;            // work items handed from the loader to the computing warpgroups
  // F8: a raw slot holds a chunk's e4m3 K and V rows and, per loader thread and piece, its key's K and V scale;
  // LAG + 1 slots (a slot is copied into again once its chunk is widened)
  static constexpr int RAW_SC = 2 * BN * D;  // the scales' offset in a raw slot
  static constexpr int RAW = F8 ? RAW_SC + 2 * (BN * D / 16) * 4 : 0;
  static constexpr int RAWS = F8 ? LAG + 1 : 0;
  // Q x 2 | stages | raw slots | mbarriers (full[STAGES], empty[STAGES], q_empty[2], item_full[ITEMS],
  // item_empty[ITEMS]) | item ring (int[ITEMS]), + room to align the base to 1024
  static constexpr size_t RAW_OFF = 2 * (size_t)Q_BYTES + (size_t)STAGES * STAGE;
  static constexpr size_t BAR_OFF = RAW_OFF + (size_t)RAWS * RAW;
  static constexpr int NBARS = 2 * STAGES + 2 + 2 * ITEMS;
  static constexpr size_t ITEM_OFF = BAR_OFF + NBARS * 8;
  static constexpr size_t bytes = ITEM_OFF + ITEMS * 4 + 1024;
};

// How far (log2 units) a chunk's max may pass a row's running max before the running max moves (and O is rescaled).
constexpr float kLazyLog2 = 8.f;

// 2^x on the SFU in one instruction (exp2f adds range handling the softmax does not need: 2^-inf = 0 here too).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Cache rows of the keys a loader thread copies for the chunk starting at k0 (-1: past k_end), computed one chunk
// ahead of the copy (as MmaChunkRows); the copies land swizzled. `tid`: the thread's index in the loader warpgroup.
template <int D>
struct WgChunkRows {
  using C = WgTile<D>;
  static constexpr int KSTEP = C::WG / C::VPR;  // keys between a thread's successive copies
  int row[C::CPT];
  int run;     // bs a multiple of BN: the cache row of the chunk's first key (its keys are consecutive rows); else -1
  int nvalid;  // keys of the chunk before k_end

  // k0 is a multiple of BN; when bs is too, the chunk is one run of consecutive cache rows: one table lookup,
  // and the copies step through source and destination by constant strides (the loader's issue rate bounds
  // the kernel otherwise)
  __device__ __forceinline__ void compute(int tid, const int* btab, int kvh, int j, int bs, int k0, int k_end) {
    nvalid = min(C::BN, k_end - k0);
    if (bs % C::BN == 0) {
      run = cache_row(btab, kvh, j, bs, k0);
      return;
    }
    run = -1;
#pragma unroll
    for (int n = 0; n < C::CPT; ++n) {
      const int kk = k0 + (tid + n * C::WG) / C::VPR;
      row[n] = kk < k_end ? cache_row(btab, kvh, j, bs, kk) : -1;
    }
  }

  template <typename T>
  __device__ __forceinline__ void issue(int tid, uint8_t* stage, const T* kc, const T* vc) const {
    const int kr0 = tid / C::VPR, c = tid - kr0 * C::VPR;
    // this thread's pieces: keys kr0 + n KSTEP, piece c; kr0 + n KSTEP has kr0's swizzle phase (KSTEP % 8 == 0)
    static_assert(KSTEP % 8 == 0, "the swizzle phase must repeat across a thread's copies");
    uint8_t* dst = stage + (c >> 3) * C::KV_PANEL + sw128(kr0, c & 7);
    if (run >= 0) {
      const int64_t off = (int64_t)(run + kr0) * D + c * 8;
#pragma unroll
      for (int n = 0; n < C::CPT; ++n) {
        const bool valid = kr0 + n * KSTEP < nvalid;  // invalid: zero-filled (V rows must not be NaN: 0 * NaN)
        const int64_t o = off + (int64_t)n * KSTEP * D;
        cp_async16(dst + n * KSTEP * 128, valid ? kc + o : kc, valid);
        cp_async16(dst + C::KV_BYTES + n * KSTEP * 128, valid ? vc + o : vc, valid);
      }
    } else {
#pragma unroll
      for (int n = 0; n < C::CPT; ++n) {
        const bool valid = row[n] >= 0;
        const int64_t o = (int64_t)row[n] * D + c * 8;
        cp_async16(dst + n * KSTEP * 128, valid ? kc + o : kc, valid);
        cp_async16(dst + C::KV_BYTES + n * KSTEP * 128, valid ? vc + o : vc, valid);
      }
    }
    cp_async_commit();
  }
};

// FP8 caches: a loader thread's pieces of a chunk. Thread tid copies piece tid % VPR8 (16 e4m3 bytes) of keys
// tid / VPR8 + n KSTEP of K and of V into a raw slot, with those keys' scales (each thread its own copies: a key's
// scale is copied by each of its VPR8 threads, 4 bytes each), and later widens the same pieces into the stage.
template <int D>
struct WgChunkRows8 {
  using C = WgTile<D, true>;
  static constexpr int VPR8 = D / 16;                // 16-byte pieces of an e4m3 row
  static constexpr int KSTEP = C::WG / VPR8;         // keys between a thread's successive pieces
  static constexpr int CPT = C::BN * VPR8 / C::WG;   // pieces per thread and chunk, of K and of V each
  static_assert(KSTEP % 8 == 0, "the swizzle phase must repeat across a thread's pieces");
  static_assert(C::RAW == C::RAW_SC + 2 * CPT * C::WG * 4, "raw slot: K, V, then a K and a V scale per piece");
  int row[CPT];  // cache rows of the thread's keys, -1 past k_end (zeros: value 0, scale 0)

  __device__ __forceinline__ void compute(int tid, const int* btab, int kvh, int j, int bs, int k0, int k_end) {
#pragma unroll
    for (int n = 0; n < CPT; ++n) {
      const int kk = k0 + tid / VPR8 + n * KSTEP;
      row[n] = kk < k_end ? cache_row(btab, kvh, j, bs, kk) : -1;
    }
  }

  // Raw slot layout, thread-major so a warp's copies and reads are 512 consecutive bytes: K piece n of thread tid at
  // (n WG + tid) 16, V's at + BN D, the scales at RAW_SC + (n WG + tid) 4 (K) and + CPT WG 4 more (V).
  __device__ __forceinline__ void issue(int tid, uint8_t* raw, const uint8_t* kc, const uint8_t* vc, const float* ksc,
                                        const float* vsc) const {
    const int c = tid % VPR8;
    float* sc = reinterpret_cast<float*>(raw + C::RAW_SC);
#pragma unroll
    for (int n = 0; n < CPT; ++n) {
      const bool valid = row[n] >= 0;
      const int64_t o = (int64_t)row[n] * D + c * 16;
      const int at = n * C::WG + tid;
      cp_async16(raw + at * 16, valid ? kc + o : kc, valid);
      cp_async16(raw + C::BN * D + at * 16, valid ? vc + o : vc, valid);
      cp_async4(sc + at, valid ? ksc + row[n] : ksc, valid);
      cp_async4(sc + CPT * C::WG + at, valid ? vsc + row[n] : vsc, valid);
    }
    cp_async_commit();
  }

  // This thread's pieces of a landed raw slot, widened as value x scale into model-dtype pieces 2c and 2c + 1 of their
  // keys' rows in the stage (K, then V at + KV_BYTES), swizzled as the model-dtype copies land.
  template <typename T>
  __device__ __forceinline__ static void widen(int tid, const uint8_t* raw, uint8_t* stage) {
    const int kr0 = tid / VPR8, c = tid % VPR8;
    const float* sc = reinterpret_cast<const float*>(raw + C::RAW_SC);
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
#pragma unroll
      for (int n = 0; n < CPT; ++n) {
        const int at = n * C::WG + tid, key = kr0 + n * KSTEP;
        const uint4 w = *reinterpret_cast<const uint4*>(raw + kv * C::BN * D + at * 16);
        const float f = sc[kv * CPT * C::WG + at];
        const uint32_t wd[4] = {w.x, w.y, w.z, w.w};
        uint32_t out[8];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const uint16_t lo = (uint16_t)(wd[u] & 0xffffu), hi = (uint16_t)(wd[u] >> 16);
          const float2 a = cache_pair_to_f2<uint8_t>(reinterpret_cast<const uint8_t*>(&lo));
          const float2 b = cache_pair_to_f2<uint8_t>(reinterpret_cast<const uint8_t*>(&hi));
          out[2 * u] = pack2<T>(a.x * f, a.y * f);
          out[2 * u + 1] = pack2<T>(b.x * f, b.y * f);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int pc = 2 * c + h;  // the model-dtype piece (8 elements) of the row
          *reinterpret_cast<uint4*>(stage + kv * C::KV_BYTES + (pc >> 3) * C::KV_PANEL + sw128(key, pc & 7)) =
              make_uint4(out[4 * h], out[4 * h + 1], out[4 * h + 2], out[4 * h + 3]);
        }
      }
    }
  }
};

// The block's pipeline position, carried across its tiles and segments: chunks handed through the stages so far
// (chunk i uses stage i % STAGES; its barriers' phase is i / STAGES) and segments with keys so far (segment q
// uses Q buffer q % 2, released through q_empty[q % 2] in phase q / 2).
struct WgPipe {
  uint32_t bars;  // shared address of full[0]; empty[s] at bars + 8 (STAGES + s); q_empty[b] at bars + 8 (2 STAGES + b)
  int it;
  int sq;
};

// One row segment (tokens [ts, te) of row r, all of them prefill tokens) on the block's three warpgroups:
// warpgroup 0 gathers Q and the K / V chunks (cp.async, swizzled) into the stages and marks each full; warpgroups
// 1 and 2 each take 64 query rows, wait for a chunk, run S = Q K^T, the online softmax and O += P V on it and
// mark its stage empty once their P V is done (every thread arrives: no divergent branch among the MMAs). The two computing warpgroups never wait for each other, so one's
// softmax runs under the other's MMAs; the loader runs up to STAGES chunks ahead.
template <typename T, int D, bool F8>
__device__ void wg_segment(const Args& a, uint8_t* smem, WgPipe& pipe, int j, int r, int64_t ts, int64_t te) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = WgTile<D, F8>;
  constexpr int BN = C::BN, S = C::STAGES, NKQ = D / 16, NKP = BN / 16;
  const int g = a.g;
  // the role is warp-uniform, and ptxas must see that: a wgmma after a branch it thinks divergent is serialized
  const int wg = __shfl_sync(0xffffffffu, threadIdx.x / C::WG, 0), tid = threadIdx.x % C::WG;
  const int lane = threadIdx.x & 31, warp = tid >> 5;
  const int row_start = a.cu[r], q_len = a.cu[r + 1] - row_start, kv_len = a.seq_lens[r];
  const int ntok = (int)(te - ts), M = ntok * g;
  const int pos0 = kv_len - q_len + (int)(ts - row_start);  // position of the segment's first token
  const int kv_end = max(0, min(kv_len, pos0 + ntok));
  const int nchunks = (kv_end + BN - 1) / BN;
  const int it0 = pipe.it, sq = pipe.sq;
  pipe.it += nchunks;
  pipe.sq += nchunks > 0;
  uint8_t* qs = smem + (sq & 1) * C::Q_BYTES;
  uint8_t* stages = smem + 2 * C::Q_BYTES;
  const uint32_t full0 = pipe.bars, empty0 = pipe.bars + 8 * S, q_empty = pipe.bars + 8 * (2 * S + (sq & 1));

  if (wg == 0) {  // ------------------------------------------------------------------------------------ loader
    if (nchunks == 0) return;  // no key: the rows' outputs are zeros, Q is not needed
    // this Q buffer is free once the segment two before is done (so the next tile's Q and first chunks load
    // while the computing warpgroups finish this one)
    mbar_wait(q_empty, ((sq >> 1) & 1) ^ 1);
    const T* q = static_cast<const T*>(a.q);
    for (int i = tid; i < C::BM * C::VPR; i += C::WG) {
      const int m = i / C::VPR, c = i - m * C::VPR;
      const bool valid = m < M;  // zeros past M
      const int tok = valid ? m / g : 0, hh = valid ? m - tok * g : 0;
      cp_async16(qs + (c >> 3) * C::Q_PANEL + sw128(m, c & 7),
                 q + ((ts + tok) * a.h + (int64_t)j * g + hh) * D + c * 8, valid);
    }  // (committed with chunk 0: Q is complete when chunk 0 is)
    const int* btab = a.block_tables + (int64_t)r * a.max_blocks;
    if constexpr (F8) {
      static_assert(C::LAG == 1, "the FP8 loader widens the chunk before the one it just issued");
      const uint8_t* kc = static_cast<const uint8_t*>(a.kc);
      const uint8_t* vc = static_cast<const uint8_t*>(a.vc);
      uint8_t* raws = smem + C::RAW_OFF;
      // chunk cc's raw slot, landed once `in_flight` later groups are left, widened into its stage, marked full
      auto widen_chunk = [&](int cc, auto in_flight) {
        const int i = it0 + cc;
        mbar_wait(empty0 + 8 * (i % S), ((i / S) & 1) ^ 1);  // chunk i - S released its stage
        cp_async_wait<decltype(in_flight)::value>();
        WgChunkRows8<D>::template widen<T>(tid, raws + (cc % C::RAWS) * C::RAW, stages + (i % S) * C::STAGE);
        fence_proxy_async();
        mbar_arrive(full0 + 8 * (i % S));
      };
      WgChunkRows8<D> rows;
      rows.compute(tid, btab, a.kvh, j, a.bs, 0, kv_end);
      for (int c = 0; c < nchunks; ++c) {
        rows.issue(tid, raws + (c % C::RAWS) * C::RAW, kc, vc, a.ksc, a.vsc);
        if (c + 1 < nchunks) rows.compute(tid, btab, a.kvh, j, a.bs, (c + 1) * BN, kv_end);
        if (c > 0) widen_chunk(c - 1, std::integral_constant<int, 1>{});
      }
      widen_chunk(nchunks - 1, std::integral_constant<int, 0>{});
    } else {
      const T* kc = static_cast<const T*>(a.kc);
      const T* vc = static_cast<const T*>(a.vc);
      WgChunkRows<D> rows;
      rows.compute(tid, btab, a.kvh, j, a.bs, 0, kv_end);
      for (int c = 0; c < nchunks; ++c) {
        const int i = it0 + c;
        mbar_wait(empty0 + 8 * (i % S), ((i / S) & 1) ^ 1);  // chunk i - S released its stage
        rows.issue(tid, stages + (i % S) * C::STAGE, kc, vc);
        if (c + 1 < nchunks) rows.compute(tid, btab, a.kvh, j, a.bs, (c + 1) * BN, kv_end);
        stage_full_lagging<C::LAG>(full0, S, i, c + 1);
      }
      stages_rest_full<C::LAG>(full0, S, it0 + nchunks, nchunks);
    }
    return;
  }

  // ------------------------------------------------------------------------------------------- computing warpgroups
  // This thread's rows: (wg - 1) * 64 + 16 * warp + lane / 4 (+ 8); its columns 2 * (lane % 4) (+ 1) of each
  // 8-column block of an accumulator.
  const int m0 = (wg - 1) * 64 + 16 * warp + (lane >> 2);
  int lim[2];  // the keys row m0 + 8 hf may see end before lim[hf]; padding rows (past M) see none
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int m = m0 + 8 * hf;
    lim[hf] = m < M ? min(kv_end, pos0 + m / g + 1) : 0;
  }
  float o[C::PANELS][32], mx[2], ls[2];
  const float lazy = kLazyLog2 / a.scale_log2;  // the threshold in raw score units (the scale is positive)
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    mx[hf] = -CUDART_INF_F;
    ls[hf] = 0.f;
  }
#pragma unroll
  for (int p = 0; p < C::PANELS; ++p)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[p][i] = 0.f;
  const uint64_t q_desc = wg_desc((uint32_t)__cvta_generic_to_shared(qs) + (wg - 1) * 64 * 128, 16, 1024);
  const uint32_t st_addr = (uint32_t)__cvta_generic_to_shared(stages);

  for (int c = 0; c < nchunks; ++c) {
    const int i = it0 + c, kb = c * BN;
    const uint32_t k_addr = st_addr + (i % S) * C::STAGE;
    const uint64_t k_desc = wg_desc(k_addr, 16, 1024), v_desc = wg_desc(k_addr + C::KV_BYTES, C::KV_PANEL, 1024);
    mbar_wait(full0 + 8 * (i % S), (i / S) & 1);
    // Ping-pong (FlashAttention-3): the two warpgroups take turns issuing S = Q K^T, so one's softmax runs while
    // the other's MMAs do, instead of both waiting for the same chunk and then both computing softmax at once.
    named_bar_sync(wg, 2 * C::WG);  // my turn (the other warpgroup arrived after its issue)
    float s[32];
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < NKQ; ++kk) {
      const uint32_t col = (kk & 3) * 32;  // 16 columns of the 64-column panel
      wgmma_m64n64k16_ss<T>(s, wg_desc_add(q_desc, (kk >> 2) * C::Q_PANEL + col),
                            wg_desc_add(k_desc, (kk >> 2) * C::KV_PANEL + col), kk > 0);
    }
    wg_commit();
    named_bar_arrive(3 - wg, 2 * C::WG);  // the other warpgroup's turn
    if (c > 0) {  // chunk c - 1's P V (in flight until now) is done: release its stage
      wg_wait<1>();
      mbar_arrive(empty0 + 8 * ((i - 1) % S));
    }
    wg_wait<0>();
    wg_pin(s);
#pragma unroll
    for (int p = 0; p < C::PANELS; ++p) wg_pin(o[p]);

    // online softmax over raw scores (the scale is positive: it commutes with max), probabilities as
    // exp2(s * scale - max * scale); a row's 64 keys sit in the 4 lanes of its quad. Only chunks reaching past
    // the first row's last key are masked (a branch uniform over the block).
    if (kb + BN > min(kv_end, pos0 + 1)) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (kb + nb * 8 + 2 * (lane & 3) + e >= lim[hf]) s[nb * 4 + hf * 2 + e] = -CUDART_INF_F;
    }
    float al[2];  // each row's factor for O and its sum: exactly 1 unless its running max moved
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float cm[4];  // four partial maxima: short dependency chains
#pragma unroll
      for (int q4 = 0; q4 < 4; ++q4)
        cm[q4] = fmaxf(fmaxf(s[(2 * q4) * 4 + hf * 2], s[(2 * q4) * 4 + hf * 2 + 1]),
                       fmaxf(s[(2 * q4 + 1) * 4 + hf * 2], s[(2 * q4 + 1) * 4 + hf * 2 + 1]));
      float m_c = fmaxf(fmaxf(cm[0], cm[1]), fmaxf(cm[2], cm[3]));
      m_c = fmaxf(m_c, __shfl_xor_sync(0xffffffffu, m_c, 1));
      m_c = fmaxf(m_c, __shfl_xor_sync(0xffffffffu, m_c, 2));
      // The running max moves only when the chunk's passes it by more than kLazyLog2 (FlashAttention-4's lazy
      // rescaling; the first finite max always): probabilities stay below 2^kLazyLog2, well inside fp32 and bf16,
      // and O is rescaled only on the few chunks where a max moved. Decided from the row's own scores alone.
      const float m_new = m_c > mx[hf] + lazy ? m_c : mx[hf];
      al[hf] = m_new == mx[hf] ? 1.f : fast_exp2((mx[hf] - m_new) * a.scale_log2);  // 0 after -inf: O, l are 0
      mx[hf] = m_new;
      const float sub = m_new == -CUDART_INF_F ? 0.f : m_new * a.scale_log2;  // all masked so far: p = 0
      float ps[2] = {0.f, 0.f};
#pragma unroll
      for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& v = s[nb * 4 + hf * 2 + e];
          v = fast_exp2(fmaf(v, a.scale_log2, -sub));
          ps[nb & 1] += v;
        }
      ls[hf] = ls[hf] * al[hf] + (ps[0] + ps[1]);
    }
    if (__any_sync(0xffffffffu, al[0] != 1.f || al[1] != 1.f)) {  // (multiplying by 1 would change no bit)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int p = 0; p < C::PANELS; ++p)
#pragma unroll
          for (int nb = 0; nb < 8; ++nb) {
            o[p][nb * 4 + hf * 2] *= al[hf];
            o[p][nb * 4 + hf * 2 + 1] *= al[hf];
          }
    }
    // O += P V: P's accumulator layout is the A-register layout, 16 keys per k-step; left in flight
    uint32_t pf[NKP][4];
#pragma unroll
    for (int kk = 0; kk < NKP; ++kk) {
      pf[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
      pf[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      pf[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      pf[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
#pragma unroll
    for (int p = 0; p < C::PANELS; ++p) wg_pin(o[p]);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < NKP; ++kk)
#pragma unroll
      for (int p = 0; p < C::PANELS; ++p)
        wgmma_m64n64k16_rs_tb<T>(o[p], pf[kk], wg_desc_add(v_desc, p * C::KV_PANEL + kk * 16 * 128));
    wg_commit();
  }
  if (nchunks > 0) {
    wg_wait<0>();
    mbar_arrive(empty0 + 8 * ((it0 + nchunks - 1) % S));
    mbar_arrive(q_empty);  // this segment's Q is no longer read
  }
#pragma unroll
  for (int p = 0; p < C::PANELS; ++p) wg_pin(o[p]);

  // out = O / l (l summed over the quad); rows past M are padding
  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float l = ls[hf];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int m = m0 + 8 * hf;
    if (m < M) {
      const int tok = m / g, hh = m - tok * g;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      T* orow = out + ((ts + tok) * a.h + (int64_t)j * g + hh) * D + 2 * (lane & 3);
#pragma unroll
      for (int p = 0; p < C::PANELS; ++p)
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
          *reinterpret_cast<uint32_t*>(orow + p * 64 + nb * 8) =
              pack2<T>(o[p][nb * 4 + hf * 2] * inv, o[p][nb * 4 + hf * 2 + 1] * inv);
    }
  }
#endif
}

// Persistent: grid (min(SMs, tiles x kv_heads)), one pipeline per block across all its work. Work items are
// taken from a global counter (sched[0], dynamic: causal tiles differ 32-fold in work), item i being tile
// ntiles - 1 - i / kvh (the longest last tiles first) of KV head i % kvh; the loader's first thread takes each
// and hands it to the computing warpgroups through a ring in shared memory. The last block to finish zeroes the
// counters (sched[1] counts finished blocks), so the next launch, or graph replay, starts from zero.
template <typename T, int D, bool F8>
__global__ void __launch_bounds__(WgTile<D, F8>::NTH, 1) attn_wgmma_kernel(Args a, int tile_tokens, int* sched) {
  using C = WgTile<D, F8>;
  pdl_trigger();
  // sm_90a code only (mbarriers, wgmma): other targets of a multi-arch build (FDLITE_CUDA_ARCHS "80;90a") get an
  // empty kernel that is never launched (wgmma_ready)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ float4 smem4[];
  uint8_t* smem = smem_align1024(smem4);
  WgPipe pipe{(uint32_t)__cvta_generic_to_shared(smem + C::BAR_OFF), 0, 0};
  const uint32_t item_full = pipe.bars + 8 * (2 * C::STAGES + 2), item_empty = item_full + 8 * C::ITEMS;
  volatile int* ring = reinterpret_cast<volatile int*>(smem + C::ITEM_OFF);
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::STAGES; ++s) {
      mbar_init(pipe.bars + 8 * s, C::WG);                               // full: every loader thread arrives
      mbar_init(pipe.bars + 8 * (C::STAGES + s), C::WG * C::CONSUMERS);  // empty: every computing thread arrives
    }
    for (int b = 0; b < 2; ++b) mbar_init(pipe.bars + 8 * (2 * C::STAGES + b), C::WG * C::CONSUMERS);  // q_empty
    for (int n = 0; n < C::ITEMS; ++n) {
      mbar_init(item_full + 8 * n, 1);
      mbar_init(item_empty + 8 * n, C::WG * C::CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  pdl_wait();
  const int wg = __shfl_sync(0xffffffffu, threadIdx.x / C::WG, 0);
  if (wg == 2) named_bar_arrive(1, 2 * C::WG);  // warpgroup 1 issues first
  const int64_t ntiles = (a.T + tile_tokens - 1) / tile_tokens, total = ntiles * a.kvh;
  for (int n = 0;; ++n) {
    const int slot = n % C::ITEMS;
    int64_t item;
    if (wg == 0) {
      if (threadIdx.x == 0) {
        mbar_wait(item_empty + 8 * slot, ((n / C::ITEMS) & 1) ^ 1);
        ring[slot] = atomicAdd(sched, 1);
        mbar_arrive(item_full + 8 * slot);
      }
      named_bar_sync(3, C::WG);  // the loader's threads: the item is in the ring
      item = ring[slot];
    } else {
      mbar_wait(item_full + 8 * slot, (n / C::ITEMS) & 1);
      item = ring[slot];
      mbar_arrive(item_empty + 8 * slot);
    }
    if (item >= total) break;
    const int j = (int)(item % a.kvh);
    const int64_t t_begin = (ntiles - 1 - item / a.kvh) * tile_tokens;
    for_each_prefill_segment(a, t_begin, tile_tokens, [&](int r, int64_t t, int64_t end) {
      wg_segment<T, D, F8>(a, smem, pipe, j, r, t, end);
    });
  }
  if (wg == 1) named_bar_sync(1, 2 * C::WG);  // takes warpgroup 2's last arrival (or the first one)
  if (threadIdx.x == 0) {  // this block takes no more items; the last one resets the counters
    __threadfence();
    if (atomicAdd(sched + 1, 1) == (int)gridDim.x - 1) {
      sched[0] = 0;
      sched[1] = 0;
    }
  }
#else
  pdl_wait();
#endif
}

}  // namespace
}  // namespace fdl
