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
// Three kernels, deterministic (no order decided by atomics):
//  1. count:   one block per chunk of kChunk entries; shared-memory histogram -> chunk_counts[chunk][E].
//  2. offsets: one block of 1024 threads, thread e = expert e (E <= 1024): walks the chunks turning
//              chunk_counts[.][e] into the exclusive prefix over chunks, then a block scan of the experts'
//              tile counts gives each expert's first tile; writes tile_expert, row_start[e] and the -1s of
//              each expert's padding rows.
//  3. scatter: one block per chunk again; warps take turns (in warp order) placing their entries: an
//              entry's row is row_start[e] + (entries of e in earlier chunks) + (in earlier warps of this
//              chunk) + (in lower lanes of its warp, from __match_any_sync).
// Entries whose id is outside [0, E) are dropped (the router never makes one; the un-permute skips them).
#pragma once

#include <algorithm>

#include "ops_common.cuh"

namespace fdl {
namespace {

constexpr int kChunk = 512;         // entries per count / scatter block (16 warps)
constexpr int kMaxExperts = 1024;   // one offsets thread per expert

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

// Exclusive scan of v over the block (blockDim.x = kMaxExperts); also returns the block's total.
__device__ __forceinline__ int block_exclusive_scan(int v, int* total) {
  __shared__ int warp_part[32];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  int inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += u;
  }
  if (lane == 31) warp_part[wid] = inc;
  __syncthreads();
  if (wid == 0) {
    const int nw = blockDim.x >> 5;
    int p = lane < nw ? warp_part[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, p, o);
      if (lane >= o) p += u;
    }
    warp_part[lane] = p;  // inclusive over warps
  }
  __syncthreads();
  *total = warp_part[(blockDim.x >> 5) - 1];
  return inc - v + (wid > 0 ? warp_part[wid - 1] : 0);
}

__global__ void __launch_bounds__(kMaxExperts) moe_offsets_kernel(int* __restrict__ chunk_counts, int nchunks, int E,
                                                                  int bm, int tiles_max, int* __restrict__ row_start,
                                                                  int* __restrict__ tile_expert,
                                                                  int* __restrict__ sorted_rows) {
  pdl_trigger();
  pdl_wait();
  const int e = threadIdx.x;
  int count = 0;
  if (e < E) {
#pragma unroll 8
    for (int c = 0; c < nchunks; ++c) {
      int* p = chunk_counts + (int64_t)c * E + e;
      const int v = *p;
      *p = count;
      count += v;
    }
  }
  const int tiles = (count + bm - 1) / bm;
  int total_tiles = 0;
  const int first_tile = block_exclusive_scan(tiles, &total_tiles);
  if (e < E) {
    const int64_t r0 = (int64_t)first_tile * bm;
    row_start[e] = (int)r0;
    for (int j = 0; j < tiles; ++j) tile_expert[first_tile + j] = e;
    for (int r = count; r < tiles * bm; ++r) sorted_rows[r0 + r] = -1;
  }
  for (int t = total_tiles + threadIdx.x; t < tiles_max; t += blockDim.x) tile_expert[t] = -1;
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
  int* chunk_counts; // [nchunks * E]
};

// Scratch ints the alignment needs beside sorted_rows and tile_expert (row_start, chunk_counts).
inline int64_t moe_align_scratch(int64_t n, int64_t E) { return E + ceil_div(n, kChunk) * E; }

inline void launch_moe_align(const int* ids, int64_t n, int64_t E, int bm, const MoeAlign& a, bool pdl,
                             cudaStream_t s) {
  const int64_t nchunks = ceil_div(n, kChunk);
  const int64_t tiles_max = moe_tiles_max(n, E, bm);
  if (n == 0) return;
  const size_t smem = (size_t)E * sizeof(int);
  launch("moe_count_kernel", moe_count_kernel, (unsigned)nchunks, kChunk, smem, s, pdl, ids, (int)n, (int)E,
         a.chunk_counts);
  launch("moe_offsets_kernel", moe_offsets_kernel, 1u, kMaxExperts, 0, s, pdl, a.chunk_counts, (int)nchunks, (int)E,
         bm, (int)tiles_max, a.row_start, a.tile_expert, a.sorted_rows);
  launch("moe_scatter_kernel", moe_scatter_kernel, (unsigned)nchunks, kChunk, smem, s, pdl, ids, (int)n, (int)E,
         (const int*)a.chunk_counts, (const int*)a.row_start, a.sorted_rows);
}

}  // namespace
}  // namespace fdl
