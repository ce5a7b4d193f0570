// Tokens sorted by expert for the grouped expert GEMMs (ops_moe.cu), on the device, with no host read.
//
// Input: ids [T, k] int32, the router's choices; entry i = t k + j is token t's j-th choice. Output, for an
// M tile of BM rows:
//   sorted_rows [tiles_max * BM]: expert 0's entries, padded with -1 to a multiple of BM, then expert 1's,
//                                  ... (an expert with no entry takes no row); within an expert in
//                                  entry order, as the CPU path's stable argsort has them;
//   tile_expert [tiles_max]:       the expert of each M tile, -1 past the last real tile (those GEMM blocks
//                                  exit at once).
// tiles_max = (N + min(E, N) (BM - 1)) / BM with N = T k: at most min(E, N) experts have entries, each
// needs ceil(c_e / BM) <= (c_e + BM - 1) / BM tiles, and the counts sum to N. So every grid here and in
// the GEMMs depends only on (T, k, E, BM), which a CUDA graph fixes, never on the routing.
//
// Four kernels, deterministic (no order decided by atomics):
//  1. count:   one block per chunk of kChunk entries; shared-memory histogram -> chunk_counts[chunk][E].
//  2. prefix:  one block per 32 experts, lane = expert (a chunk's row is read coalesced), warp w over the w-th
//              run of chunks: the run's sum, a scan over the runs, then the run rewritten -> chunk_counts[.][e]
//              in place the exclusive prefix over chunks, and an extra row chunk_counts[nchunks][e] = e's total.
//  3. tiles:   one warp per M tile; every block scans the experts' tile counts (E <= 1024, one thread each),
//              then warp w finds its tile's expert by binary search over the first tiles: writes tile_expert
//              (-1 past the last real tile), the -1s of the tile's rows past its expert's entries, and (block
//              0) row_start[e].
//  4. scatter: one block per chunk again; warps take turns (in warp order) placing their entries: an
//              entry's row is row_start[e] + (entries of e in earlier chunks) + (in earlier warps of this
//              chunk) + (in lower lanes of its warp, from __match_any_sync).
// Entries whose id is outside [0, E) are dropped (the router never makes one; the un-permute skips them).
#pragma once

#include <algorithm>

#include "ops_common.cuh"

namespace fdl {
namespace {

constexpr int kChunk = 512;         // entries per count / scatter block (16 warps)
constexpr int kMaxExperts = 1024;   // one tiles-kernel thread per expert in its scan
constexpr int kRuns = 32;           // runs of chunks per prefix block: one warp each
constexpr int kRowBatch = 8;        // chunk rows a prefix thread loads before using any: one latency per 8 rows
constexpr int kTileWarps = kMaxExperts / 32;  // M tiles per tiles block

inline int64_t moe_tiles_max(int64_t n, int64_t E, int bm) { return (n + std::min(E, n) * (bm - 1)) / bm; }

__global__ void __launch_bounds__(kChunk) moe_count_kernel(const int* __restrict__ ids, int n, int E,
                                                           int* __restrict__ chunk_counts) {
  pdl_trigger();
  pdl_wait();
  extern __shared__ int align_cnt[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) align_cnt[e] = 0;
  __syncthreads();
  const int i = blockIdx.x * kChunk + threadIdx.x;
  if (i < n) {
    const int e = ids[i];
    if ((unsigned)e < (unsigned)E) atomicAdd(&align_cnt[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) chunk_counts[(int64_t)blockIdx.x * E + e] = align_cnt[e];
}

__device__ __forceinline__ int warp_inclusive_scan(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// Exclusive scan of v over the block (blockDim.x = kMaxExperts); also returns the block's total.
__device__ __forceinline__ int block_exclusive_scan(int v, int* total) {
  __shared__ int warp_part[32];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const int inc = warp_inclusive_scan(v);
  if (lane == 31) warp_part[wid] = inc;
  __syncthreads();
  if (wid == 0) {
    const int nw = blockDim.x >> 5;
    warp_part[lane] = warp_inclusive_scan(lane < nw ? warp_part[lane] : 0);  // inclusive over warps
  }
  __syncthreads();
  *total = warp_part[(blockDim.x >> 5) - 1];
  return inc - v + (wid > 0 ? warp_part[wid - 1] : 0);
}

// x[q] = col[(c + q) E] for the rows c + q < c1 of one expert's column, 0 past them: independent loads in flight.
__device__ __forceinline__ void load_rows(const int* col, int c, int c1, int E, int (&x)[kRowBatch]) {
#pragma unroll
  for (int q = 0; q < kRowBatch; ++q) x[q] = c + q < c1 ? col[(int64_t)(c + q) * E] : 0;
}

// chunk_counts[.][e] -> its exclusive prefix over chunks, in place, and row nchunks -> e's total; 32 experts a block.
__global__ void __launch_bounds__(32 * kRuns) moe_prefix_kernel(int* __restrict__ chunk_counts, int nchunks, int E) {
  pdl_trigger();
  pdl_wait();
  __shared__ int run_part[kRuns][33];  // [run][expert], padded: the scan reads it by column
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int e = blockIdx.x * 32 + lane;
  const int per = (nchunks + kRuns - 1) / kRuns;
  const int c0 = min(w * per, nchunks), c1 = min(c0 + per, nchunks);
  int* col = chunk_counts + e;
  int x[kRowBatch];
  int sum = 0;
  for (int c = c0; e < E && c < c1; c += kRowBatch) {
    load_rows(col, c, c1, E, x);
#pragma unroll
    for (int q = 0; q < kRowBatch; ++q) sum += x[q];
  }
  run_part[w][lane] = sum;
  __syncthreads();
  // Warp w scans expert (32 b + w)'s run sums, lane = run.
  const int v = run_part[lane][w], inc = warp_inclusive_scan(v);
  run_part[lane][w] = inc - v;
  const int ew = blockIdx.x * 32 + w;
  if (lane == 31 && ew < E) chunk_counts[(int64_t)nchunks * E + ew] = inc;
  __syncthreads();
  int run = run_part[w][lane];
  for (int c = c0; e < E && c < c1; c += kRowBatch) {
    load_rows(col, c, c1, E, x);
#pragma unroll
    for (int q = 0; q < kRowBatch; ++q) {
      if (c + q < c1) col[(int64_t)(c + q) * E] = run;
      run += x[q];
    }
  }
}

// totals [E]: each expert's entries (the prefix kernel's extra row). Warp w of block b: M tile 32 b + w.
__global__ void __launch_bounds__(kMaxExperts) moe_tiles_kernel(const int* __restrict__ totals, int E, int bm,
                                                                int tiles_max, int* __restrict__ row_start,
                                                                int* __restrict__ tile_expert,
                                                                int* __restrict__ sorted_rows) {
  pdl_trigger();
  pdl_wait();
  __shared__ int first_tile[kMaxExperts], row_end[kMaxExperts];
  const int e = threadIdx.x;
  const int count = e < E ? totals[e] : 0;
  int total_tiles = 0;
  const int first = block_exclusive_scan((count + bm - 1) / bm, &total_tiles);
  if (e < E) {
    first_tile[e] = first;
    row_end[e] = first * bm + count;
    if (blockIdx.x == 0) row_start[e] = first * bm;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * kTileWarps + (threadIdx.x >> 5);
  if (t >= tiles_max) return;
  if (t >= total_tiles) {
    if (lane == 0) tile_expert[t] = -1;
    return;
  }
  // Tile t's expert: the last whose first tile is <= t (experts before it with the same first tile have none).
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (first_tile[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  if (lane == 0) tile_expert[t] = lo;
  for (int r = max(t * bm, row_end[lo]) + lane; r < (t + 1) * bm; r += 32) sorted_rows[r] = -1;
}

__global__ void __launch_bounds__(kChunk) moe_scatter_kernel(const int* __restrict__ ids, int n, int E,
                                                             const int* __restrict__ chunk_prefix,
                                                             const int* __restrict__ row_start,
                                                             int* __restrict__ sorted_rows) {
  pdl_trigger();
  pdl_wait();
  extern __shared__ int align_cnt[];  // entries of each expert placed by earlier warps of this chunk
  for (int e = threadIdx.x; e < E; e += blockDim.x) align_cnt[e] = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const int i = blockIdx.x * kChunk + threadIdx.x;
  const int e = i < n ? ids[i] : -1;
  const bool valid = (unsigned)e < (unsigned)E;
  const unsigned same = __match_any_sync(0xffffffffu, valid ? e : -1);
  const unsigned lower = same & ((1u << lane) - 1u);
  for (int w = 0; w < kChunk / 32; ++w) {
    if (wid == w && valid) {
      const int before = align_cnt[e];  // read by every lane of the group before its leader adds
      sorted_rows[row_start[e] + chunk_prefix[(int64_t)blockIdx.x * E + e] + before + __popc(lower)] = i;
      __syncwarp(same);
      if (lower == 0) align_cnt[e] = before + __popc(same);
    }
    __syncthreads();
  }
}

struct MoeAlign {
  int* sorted_rows;  // [tiles_max * bm]
  int* tile_expert;  // [tiles_max]
  int* row_start;    // [E]
  int* chunk_counts; // [(nchunks + 1) * E]: the last row each expert's total
};

// Scratch ints the alignment needs beside sorted_rows and tile_expert (row_start, chunk_counts).
inline int64_t moe_align_scratch(int64_t n, int64_t E) { return E + (ceil_div(n, kChunk) + 1) * E; }

inline void launch_moe_align(const int* ids, int64_t n, int64_t E, int bm, const MoeAlign& a, bool pdl,
                             cudaStream_t s) {
  const int64_t nchunks = ceil_div(n, kChunk);
  const int64_t tiles_max = moe_tiles_max(n, E, bm);
  if (n == 0) return;
  const size_t smem = (size_t)E * sizeof(int);
  launch("moe_count_kernel", moe_count_kernel, (unsigned)nchunks, kChunk, smem, s, pdl, ids, (int)n, (int)E,
         a.chunk_counts);
  launch("moe_prefix_kernel", moe_prefix_kernel, (unsigned)ceil_div(E, 32), 32 * kRuns, 0, s, pdl, a.chunk_counts,
         (int)nchunks, (int)E);
  launch("moe_tiles_kernel", moe_tiles_kernel, (unsigned)ceil_div(tiles_max, kTileWarps), kMaxExperts, 0, s, pdl,
         (const int*)a.chunk_counts + nchunks * E, (int)E, bm, (int)tiles_max, a.row_start, a.tile_expert,
         a.sorted_rows);
  launch("moe_scatter_kernel", moe_scatter_kernel, (unsigned)nchunks, kChunk, smem, s, pdl, ids, (int)n, (int)E,
         (const int*)a.chunk_counts, (const int*)a.row_start, a.sorted_rows);
}

}  // namespace
}  // namespace fdl
