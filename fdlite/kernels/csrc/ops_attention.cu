// Paged attention over a flat varlen batch that mixes decodes and prefills (prefix-cached or
// chunked prefills read their earlier blocks like any other context), reading FastDeploy's cache
// layout [num_blocks + 1, kv_heads, block_size, head_dim] through per-row block tables.
//
// Why hand-written: Paddle's fused attention kernels are not in PyPI's paddlepaddle-gpu for sm_90
// (no Paddle kernel runs there; see ops_common.cuh), and the CPU reference (fdlite/layers/attention.py)
// gathers whole contexts. Design after vLLM's paged attention v2 (split-KV + reduction for decode)
// and FlashAttention's online softmax for the query tiles; no code copied.
//
// Inputs (all contiguous, on the GPU):
//   q [T, h, d]; k_cache / v_cache as above; block_tables [B, max_blocks] int32;
//   seq_lens_kv [B] int32: KV length of each row after this step's tokens were written;
//   cu_seqlens_q [B + 1] int32: row r's query tokens are [cu[r], cu[r + 1]).
// Token i of row r sits at position seq_lens_kv[r] - q_len_r + i and attends to positions <= its
// own; query head k reads KV head k / (h / kvh). Output [T, h * d] in q's dtype. Tokens outside
// every row, and rows with nothing to attend to (seq_lens_kv 0), get zeros and read no cache.
//
// Two kernels, both always launched with grids that depend only on shapes and attributes (so a
// captured graph replays for any batch content):
//  - per-token ("decode") kernel, grid (B x qpr, kvh, splits): tokens of rows with q_len <= 4, qpr
//    (the caller's bound on q_len) token slots per row; the padding tokens past the rows get zeros from these
//    blocks too. A step that launches the tile kernel (prefill rows) takes a compact grid instead, (B + room,
//    kvh, 1): one-token rows only (the tile kernel takes rows of 2+), the leading ones (decodes come first) split
//    by a count the blocks derive from how many there are (`decode_item`), so a graph padded to max_num_seqs rows
//    splits its few real decode rows as an eager step would; and a block per row, not per token (one block per
//    token, each finding its row and exiting, had cost the op 80 us of a Llama-3.1-8B layer's 8k-token step).
//    One block holds the h / kvh query heads of one KV head, so each K/V byte is read once per KV head; long
//    contexts are split across blocks, and the last block of each (token, KV head) to finish merges the splits
//    (a self-resetting counter: no second kernel to launch and wait for). bf16 / fp16 at head_dim 64 / 128 (over
//    model-dtype or FP8 caches) compute on tensor cores (attention_decode_mma.cuh), fp32 and head_dim 256 on CUDA
//    cores (attn_decode_kernel below).
//  - tile ("prefill") kernel, grid (ceil(T / tile_tokens), kvh): each block takes a fixed slice of
//    the flat token axis and works through the row segments inside it (rows with q_len > 4): query
//    rows (token x head) against chunks of keys, so K/V are read once per tile, not per token. bf16 /
//    fp16 at head_dim 64 / 128 use tensor cores: on Hopper wgmma (attention_wgmma.cuh: persistent,
//    warp-specialized blocks taking tiles from a queue), else mma.sync (attention_mma.cuh); 128 rows per tile,
//    and a row's result does not depend on the rest of the batch.
//    fp32 and head_dim 256 the CUDA-core kernel below (64 rows against 32-key chunks).
// Both stream K/V chunks through shared memory with cp.async double buffering and keep the online
// softmax in float32 (scores in log2 units, exp2).
// FP8 caches (fdl_paged_attention_fp8: uint8 e4m3 bits, a float32 scale per cache row): the per-token kernels
// multiply each key's score by its K scale and each probability by its V scale; the tile kernels stage e4m3
// chunks and widen value x scale into their model-dtype tiles (attention_wgmma.cuh, attention_mma.cuh).
#include <math_constants.h>

#include <mutex>
#include <type_traits>

#include "ops_common.cuh"

namespace fdl {
namespace {

constexpr int kDecodeMaxQ = 4;  // rows with q_len <= this take the per-token kernel
constexpr int KC = 32;          // keys per chunk
constexpr int NT = 128;         // threads per block
constexpr int MAXG = 16;        // query heads per KV head supported by the per-token kernel
constexpr int BM = 64;          // query rows (token x head) per tile in the tile kernel

struct Args {
  const void* q;
  const void* kc;
  const void* vc;
  const int* block_tables;
  const int* seq_lens;
  const int* cu;
  void* out;
  float* part_o;   // [splits, prows, h, d] (compact: [prows, h, d])
  float2* part_ml; // [splits, prows, h] (compact: [prows, h]): running max (log2 units) and sum
  int* counters;   // [prows * kvh] finished splits per (partial row, KV head); zero between calls
  int64_t T;
  int B, max_blocks, h, kvh, g, bs;
  int splits;  // the per-token grid's z (compact: split_cap, for the workspace's size test)
  // Decode-only steps (not compact): a row of limit keys takes min(splits, max(splits_min, ceil(limit / split_keys)))
  // splits, so long rows are cut finer than short ones and do not form the step's tail; split_keys 0: `splits` each
  int split_keys, splits_min;
  int qpr;     // token slots per row in the per-token kernels' grid (1..kDecodeMaxQ)
  int dslots;  // blocks along x of that grid: B qpr (compact: B + room for splits), at least 1
  int qmax;    // rows with q_len <= qmax are the per-token kernels' (kDecodeMaxQ; compact: 1), others the tiles'
  // Compact grid (steps that launch the tile kernel, whose graphs pad rows to max_num_seqs: the decode rows' count
  // is known only on the device): block x maps to a split of the step's leading one-token rows (`decode_item`),
  // their split count chosen from that count, at most split_cap (forced: exactly split_cap), aiming at split_target
  // blocks.
  bool compact, forced;
  int split_cap, split_target;
  // Rows of the split partials and counters: min(T, dslots), indexed by the token or, when fewer, by the slot (a step
  // with prefill rows: its few decode tokens must not size the workspace by its T); compact: dslots, by the block
  int prows;
  float scale_log2;
  const float* ksc;  // FP8 caches: float32 scale per cache row of K and of V (nullptr: model-dtype caches)
  const float* vsc;
};

// Largest r in [0, B) with cu[r] <= t (the row holding token t, given cu[0] <= t < cu[B]).
__device__ __forceinline__ int find_row(const int* cu, int B, int64_t t) {
  int lo = 0, hi = B - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}


template <typename T, int D>
struct Layout {
  static constexpr int VE = 16 / sizeof(T);  // elements per 16-byte vector
  static constexpr int VPR = D / VE;         // vectors per key row
  static constexpr int ROW = D + VE;         // padded smem row (elements): spreads rows over banks
  static constexpr int KV_ELEMS = 2 * KC * ROW;  // one buffer of K (or V)
};

// Cache rows of the keys this thread copies for the chunk starting at k0 (-1: past k_end). Split
// from the copy itself so the block-table reads for chunk c + 2 are in flight while chunk c is
// computed (otherwise every chunk waits for a dependent block-table load before its copies).
template <typename T, int D>
struct ChunkRows {
  static constexpr int N = KC * Layout<T, D>::VPR / NT;  // 16-byte copies per thread per chunk
  static_assert(KC * Layout<T, D>::VPR % NT == 0, "chunk must split evenly over the block");
  int row[N];  // cache row index (fits 32 bits: ~2e9 rows of head_dim)
  int srow;    // FP8 caches: the cache row of key k0 + threadIdx.x (threads < KC), whose scales this thread copies

  __device__ __forceinline__ void compute(const int* btab, int kvh, int j, int bs, int k0, int k_end) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const int kk = k0 + (int)(threadIdx.x + n * NT) / Layout<T, D>::VPR;
      row[n] = kk < k_end ? cache_row(btab, kvh, j, bs, kk) : -1;
    }
    if constexpr (std::is_same<T, uint8_t>::value) {
      const int kk = k0 + (int)threadIdx.x;
      srow = threadIdx.x < KC && kk < k_end ? cache_row(btab, kvh, j, bs, kk) : -1;
    }
  }

  // FP8 caches: the chunk's K and V scales into ks_s / vs_s [KC] (zeros past the end); committed with `issue`.
  __device__ __forceinline__ void issue_scales(float* ks_s, float* vs_s, const float* ksc, const float* vsc) const {
    if (threadIdx.x < KC) {
      const bool valid = srow >= 0;
      cp_async4(ks_s + threadIdx.x, valid ? ksc + srow : ksc, valid);
      cp_async4(vs_s + threadIdx.x, valid ? vsc + srow : vsc, valid);
    }
  }

  // Keys [k0, k0 + KC) into smem K / V buffers; rows past the end are zero-filled (read nothing).
  __device__ __forceinline__ void issue(T* ks, T* vs, const T* kc, const T* vc) const {
    using L = Layout<T, D>;
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const int i = threadIdx.x + n * NT;
      const int kr = i / L::VPR, c = i - kr * L::VPR;
      const bool valid = row[n] >= 0;
      const T* sk = valid ? kc + (int64_t)row[n] * D + c * L::VE : kc;
      const T* sv = valid ? vc + (int64_t)row[n] * D + c * L::VE : vc;
      cp_async16(ks + kr * L::ROW + c * L::VE, sk, valid);
      cp_async16(vs + kr * L::ROW + c * L::VE, sv, valid);
    }
    cp_async_commit();
  }
};

// ChunkRows when the cache's block size is a multiple of KC (the default 64): a chunk (its first key a multiple of KC)
// then lies in one cache block, so compute() only loads that block's table entry and issue() forms the copies' rows
// from it, and the load's latency hides behind the chunk computed between the two calls. ChunkRows forms every row
// at once: Nsight Compute on the tensor-core decode kernel of the time (rows of 100-2,048 keys, batch 256) found about a
// tenth of its stall samples on the multiply right after that load. Used by the CUDA-core kernel; the tensor-core one
// now copies per warp (WarpCopies, attention_decode_mma.cuh).
template <typename T, int D>
struct ChunkBlock {
  static constexpr int N = ChunkRows<T, D>::N;
  int blk;     // the chunk's cache block (its block-table entry; 0 when nk <= 0)
  int pre;     // j bs + key k0's place in its block: a key's cache row is blk stride + pre + its index in the chunk
  int stride;  // kvh bs
  int nk;      // keys of the chunk before k_end

  __device__ __forceinline__ void compute(const int* btab, int kvh, int j, int bs, int k0, int k_end) {
    nk = k_end - k0;
    blk = nk > 0 ? btab[k0 / bs] : 0;
    pre = j * bs + k0 % bs;
    stride = kvh * bs;
  }

  // FP8 caches: the chunk's K and V scales into ks_s / vs_s [KC] (zeros past the end); committed with `issue`.
  __device__ __forceinline__ void issue_scales(float* ks_s, float* vs_s, const float* ksc, const float* vsc) const {
    if (threadIdx.x < KC) {
      const bool valid = (int)threadIdx.x < nk;
      const int64_t row = (int64_t)blk * stride + pre + threadIdx.x;
      cp_async4(ks_s + threadIdx.x, valid ? ksc + row : ksc, valid);
      cp_async4(vs_s + threadIdx.x, valid ? vsc + row : vsc, valid);
    }
  }

  // Keys [k0, k0 + KC) into smem K / V buffers; rows past the end are zero-filled (read nothing).
  __device__ __forceinline__ void issue(T* ks, T* vs, const T* kc, const T* vc) const {
    using L = Layout<T, D>;
    const int64_t base = (int64_t)blk * stride + pre;
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const int i = threadIdx.x + n * NT;
      const int kr = i / L::VPR, c = i - kr * L::VPR;
      const bool valid = kr < nk;
      const T* sk = valid ? kc + (base + kr) * D + c * L::VE : kc;
      const T* sv = valid ? vc + (base + kr) * D + c * L::VE : vc;
      cp_async16(ks + kr * L::ROW + c * L::VE, sk, valid);
      cp_async16(vs + kr * L::ROW + c * L::VE, sv, valid);
    }
    cp_async_commit();
  }
};

// A per-token block's work: token t of row r, the keys [k0, k1) of its causal range, split s of its n; its split
// partials sit at rows p0 + i pstep of the partial arrays (Args::prows rows), its merge counter at p0 kvh + j.
struct DecodeItem {
  int t, r, k0, k1, s, n;
  int64_t p0, pstep;
};

// Where token t's split partials and merge counter sit (Args::prows): its slot in the grid (blockIdx.x) when the step
// has fewer slots than tokens, else t.
__device__ __forceinline__ int64_t partial_row(const Args& a, int t) { return a.prows < a.T ? blockIdx.x : t; }

// Keys [k0, k1) of split s of n of a token that may see `limit` keys: runs of whole chunks.
__device__ __forceinline__ void split_keys(int limit, int s, int n, int& k0, int& k1) {
  int per = (limit + n - 1) / n;
  per = (per + KC - 1) / KC * KC;
  k0 = min(limit, s * per);
  k1 = min(limit, k0 + per);
}

// What block x of the per-token kernels' grid does in split s: token t, the (x % qpr)-th of row r = x / qpr when r is
// a decode row (q_len <= kDecodeMaxQ) that has such a token, its causal range cut into runs of whole chunks, `splits`
// of them or, with split_keys, as many as its length asks (Args::split_keys). False: no such token (a slot past the
// row's tokens, or a prefill row's slot: the tile kernel owns its tokens), or no split s for it.
__device__ __forceinline__ bool decode_split(const Args& a, int x, int s, DecodeItem& w) {
  w.r = x / a.qpr;
  const int i = x - w.r * a.qpr;
  if (w.r >= a.B) return false;
  const int q0 = a.cu[w.r], q_len = a.cu[w.r + 1] - q0;
  if (q_len > kDecodeMaxQ || i >= q_len) return false;
  w.t = q0 + i;
  const int kv_len = a.seq_lens[w.r];
  const int limit = max(0, min(kv_len, kv_len - q_len + i + 1));
  int n = a.splits;
  if (a.split_keys > 0) n = min(n, max(a.splits_min, (limit + a.split_keys - 1) / a.split_keys));
  if (s >= n) return false;
  split_keys(limit, s, n, w.k0, w.k1);
  w.s = s;
  w.n = n;
  w.p0 = partial_row(a, w.t);
  w.pstep = a.prows;
  return true;
}

// The number of leading rows of one token each (the runner puts decode rows first): rows r < n have cu[r + 1] = r + 1.
// Block-wide (every thread calls it, uniformly).
__device__ int leading_decodes(const Args& a) {
  __shared__ int first;  // the first i in [1, B] with cu[i] != i, B + 1 if none
  if (threadIdx.x == 0) first = a.B + 1;
  __syncthreads();
  for (int base = 1; base <= a.B; base += 4 * NT) {
    int mine = a.B + 1;
#pragma unroll
    for (int u = 0; u < 4; ++u) {  // four loads in flight per thread
      const int i = base + threadIdx.x + u * NT;
      if (i <= a.B && a.cu[i] != i) mine = min(mine, i);
    }
    if (mine <= a.B) atomicMin(&first, mine);
    __syncthreads();
    const bool found = first <= a.B;
    __syncthreads();  // every thread has read `first` before the next round may lower it
    if (found) break;
  }
  return first - 1;
}

// Compact grid (Args::compact): the step's nf leading one-token rows get S splits each, S from nf (forced: split_cap),
// and at most 1 + (dslots - B) / nf so that every row still has a block: blocks x < nf S take split x % S of row
// x / S; block nf S + i takes row nf + i unsplit when that row has one token (a later one-token row: a layout the
// runner does not make, kept correct). Rows of 2+ tokens are the tile kernel's (qmax = 1). False: nothing here.
__device__ __forceinline__ bool decode_item(const Args& a, int x, DecodeItem& w) {
  const int nf = leading_decodes(a);
  int S = 1;
  if (nf > 0) {
    const int work = nf * a.kvh;
    S = a.forced ? a.split_cap : work >= a.split_target ? 1 : min(a.split_cap, (a.split_target + work - 1) / work);
    S = max(1, min(S, 1 + (a.dslots - a.B) / nf));
  }
  if (x < nf * S) {
    const int d = x / S;
    w.t = w.r = d;  // leading rows: row d is token d
    w.s = x - d * S;
    w.n = S;
    w.p0 = (int64_t)d * S;
  } else {
    w.r = nf + (x - nf * S);
    if (w.r >= a.B || a.cu[w.r + 1] - a.cu[w.r] != 1) return false;
    w.t = a.cu[w.r];
    w.s = 0;
    w.n = 1;
    w.p0 = x;
  }
  w.pstep = 1;
  split_keys(a.seq_lens[w.r], w.s, w.n, w.k0, w.k1);  // one token: every key of its row
  return true;
}

// Tokens past the batch's rows (cu[B] <= t < T: the padding of a captured size) belong to no row: their outputs are
// zeros, written by the per-token kernels' split-0 blocks, block x taking every dslots-th such token.
template <typename T, int D>
__device__ __forceinline__ void decode_zero_tail(const Args& a, int x, int j) {
  const int T_ = (int)a.T, gd2 = a.g * D / 2;
#pragma unroll 1
  for (int t = a.cu[a.B] + x; t < T_; t += a.dslots) {
    uint32_t* o = reinterpret_cast<uint32_t*>(static_cast<T*>(a.out) + ((int64_t)t * a.h + (int64_t)j * a.g) * D);
#pragma unroll 1
    for (int i = threadIdx.x; i < gd2; i += NT) o[i] = 0u;
  }
}

// The start of a per-token block (x = blockIdx.x, j = blockIdx.y, s = blockIdx.z): split 0 writes its share of the
// padding tokens' zeros, then `decode_split` (or, compact, `decode_item`) says which token and keys the block reads
// (false: none, return).
template <typename T, int D>
__device__ __forceinline__ bool decode_block_start(const Args& a, DecodeItem& w) {
  if (blockIdx.z == 0) decode_zero_tail<T, D>(a, blockIdx.x, blockIdx.y);
  return a.compact ? decode_item(a, blockIdx.x, w) : decode_split(a, blockIdx.x, blockIdx.z, w);
}

// Split w.s's partial of token w.t for query head `head`, columns 2 dp and 2 dp + 1: O unnormalized, and with the
// first pair the row's (max in log2 units, sum), for decode_merge_splits.
template <int D>
__device__ __forceinline__ void decode_write_partial(const Args& a, const DecodeItem& w, int64_t head, int dp, float o0,
                                                     float o1, float m, float l) {
  const int64_t base = (w.p0 + w.s * w.pstep) * a.h + head;
  *reinterpret_cast<float2*>(a.part_o + base * D + dp * 2) = make_float2(o0, o1);
  if (dp == 0) a.part_ml[base] = make_float2(m, l);
}

// The last block of (w.t, j) to get here merges the w.n splits (partials at rows w.p0 + i w.pstep) of the per-token
// kernels (attn_decode_kernel, attn_decode_mma_kernel), once each block has written its split's partial (o_s
// unnormalized, m_s in log2 units, l_s): out = sum_s o_s 2^(m_s - M) / sum_s l_s 2^(m_s - M). It also resets the
// counter for the next call. scratch: at least (MAXG x 64 + MAXG) floats of shared memory the block no longer needs
// (its K / V buffers).
template <typename T, int D>
__device__ void decode_merge_splits(const Args& a, const DecodeItem& w, int j, float* scratch) {
  constexpr int NI = (MAXG * D / 2 + NT - 1) / NT;  // (head, dim pair) items per thread, at most
  const int g = a.g, items = g * D / 2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ns = w.n;
  float* w_s = scratch;                 // [g][ns] weights
  float* al_s = scratch + MAXG * 64;    // [g] 1 / sum
  __shared__ int is_last;
  __threadfence();  // this block's partials are visible before the count says so
  __syncthreads();
  if (threadIdx.x == 0) {
    int* c = a.counters + w.p0 * a.kvh + j;
    is_last = atomicAdd(c, 1) == ns - 1;
    if (is_last) *c = 0;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int hh = warp; hh < g; hh += NT / 32) {
    const int64_t head = (int64_t)j * g + hh;
    float m[2], l[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int sp = lane + 32 * u;
      const float2 ml =
          sp < ns ? __ldcg(a.part_ml + (w.p0 + sp * w.pstep) * a.h + head) : make_float2(-CUDART_INF_F, 0.f);
      m[u] = ml.x;
      l[u] = ml.y;
    }
    const float M = warp_max(fmaxf(m[0], m[1]));
    float L = 0.f;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int sp = lane + 32 * u;
      const float wt = M == -CUDART_INF_F ? 0.f : exp2f(m[u] - M);  // 0 for empty splits (m = -inf)
      if (sp < ns) w_s[hh * ns + sp] = wt;
      L += l[u] * wt;
    }
    L = warp_sum(L);
    if (lane == 0) al_s[hh] = L > 0.f ? 1.f / L : 0.f;
  }
  __syncthreads();
#pragma unroll
  for (int n = 0; n < NI; ++n) {
    const int it = threadIdx.x + n * NT;
    if (it < items) {
      const int hh = it / (D / 2), dp = it - hh * (D / 2);
      const int64_t head = (int64_t)j * g + hh;
      float o0 = 0.f, o1 = 0.f;
      for (int sp = 0; sp < ns; ++sp) {
        const float2 v =
            __ldcg(reinterpret_cast<const float2*>(a.part_o + ((w.p0 + sp * w.pstep) * a.h + head) * D) + dp);
        const float wt = w_s[hh * ns + sp];
        o0 += v.x * wt;
        o1 += v.y * wt;
      }
      const float inv = al_s[hh];
      T* o = static_cast<T*>(a.out) + ((int64_t)w.t * a.h + head) * D + dp * 2;
      o[0] = from_f<T>(o0 * inv);
      o[1] = from_f<T>(o1 * inv);
    }
  }
}

// ------------------------------------------------------------------ per-token kernel
// Per-token kernel smem: q [g][d] f32 | scores [g][KC] f32 | max, sum, rescale [g] f32 | K | V.
template <int D>
__host__ __device__ inline size_t decode_kv_offset(int g) {
  return ((size_t)g * D * 4 + (size_t)g * KC * 4 + 3 * (size_t)g * 4 + 15) / 16 * 16;
}

// C: the cache's element type (T, or uint8_t e4m3 bits with per-row scales: 4 * KC floats after K / V).
template <typename C, int D>
size_t decode_smem(int g) {
  using L = Layout<C, D>;
  constexpr bool f8 = std::is_same<C, uint8_t>::value;
  return decode_kv_offset<D>(g) + 2 * (size_t)L::KV_ELEMS * sizeof(C) + (f8 ? 4 * KC * sizeof(float) : 0);
}

// 6 blocks per SM (80 registers) at head_dim <= 128: what shared memory allows for bf16 / fp16 there, and what the
// split rule measured (choose_splits); left to itself ptxas took 96 registers here and lost a sixth of the slots.
// CB: the cache's block size is a multiple of KC, so each chunk's rows come from one block-table entry (ChunkBlock).
template <typename T, typename C, int D, bool CB>
__global__ void __launch_bounds__(NT, D <= 128 ? 6 : 1) attn_decode_kernel(Args a) {
  pdl_trigger();
  pdl_wait();
  using L = Layout<C, D>;
  constexpr bool F8 = std::is_same<C, uint8_t>::value;
  constexpr int NI = (MAXG * D / 2 + NT - 1) / NT;  // (head, dim pair) items per thread, at most
  const int j = blockIdx.y, g = a.g;
  DecodeItem job;
  if (!decode_block_start<T, D>(a, job)) return;  // no decode token in this slot
  const int t = job.t, r = job.r, k0 = job.k0, k1 = job.k1;

  extern __shared__ float4 smem4[];
  float* qs = reinterpret_cast<float*>(smem4);
  float* S = qs + g * D;
  float* m_s = S + g * KC;
  float* l_s = m_s + g;
  float* al_s = l_s + g;
  C* kbuf = reinterpret_cast<C*>(reinterpret_cast<char*>(smem4) + decode_kv_offset<D>(g));
  C* vbuf = kbuf + L::KV_ELEMS;
  float* sc_s = reinterpret_cast<float*>(vbuf + L::KV_ELEMS);  // F8: [2 buffers][K, V][KC] scales

  const T* q = static_cast<const T*>(a.q) + (t * a.h + (int64_t)j * g) * D;
  for (int i = threadIdx.x; i < g * D; i += NT) qs[i] = to_f<T>(q[i]) * a.scale_log2;
  for (int i = threadIdx.x; i < g; i += NT) {
    m_s[i] = -CUDART_INF_F;
    l_s[i] = 0.f;
  }
  const int* btab = a.block_tables + (int64_t)r * a.max_blocks;
  const C* kc = static_cast<const C*>(a.kc);
  const C* vc = static_cast<const C*>(a.vc);
  const int nchunks = k1 > k0 ? (k1 - k0 + KC - 1) / KC : 0;
  typename std::conditional<CB, ChunkBlock<C, D>, ChunkRows<C, D>>::type rows;  // addresses of the next chunk to issue
  if (nchunks > 0) {
    rows.compute(btab, a.kvh, j, a.bs, k0, k1);
    if constexpr (F8) rows.issue_scales(sc_s, sc_s + KC, a.ksc, a.vsc);
    rows.issue(kbuf, vbuf, kc, vc);
    if (nchunks > 1) rows.compute(btab, a.kvh, j, a.bs, k0 + KC, k1);
  }

  float acc[NI][2];
#pragma unroll
  for (int n = 0; n < NI; ++n) acc[n][0] = acc[n][1] = 0.f;
  const int P = g * KC;
  const int tpp = P >= NT ? 1 : (P * 2 == NT ? 2 : (P * 4 == NT ? 4 : 1));  // threads per (head, key) dot
  const int sub = threadIdx.x % tpp;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int items = g * D / 2;

  for (int c = 0; c < nchunks; ++c) {
    cp_async_wait_all();
    __syncthreads();  // chunk c landed; every thread is done with chunk c - 1
    const int kb = k0 + c * KC;
    if (c + 1 < nchunks) {
      if constexpr (F8) rows.issue_scales(sc_s + ((c + 1) & 1) * 2 * KC, sc_s + ((c + 1) & 1) * 2 * KC + KC, a.ksc, a.vsc);
      rows.issue(kbuf + ((c + 1) & 1) * KC * L::ROW, vbuf + ((c + 1) & 1) * KC * L::ROW, kc, vc);
      if (c + 2 < nchunks) rows.compute(btab, a.kvh, j, a.bs, kb + 2 * KC, k1);
    }
    const C* ks = kbuf + (c & 1) * KC * L::ROW;
    const C* vs = vbuf + (c & 1) * KC * L::ROW;
    const float* kscale = sc_s + (c & 1) * 2 * KC;  // F8 only
    const float* vscale = kscale + KC;
    // scores S[head][key] (log2 units)
    for (int pr = threadIdx.x / tpp; pr < P; pr += NT / tpp) {
      const int hh = pr / KC, key = pr - hh * KC;
      const float* qv = qs + hh * D;
      const C* kr = ks + key * L::ROW;
      float dot = 0.f;
      for (int v = sub; v < L::VPR; v += tpp) {
        const Vec<C, L::VE> kv = *reinterpret_cast<const Vec<C, L::VE>*>(kr + v * L::VE);
#pragma unroll
        for (int e = 0; e < L::VE; e += 2) {
          const float2 k2 = cache_pair_to_f2<C>(kv.v + e);
          dot += qv[v * L::VE + e] * k2.x;
          dot += qv[v * L::VE + e + 1] * k2.y;
        }
      }
      for (int o = 1; o < tpp; o <<= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if constexpr (F8) dot *= kscale[key];  // a key's scale multiplies its whole score
      if (sub == 0) S[pr] = kb + key < k1 ? dot : -CUDART_INF_F;
    }
    __syncthreads();
    // online softmax, one warp per head (KC == 32: one key per lane)
    for (int hh = warp; hh < g; hh += NT / 32) {
      const float sv = S[hh * KC + lane];
      const float m_old = m_s[hh];
      const float m_new = fmaxf(m_old, warp_max(sv));
      const float p = m_new == -CUDART_INF_F ? 0.f : exp2f(sv - m_new);
      const float sum = warp_sum(p);
      if constexpr (F8) S[hh * KC + lane] = p * vscale[lane];  // V's scale folded into its probability
      else S[hh * KC + lane] = p;
      if (lane == 0) {
        const float al = m_new == -CUDART_INF_F ? 1.f : exp2f(m_old - m_new);
        al_s[hh] = al;
        l_s[hh] = l_s[hh] * al + sum;
        m_s[hh] = m_new;
      }
    }
    __syncthreads();
    // acc = acc * alpha + P V
#pragma unroll
    for (int n = 0; n < NI; ++n) {
      const int it = threadIdx.x + n * NT;
      if (it < items) {
        const int hh = it / (D / 2), dp = it - hh * (D / 2);
        const float al = al_s[hh];
        float a0 = acc[n][0] * al, a1 = acc[n][1] * al;
        const float* pr = S + hh * KC;
#pragma unroll 8
        for (int k = 0; k < KC; ++k) {
          const float2 v2 = cache_pair_to_f2<C>(vs + k * L::ROW + dp * 2);
          const float p = pr[k];
          a0 += p * v2.x;
          a1 += p * v2.y;
        }
        acc[n][0] = a0;
        acc[n][1] = a1;
      }
    }
  }
  __syncthreads();  // m_s / l_s final (nchunks may be 0)
#pragma unroll
  for (int n = 0; n < NI; ++n) {
    const int it = threadIdx.x + n * NT;
    if (it < items) {
      const int hh = it / (D / 2), dp = it - hh * (D / 2);
      const int64_t head = (int64_t)j * g + hh;
      if (job.n == 1) {
        const float l = l_s[hh];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        T* o = static_cast<T*>(a.out) + (t * a.h + head) * D + dp * 2;
        o[0] = from_f<T>(acc[n][0] * inv);
        o[1] = from_f<T>(acc[n][1] * inv);
      } else {
        decode_write_partial<D>(a, job, head, dp, acc[n][0], acc[n][1], m_s[hh], l_s[hh]);
      }
    }
  }
  if (job.n == 1) return;
  decode_merge_splits<T, D>(a, job, j, reinterpret_cast<float*>(kbuf));
}

// ------------------------------------------------------------------ tile kernel
template <typename T, int D>
struct TileLayout {
  static constexpr int QROW = D + 4;   // float row of the Q tile
  static constexpr int PROW = KC + 4;  // float row of the probability tile
  static constexpr size_t kv_offset = ((size_t)BM * QROW * 4 + (size_t)BM * PROW * 4 + 15) / 16 * 16;
  static constexpr size_t bytes = kv_offset + 2 * (size_t)Layout<T, D>::KV_ELEMS * sizeof(T);
};

// Thread (rg, kg): query rows rg*4 .. rg*4+3 of the tile; keys kg + 8 kk of each chunk (scores);
// output dims kg*4 + 32 jj + e (P V). rg = warp * 4 + lane / 8, kg = lane % 8.
template <typename T, int D>
__device__ void tile_segment(const Args& a, float* smem, int r, int64_t ts, int64_t te) {
  using L = Layout<T, D>;
  using TL = TileLayout<T, D>;
  constexpr int DJ = D / 32;  // 4-dim groups per thread
  const int j = blockIdx.y, g = a.g;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rg = warp * 4 + (lane >> 3), kg = lane & 7;
  const int row_start = a.cu[r], q_len = a.cu[r + 1] - row_start, kv_len = a.seq_lens[r];
  const int ntok = (int)(te - ts), M = ntok * g;
  const int pos0 = kv_len - q_len + (int)(ts - row_start);  // position of the segment's first token
  const int kv_end = max(0, min(kv_len, pos0 + ntok));

  float* Qs = smem;
  float* Ps = Qs + BM * TL::QROW;
  T* kbuf = reinterpret_cast<T*>(reinterpret_cast<char*>(smem) + TL::kv_offset);
  T* vbuf = kbuf + L::KV_ELEMS;

  __syncthreads();  // the previous segment is done with smem
  const T* q = static_cast<const T*>(a.q);
  for (int i = threadIdx.x; i < BM * D; i += NT) {
    const int m = i / D, dd = i - m * D;
    float v = 0.f;
    if (m < M) {
      const int tok = m / g, hh = m - tok * g;
      v = to_f<T>(q[((ts + tok) * a.h + (int64_t)j * g + hh) * D + dd]) * a.scale_log2;
    }
    Qs[m * TL::QROW + dd] = v;
  }
  int qpos[4];
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    const int m = rg * 4 + rr;
    qpos[rr] = m < M ? pos0 + m / g : -1;  // -1: padding row, sees nothing
  }
  float mx[4], lsum[4], acc[4][DJ * 4];
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    mx[rr] = -CUDART_INF_F;
    lsum[rr] = 0.f;
#pragma unroll
    for (int e = 0; e < DJ * 4; ++e) acc[rr][e] = 0.f;
  }
  const int* btab = a.block_tables + (int64_t)r * a.max_blocks;
  const T* kc = static_cast<const T*>(a.kc);
  const T* vc = static_cast<const T*>(a.vc);
  const int nchunks = (kv_end + KC - 1) / KC;
  ChunkRows<T, D> rows;
  if (nchunks > 0) {
    rows.compute(btab, a.kvh, j, a.bs, 0, kv_end);
    rows.issue(kbuf, vbuf, kc, vc);
    if (nchunks > 1) rows.compute(btab, a.kvh, j, a.bs, KC, kv_end);
  }

  for (int c = 0; c < nchunks; ++c) {
    cp_async_wait_all();
    __syncthreads();
    const int kb = c * KC;
    if (c + 1 < nchunks) {
      rows.issue(kbuf + ((c + 1) & 1) * KC * L::ROW, vbuf + ((c + 1) & 1) * KC * L::ROW, kc, vc);
      if (c + 2 < nchunks) rows.compute(btab, a.kvh, j, a.bs, kb + 2 * KC, kv_end);
    }
    const T* ks = kbuf + (c & 1) * KC * L::ROW;
    const T* vs = vbuf + (c & 1) * KC * L::ROW;
    float sc[4][4];
#pragma unroll
    for (int rr = 0; rr < 4; ++rr)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) sc[rr][kk] = 0.f;
#pragma unroll 4
    for (int dd = 0; dd < D; dd += 4) {
      float4 qv[4];
#pragma unroll
      for (int rr = 0; rr < 4; ++rr) qv[rr] = *reinterpret_cast<const float4*>(Qs + (rg * 4 + rr) * TL::QROW + dd);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const Vec<T, 4> kv4 = *reinterpret_cast<const Vec<T, 4>*>(ks + (kg + 8 * kk) * L::ROW + dd);
        const float k0 = to_f<T>(kv4.v[0]), k1 = to_f<T>(kv4.v[1]), k2 = to_f<T>(kv4.v[2]), k3 = to_f<T>(kv4.v[3]);
#pragma unroll
        for (int rr = 0; rr < 4; ++rr)
          sc[rr][kk] += qv[rr].x * k0 + qv[rr].y * k1 + qv[rr].z * k2 + qv[rr].w * k3;
      }
    }
    // mask, online softmax (the 8 lanes of a row group hold its 32 keys)
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
      float cm = -CUDART_INF_F;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const int key = kb + kg + 8 * kk;
        if (!(key < kv_end && key <= qpos[rr])) sc[rr][kk] = -CUDART_INF_F;
        cm = fmaxf(cm, sc[rr][kk]);
      }
      cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 1));
      cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 2));
      cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 4));
      const float m_new = fmaxf(mx[rr], cm);
      const float al = m_new == -CUDART_INF_F ? 1.f : exp2f(mx[rr] - m_new);
      mx[rr] = m_new;
      float ps = 0.f;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const float p = m_new == -CUDART_INF_F ? 0.f : exp2f(sc[rr][kk] - m_new);
        Ps[(rg * 4 + rr) * TL::PROW + kg + 8 * kk] = p;
        ps += p;
      }
      lsum[rr] = lsum[rr] * al + ps;
#pragma unroll
      for (int e = 0; e < DJ * 4; ++e) acc[rr][e] *= al;
    }
    __syncthreads();
#pragma unroll 2
    for (int k = 0; k < KC; ++k) {
      float p[4];
#pragma unroll
      for (int rr = 0; rr < 4; ++rr) p[rr] = Ps[(rg * 4 + rr) * TL::PROW + k];
#pragma unroll
      for (int jj = 0; jj < DJ; ++jj) {
        const Vec<T, 4> v4 = *reinterpret_cast<const Vec<T, 4>*>(vs + k * L::ROW + kg * 4 + 32 * jj);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float v = to_f<T>(v4.v[e]);
#pragma unroll
          for (int rr = 0; rr < 4; ++rr) acc[rr][jj * 4 + e] += p[rr] * v;
        }
      }
    }
  }
  // write: l summed over the row group's 8 lanes
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    float l = lsum[rr];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    l += __shfl_xor_sync(0xffffffffu, l, 4);
    const int m = rg * 4 + rr;
    if (m < M) {
      const int tok = m / g, hh = m - tok * g;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      T* o = static_cast<T*>(a.out) + ((ts + tok) * a.h + (int64_t)j * g + hh) * D;
#pragma unroll
      for (int jj = 0; jj < DJ; ++jj) {
        Vec<T, 4> w;
#pragma unroll
        for (int e = 0; e < 4; ++e) w.v[e] = from_f<T>(acc[rr][jj * 4 + e] * inv);
        *reinterpret_cast<Vec<T, 4>*>(o + kg * 4 + 32 * jj) = w;
      }
    }
  }
}

// A tile kernel block's work: the tokens [t_begin, t_begin + tile_tokens) of the flat axis (those in the batch),
// cut at row boundaries; segment(r, t, seg_end) is called for each piece of a prefill row (q_len > Args::qmax).
// Uniform across the block: every thread walks the same segments.
template <typename F>
__device__ __forceinline__ void for_each_prefill_segment(const Args& a, int64_t t_begin, int tile_tokens, F&& segment) {
  const int total = a.cu[a.B];
  const int64_t t_end = min((int64_t)total, min(a.T, t_begin + tile_tokens));
  int64_t t = t_begin;
  while (t < t_end) {
    const int r = find_row(a.cu, a.B, t);
    const int64_t seg_end = min(t_end, (int64_t)a.cu[r + 1]);
    if (a.cu[r + 1] - a.cu[r] > a.qmax) segment(r, t, seg_end);
    t = seg_end;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(NT) attn_tile_kernel(Args a, int tile_tokens) {
  pdl_trigger();
  pdl_wait();
  extern __shared__ float4 smem4[];
  for_each_prefill_segment(a, (int64_t)blockIdx.x * tile_tokens, tile_tokens, [&](int r, int64_t t, int64_t end) {
    tile_segment<T, D>(a, reinterpret_cast<float*>(smem4), r, t, end);
  });
}

}  // namespace
}  // namespace fdl

#include "attention_decode_mma.cuh"
#include "attention_mma.cuh"
#include "attention_wgmma.cuh"

namespace fdl {
namespace {

// Per-device split counters of the decode kernel: allocated and zeroed by the first call (eager: it
// allocates), kept zero by the kernel itself (each (token, KV head)'s last block resets its entry); two more
// after them for the wgmma tile kernel's work queue (next item, finished blocks; its last block resets them).
constexpr int64_t kMaxCounters = 1 << 16;
// The most KV splits the length rule gives a decode row (Args::split_keys): the grid's z; blocks past a row's count
// exit at once (each costs a slot for about a microsecond).
constexpr int64_t kMaxRowSplits = 4;

int* split_counters(cudaStream_t s) {
  static std::mutex mu;
  static int* per_device[16] = {};
  int dev = 0;
  FDL_CHECK_CUDA(cudaGetDevice(&dev), "fdl_paged_attention: cudaGetDevice");
  PD_CHECK(dev >= 0 && dev < 16, "fdl_paged_attention: device index out of range");
  std::lock_guard<std::mutex> lock(mu);
  if (per_device[dev] == nullptr) {
    require_eager(s, "fdl_paged_attention: the first call on a device must run eagerly (it allocates the split counters)");
    int* p = nullptr;
    FDL_CHECK_CUDA(cudaMalloc(&p, (kMaxCounters + 2) * sizeof(int)), "fdl_paged_attention: counters cudaMalloc");
    FDL_CHECK_CUDA(cudaMemsetAsync(p, 0, (kMaxCounters + 2) * sizeof(int), s), "fdl_paged_attention: counters cudaMemset");
    note_foreign_work();
    per_device[dev] = p;
  }
  return per_device[dev];
}

// Whether the tensor-core per-token kernel (attention_decode_mma.cuh) exists for these types: bf16 / fp16 at
// head_dim 64 / 128 over model-dtype or FP8 caches; it takes the decode tokens unless FDLITE_DECODE_MMA=0 (the
// CUDA-core kernel, for side-by-side runs).
template <typename T, typename C, int D>
constexpr bool kDecodeMmaBuilt = !std::is_same<T, float>::value &&
                                 (std::is_same<T, C>::value || std::is_same<C, uint8_t>::value) && (D == 64 || D == 128);

template <typename T, typename C, int D>
bool decode_on_mma() {
  return kDecodeMmaBuilt<T, C, D> && options().decode_mma;
}

// The tensor-core decode kernel's instance for g query heads a KV head (R: 8-row groups) and block size bs (a
// multiple of 8: a warp's 8 keys in one cache block), with its shared memory.
template <typename T, typename C, int D>
std::pair<void (*)(Args), size_t> decode_mma_instance(int g, int bs) {
  if constexpr (kDecodeMmaBuilt<T, C, D>) {
    allow_smem<attn_decode_mma_kernel<T, C, D, 1, true>>(DecodeMma<T, C, D, 1>::bytes);
    allow_smem<attn_decode_mma_kernel<T, C, D, 1, false>>(DecodeMma<T, C, D, 1>::bytes);
    allow_smem<attn_decode_mma_kernel<T, C, D, 2, true>>(DecodeMma<T, C, D, 2>::bytes);
    allow_smem<attn_decode_mma_kernel<T, C, D, 2, false>>(DecodeMma<T, C, D, 2>::bytes);
    const bool ab = bs % 8 == 0;
    if (g <= 8)
      return {ab ? attn_decode_mma_kernel<T, C, D, 1, true> : attn_decode_mma_kernel<T, C, D, 1, false>,
              DecodeMma<T, C, D, 1>::bytes};
    return {ab ? attn_decode_mma_kernel<T, C, D, 2, true> : attn_decode_mma_kernel<T, C, D, 2, false>,
            DecodeMma<T, C, D, 2>::bytes};
  }
  return {nullptr, 0};
}

// Blocks of the per-token kernel resident on one SM for this dtype, cache type, head_dim and g (cached).
template <typename T, typename C, int D>
int decode_blocks_per_sm(int g) {
  static int cache[2][MAXG + 1] = {};
  const bool on_mma = decode_on_mma<T, C, D>();
  int& v = cache[on_mma][g];
  if (v == 0) {
    int n = 0;
    if (on_mma) {
      const auto inst = decode_mma_instance<T, C, D>(g, 64);  // AB or not: the same launch bounds and shared memory
      FDL_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, inst.first, NT, inst.second),
                     "fdl_paged_attention: occupancy query");
    } else {
      allow_smem<attn_decode_kernel<T, C, D, true>>(decode_smem<C, D>(MAXG));
      FDL_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, attn_decode_kernel<T, C, D, true>, NT, decode_smem<C, D>(g)),
                     "fdl_paged_attention: occupancy query");
    }
    v = std::max(1, n);
  }
  return v;
}

// KV splits of the per-token kernel for `work` (token, KV head) pairs. Below 2 blocks per SM, splits fill
// the GPU. Above, the count whose rounds of resident blocks waste least: `slots` blocks run at once, so
// work x s blocks take ceil(work x s / slots) rounds of 1/s of the context each (1,024 pairs over 792 slots,
// batch 128 on the H100: 2 rounds unsplit, 4 rounds of a third with 3 splits: 11-23% faster), 20% added for
// the merge and the shorter streams (batch 256 at 512 tokens: 5 splits were 13% slower than none).
int choose_splits(int64_t work, int64_t by_ctx, int64_t slots) {
  const int64_t target = 2 * (int64_t)num_sms();
  if (work < target) return (int)std::min<int64_t>({ceil_div(target, std::max<int64_t>(work, 1)), by_ctx, 32});
  if (work <= slots) return 1;  // one round already (measured: splitting batch 64 costs 2-14%)
  int best = 1;
  double best_cost = (double)ceil_div(work, slots);
  for (int s = 2; s <= std::min<int64_t>(8, by_ctx) && work * s <= kMaxCounters; ++s) {
    const double cost = (double)ceil_div(work * s, slots) / s * 1.2;
    if (cost < best_cost) {
      best = s;
      best_cost = cost;
    }
  }
  return best;
}

// C: the caches' element type (T, or uint8_t for FP8 caches, which only bf16 / fp16 at head_dim 64 / 128 take:
// their prefill rows always go to the tensor-core kernel).
template <typename T, typename C, int D>
void launch_attention(Args a, bool tiles, cudaStream_t s) {
  if (a.T == 0) return;
  const size_t dsm = decode_smem<C, D>(a.g);
  // bf16 / fp16 at head_dim 64 / 128 take a tensor-core tile kernel: wgmma (attention_wgmma.cuh) where it can
  // run and FDLITE_ATTN_MMA=2 (the default), else mma.sync (attention_mma.cuh) unless FDLITE_ATTN_MMA=0 (the
  // CUDA-core kernel; FP8 caches take mma.sync then)
  constexpr bool f8 = std::is_same<C, uint8_t>::value;
  constexpr bool mma = !std::is_same<T, float>::value && (D == 64 || D == 128);
  static_assert(!f8 || mma, "FP8 caches: bf16 / fp16 at head_dim 64 / 128 only");
  constexpr int mma_d = D == 64 ? 64 : 128;
  const unsigned zsplits = a.compact ? 1u : (unsigned)a.splits;  // compact: a block's split comes from decode_item
  bool decode_done = false;
  if constexpr (kDecodeMmaBuilt<T, C, D>) {
    if (decode_on_mma<T, C, D>()) {
      const auto inst = decode_mma_instance<T, C, D>(a.g, a.bs);
      launch("attn_decode_mma_kernel", inst.first, dim3((unsigned)a.dslots, a.kvh, zsplits), NT, inst.second, s,
             pdl_rows(a.T), a);
      decode_done = true;
    }
  }
  if (!decode_done) {
    auto kernel = a.bs % KC == 0 ? attn_decode_kernel<T, C, D, true> : attn_decode_kernel<T, C, D, false>;
    allow_smem<attn_decode_kernel<T, C, D, true>>(decode_smem<C, D>(MAXG));
    allow_smem<attn_decode_kernel<T, C, D, false>>(decode_smem<C, D>(MAXG));
    launch("attn_decode_kernel", kernel, dim3((unsigned)a.dslots, a.kvh, zsplits), NT, dsm, s,
           pdl_rows(a.T), a);
  }
  if (!tiles) return;
  if constexpr (mma) {
    if (options().attn_mma >= 2 && wgmma_ready()) {
      using W = WgTile<mma_d, f8>;
      allow_smem<attn_wgmma_kernel<T, mma_d, f8>>(W::bytes);
      const int tile_tokens = W::BM / a.g;
      const int64_t items = ceil_div(a.T, tile_tokens) * a.kvh;  // persistent: one block per SM at most
      launch("attn_wgmma_kernel", attn_wgmma_kernel<T, mma_d, f8>, dim3((unsigned)std::min<int64_t>(items, num_sms())),
             W::NTH, W::bytes, s, false, a, tile_tokens, a.counters + kMaxCounters);
      FDL_CHECK_LAUNCH("fdl_paged_attention (wgmma tile kernel)");
      return;
    }
  }
  if constexpr (mma) {
    if (f8 || options().attn_mma) {
      allow_smem<attn_mma_kernel<T, mma_d, f8>>(MmaTile<mma_d, f8>::bytes);
      const int tile_tokens = MmaTile<mma_d, f8>::BM / a.g;
      launch("attn_mma_kernel", attn_mma_kernel<T, mma_d, f8>, dim3((unsigned)ceil_div(a.T, tile_tokens), a.kvh),
             MmaTile<mma_d, f8>::NTH, MmaTile<mma_d, f8>::bytes, s, false, a, tile_tokens);
      FDL_CHECK_LAUNCH("fdl_paged_attention (tensor-core tile kernel)");
      return;
    }
  }
  if constexpr (f8) return;  // (unreachable: FP8 always takes the tensor-core kernel)
  allow_smem<attn_tile_kernel<T, D>>(TileLayout<T, D>::bytes);
  const int tile_tokens = BM / a.g;
  launch("attn_tile_kernel", attn_tile_kernel<T, D>, dim3((unsigned)ceil_div(a.T, tile_tokens), a.kvh), NT,
         TileLayout<T, D>::bytes, s, false, a, tile_tokens);
  FDL_CHECK_LAUNCH("fdl_paged_attention (tile kernel)");
}

}  // namespace
}  // namespace fdl

using namespace fdl;

// fdl_paged_attention(q, k_cache, v_cache, block_tables, seq_lens_kv, cu_seqlens_q, scale, max_q_len,
//                     num_splits, graph_tokens, max_kv_len) -> out [T, h * d]
// max_q_len: an upper bound on any row's q_len known to the caller (1 for decode-only graphs: the
// tile kernel is then not launched); 0 = unknown. num_splits: KV splits of the per-token kernel,
// 0 = chosen from the shapes (graph_tokens, kv heads, max_kv_len) and the SMs' room (choose_splits).
// graph_tokens, max_kv_len: what the launch plan (tile kernel or not, the KV split count) is chosen for, in place of
// this call's T and block-table width (0: those): the padded token count of the CUDA graph the step runs in and the
// longest KV a row may have (max_model_len). An eager step passes those of the graph it would replay in, so that each
// row gets the same kernel and split count, hence the same bits, eager or replayed (its table is as wide as its
// longest row, its T unpadded, where a graph's are max_model_len and the captured size).
// fdl_paged_attention_fp8(q, k_cache, v_cache, k_scale, v_scale, ...): the same over FP8 caches (uint8 e4m3 bits
// and float32 scales [blocks, kv_heads, block_size]); bf16 / fp16 q, head_dim 64 / 128.
namespace {
std::vector<paddle::Tensor> attention_impl(const char* op, const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                           const paddle::Tensor& v_cache, const paddle::Tensor* k_scale,
                                           const paddle::Tensor* v_scale, const paddle::Tensor& block_tables,
                                           const paddle::Tensor& seq_lens, const paddle::Tensor& cu_seqlens,
                                           float scale, int max_q_len, int num_splits, int graph_tokens,
                                           int max_kv_len) {
  const bool f8 = k_scale != nullptr;
  for (const paddle::Tensor* t : std::initializer_list<const paddle::Tensor*>{&q, &k_cache, &v_cache, &block_tables, &seq_lens, &cu_seqlens}) check_gpu(*t, op, "input");
  const auto& cs = k_cache.shape();
  PD_CHECK(cs.size() == 4 && v_cache.shape() == cs, op, ": caches must be [blocks, kv_heads, block_size, head_dim]");
  PD_CHECK(q.shape().size() == 3, op, ": q must be [T, heads, head_dim]");
  const int64_t T = q.shape()[0];
  const int h = (int)q.shape()[1], d = (int)q.shape()[2], kvh = (int)cs[1], bs = (int)cs[2];
  PD_CHECK(cs[3] == d, op, ": head_dim of q and caches differ");
  PD_CHECK(kvh > 0 && h % kvh == 0, op, ": heads must be a multiple of kv_heads");
  const int g = h / kvh;
  PD_CHECK(g <= MAXG, op, ": at most 16 query heads per KV head");
  if (f8) {
    check_fp8_caches(op, k_cache, v_cache, *k_scale, *v_scale, d);
    PD_CHECK(q.dtype() != paddle::DataType::FLOAT32 && (d == 64 || d == 128), op,
             ": FP8 caches take bf16 / fp16 models at head_dim 64 or 128");
  } else {
    PD_CHECK(k_cache.dtype() == q.dtype() && v_cache.dtype() == q.dtype(), op, ": caches must have q's dtype");
  }
  PD_CHECK(block_tables.dtype() == paddle::DataType::INT32 && seq_lens.dtype() == paddle::DataType::INT32 &&
               cu_seqlens.dtype() == paddle::DataType::INT32,
           op, ": block_tables, seq_lens_kv and cu_seqlens_q must be int32");
  PD_CHECK(block_tables.shape().size() == 2, op, ": block_tables must be [B, max_blocks]");
  const int B = (int)block_tables.shape()[0], max_blocks = (int)block_tables.shape()[1];
  PD_CHECK(seq_lens.numel() == B && cu_seqlens.numel() == B + 1, op, ": seq_lens_kv [B] and cu_seqlens_q [B + 1]");

  PD_CHECK(max_kv_len >= 0 && (graph_tokens == 0 || graph_tokens >= T), op,
           ": graph_tokens must be 0 or a padded size (>= T), max_kv_len >= 0");
  const int64_t plan_T = graph_tokens > 0 ? graph_tokens : T;
  const bool tiles = (max_q_len <= 0 ? plan_T : max_q_len) > kDecodeMaxQ && B > 0;
  const int64_t kv_bound = max_kv_len > 0 ? max_kv_len : (int64_t)max_blocks * bs;
  const int64_t by_ctx = std::max<int64_t>(1, ceil_div(kv_bound, 2 * KC));  // splits of 2+ chunks
  // A step that launches the tile kernel takes the compact per-token grid (Args::compact): in a mixed step's graph the
  // rows are padded to max_num_seqs, so a grid sized by B would take the few real decode rows for B of them and give
  // them one split each (Qwen3-30B-A3B's prefill-heavy steps: 75 us a layer for 10 decode rows of 1-2k tokens).
  const bool compact = tiles;
  int qpr = 1, splits = 1, split_cap = 1, split_min = 1, split_len = 0;
  int64_t dslots, prows;
  if (compact) {
    split_cap = num_splits > 0 ? std::min(num_splits, 64) : (int)std::min<int64_t>(32, by_ctx);
    // blocks past B: room for the splits (forced: every row's). Automatic: nf rows of S = ceil(target / (nf kvh))
    // splits need nf (S - 1) < target / kvh more blocks, so the room never limits S, and a step with one prompt
    // does not launch 2 x SMs x kvh blocks that only exit (one 2k prompt's op: 51.7 vs 48.0 us with that room)
    int64_t room = num_splits > 0 ? (int64_t)B * (split_cap - 1) : ceil_div(2 * (int64_t)num_sms(), (int64_t)kvh);
    if ((B + room) * kvh > kMaxCounters) {
      split_cap = 1;
      room = 0;
    }
    dslots = std::max<int64_t>(1, B + room);
    prows = dslots;  // a split's partial sits at its block's row
    splits = split_cap;
  } else {
    // the per-token kernels' grid: qpr token slots per row (max_q_len when it bounds q_len within kDecodeMaxQ)
    qpr = max_q_len >= 1 && max_q_len <= kDecodeMaxQ ? max_q_len : kDecodeMaxQ;
    dslots = std::max<int64_t>(1, (int64_t)B * qpr);
    // at most this many decode tokens: the rows of the split partials (Args::prows), and what the split rule sizes
    // unless the graph's token count is given (in a graph T <= B qpr: a decode graph has one token a row, a mixed
    // one of <= 4 tokens 4 slots a row, so the graph itself sizes the same count)
    prows = std::min<int64_t>(T, dslots);
    const int64_t split_rows = graph_tokens > 0 ? graph_tokens : prows;
    splits = num_splits;
    if (splits <= 0) {
      int per_sm = 1;
      FDL_FLOAT_SWITCH(q.dtype(), T_, op, {
        if (f8) {
          if constexpr (!std::is_same<T_, float>::value) {
            per_sm = d == 64 ? decode_blocks_per_sm<T_, uint8_t, 64>(g) : decode_blocks_per_sm<T_, uint8_t, 128>(g);
          }
        } else {
          switch (d) {
            case 64: per_sm = decode_blocks_per_sm<T_, T_, 64>(g); break;
            case 128: per_sm = decode_blocks_per_sm<T_, T_, 128>(g); break;
            case 256: per_sm = decode_blocks_per_sm<T_, T_, 256>(g); break;
            default: PD_THROW(op, ": head_dim must be 64, 128 or 256");
          }
        }
      });
      splits = choose_splits(split_rows * kvh, by_ctx, (int64_t)per_sm * num_sms());
      // rows longer than split_keys keys take more splits, up to kMaxRowSplits: the grid's z room for them
      split_min = splits;
      // an FP8 cache's key is half the bytes: twice the keys make a split of the same bytes (measured on the H100:
      // the FP8 protocol 2% faster at 1,024 keys than at 512; the bf16 protocol flat from 256 to 2,048)
      split_len = options().decode_split_keys * (f8 ? 2 : 1);
      if (split_len > 0) {
        splits = (int)std::max<int64_t>(splits, std::min<int64_t>({kMaxRowSplits, ceil_div(kv_bound, split_len), by_ctx}));
      }
    }
    splits = std::max(1, std::min(splits, 64));
    if (splits > 1 && split_rows * kvh > kMaxCounters) splits = 1;  // split_rows >= prows: the counters' rows
  }
  paddle::Tensor out = paddle::empty({T, (int64_t)h * d}, q.dtype(), q.place());
  paddle::Tensor ws;
  Args a{};
  a.q = q.data();
  a.kc = k_cache.data();
  a.vc = v_cache.data();
  a.ksc = f8 ? static_cast<const float*>(k_scale->data()) : nullptr;
  a.vsc = f8 ? static_cast<const float*>(v_scale->data()) : nullptr;
  a.block_tables = block_tables.data<int>();
  a.seq_lens = seq_lens.data<int>();
  a.cu = cu_seqlens.data<int>();
  a.out = out.data();
  a.T = T;
  a.B = B;
  a.max_blocks = max_blocks;
  a.h = h;
  a.kvh = kvh;
  a.g = g;
  a.bs = bs;
  a.splits = splits;
  a.split_keys = split_len;
  a.splits_min = std::min(split_min, splits);
  a.qpr = qpr;
  a.dslots = (int)dslots;
  a.prows = (int)prows;
  a.qmax = compact ? 1 : kDecodeMaxQ;
  a.compact = compact;
  a.forced = num_splits > 0;
  a.split_cap = split_cap;
  a.split_target = 2 * num_sms();
  a.scale_log2 = scale * 1.4426950408889634f;
  a.counters = split_counters(stream_of(q));
  if (splits > 1 && T > 0) {
    // [rows, h, d] partial outputs, then [rows, h] (max, sum) pairs: rows splits x prows (compact: prows)
    const int64_t rows = compact ? prows : (int64_t)splits * prows;
    ws = paddle::empty({rows * h * (d + 2)}, paddle::DataType::FLOAT32, q.place());
    a.part_o = static_cast<float*>(ws.data());
    a.part_ml = reinterpret_cast<float2*>(a.part_o + rows * h * d);
  }
  cudaStream_t s = stream_of(q);
  FDL_FLOAT_SWITCH(q.dtype(), T_, op, {
    if (f8) {
      if constexpr (!std::is_same<T_, float>::value) {
        if (d == 64) launch_attention<T_, uint8_t, 64>(a, tiles, s);
        else launch_attention<T_, uint8_t, 128>(a, tiles, s);
      }
    } else {
      switch (d) {
        case 64: launch_attention<T_, T_, 64>(a, tiles, s); break;
        case 128: launch_attention<T_, T_, 128>(a, tiles, s); break;
        case 256: launch_attention<T_, T_, 256>(a, tiles, s); break;
        default: PD_THROW(op, ": head_dim must be 64, 128 or 256");
      }
    }
  });
  return {out};
}
}  // namespace

std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                           const paddle::Tensor& v_cache, const paddle::Tensor& block_tables,
                                           const paddle::Tensor& seq_lens, const paddle::Tensor& cu_seqlens,
                                           float scale, int max_q_len, int num_splits, int graph_tokens,
                                           int max_kv_len) {
  return attention_impl("fdl_paged_attention", q, k_cache, v_cache, nullptr, nullptr, block_tables, seq_lens,
                        cu_seqlens, scale, max_q_len, num_splits, graph_tokens, max_kv_len);
}

std::vector<paddle::Tensor> PagedAttentionFp8(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                              const paddle::Tensor& v_cache, const paddle::Tensor& k_scale,
                                              const paddle::Tensor& v_scale, const paddle::Tensor& block_tables,
                                              const paddle::Tensor& seq_lens, const paddle::Tensor& cu_seqlens,
                                              float scale, int max_q_len, int num_splits, int graph_tokens,
                                              int max_kv_len) {
  return attention_impl("fdl_paged_attention_fp8", q, k_cache, v_cache, &k_scale, &v_scale, block_tables, seq_lens,
                        cu_seqlens, scale, max_q_len, num_splits, graph_tokens, max_kv_len);
}

PD_BUILD_OP(fdl_paged_attention)
    .Inputs({"Q", "KCache", "VCache", "BlockTables", "SeqLensKV", "CuSeqlensQ"})
    .Outputs({"Out"})
    .Attrs({"scale: float", "max_q_len: int", "num_splits: int", "graph_tokens: int",
            "max_kv_len: int"})
    .SetKernelFn(PD_KERNEL(PagedAttention));

PD_BUILD_OP(fdl_paged_attention_fp8)
    .Inputs({"Q", "KCache", "VCache", "KScale", "VScale", "BlockTables", "SeqLensKV", "CuSeqlensQ"})
    .Outputs({"Out"})
    .Attrs({"scale: float", "max_q_len: int", "num_splits: int", "graph_tokens: int",
            "max_kv_len: int"})
    .SetKernelFn(PD_KERNEL(PagedAttentionFp8));
