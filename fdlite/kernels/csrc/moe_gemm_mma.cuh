// The grouped expert GEMMs of fdl_moe_experts (ops_moe.cu) for bf16 / fp16, on tensor cores: mma.sync
// m16n8k16 with fp32 accumulators, operands staged in shared memory by cp.async in a STAGES-deep ring.
//
// One kernel, two uses (GATED):
//  - gate/up (GATED): A = the hidden states x [T, K] read through the sorted row list (row r holds entry
//    i = sorted_rows[r], token i / k: the gather is in the load, the permuted input is never written);
//    B = the expert's gate rows [n0, n0 + BN) and up rows [N + n0, N + n0 + BN) of w13[e] [2N, K]; the
//    epilogue writes act[r, n] = round(silu(round(g))) * round(u) (the CPU path's rounding after each op).
//  - down: A = act rows of the tile; B = rows [n0, n0 + BN) of w2[e] [N, K]; the epilogue writes
//    y[i, n] = round(round(acc) * round(topk_w[i])) at the entry's own row i = t k + j, so the un-permute
//    reads each token's k rows contiguously.
// Weights are [E, out, in] ("N-major", as the GPU Linear's [out, in]): a B tile is BN whole rows of K,
// loaded with 16-byte copies and fed to the MMA by ldmatrix without transposition.
//
// Grid (tiles_max, ceil(N / BN)); blockIdx.x, the M tile, varies fastest, so the blocks that run together
// share an expert's weight columns in L2. A tile whose tile_expert is -1 (past the real tiles) exits at
// once. Rows with sorted_rows -1 (an expert's padding) load zeros and write nothing. Each output element
// is a sum over K in the same order (BK chunks in order, the MMA's own order inside one), whatever the
// other rows of its tile are: a token's result does not depend on its batch.
#pragma once

#include "mma_sync.cuh"
#include "moe_gemm.cuh"

namespace fdl {
namespace {

template <int BM_, int BN_, int WM_, int WN_, bool GATED_, int STAGES_>
struct MoeMmaCfg {
  static constexpr int BM = BM_, BN = BN_, WM = WM_, WN = WN_, STAGES = STAGES_;
  static constexpr bool GATED = GATED_;
  static constexpr int BK = 32;
  static constexpr int NTH = WM * WN * 32;
  static constexpr int WTM = BM / WM, WTN = BN / WN;  // a warp's tile
  static constexpr int MT = WTM / 16, NT = WTN / 8;
  static constexpr int NB = GATED ? 2 : 1;            // B tiles per stage (gate, up)
  static constexpr int ROW = BK + 8;                  // padded smem row: ldmatrix's 8 rows hit distinct banks
  static constexpr int VPR = BK / 8;                  // 16-byte vectors per row
  static constexpr int A_ELEMS = BM * ROW, B_ELEMS = BN * ROW;
  static constexpr int STAGE_ELEMS = A_ELEMS + NB * B_ELEMS;
  static constexpr size_t smem_bytes = (size_t)STAGES * STAGE_ELEMS * 2 + 2 * BM * sizeof(int);
  static_assert(WTM % 16 == 0 && WTN % 16 == 0, "a warp tile is whole 16 x 16 MMA pairs");
  static_assert(STAGES >= 2, "at least double buffering");
};

// Stage `st` <- the A rows and B rows of the K chunk starting at k0 (zeros outside the matrices).
template <typename T, typename C>
__device__ __forceinline__ void moe_mma_load(const MoeGemmArgs& p, T* smem, int st, int k0, const int* s_src,
                                             const T* wexp, int n0) {
  T* As = smem + st * C::STAGE_ELEMS;
  const T* a = static_cast<const T*>(p.a);
  for (int i = threadIdx.x; i < C::BM * C::VPR; i += C::NTH) {
    const int m = i / C::VPR, c = i - m * C::VPR;
    const int src = s_src[m];
    const int kk = k0 + c * 8;
    const bool valid = src >= 0 && kk < p.K;
    cp_async16(As + m * C::ROW + c * 8, valid ? a + (int64_t)src * p.K + kk : a, valid);
  }
#pragma unroll
  for (int h = 0; h < C::NB; ++h) {
    T* Bs = As + C::A_ELEMS + h * C::B_ELEMS;
    for (int i = threadIdx.x; i < C::BN * C::VPR; i += C::NTH) {
      const int n = i / C::VPR, c = i - n * C::VPR;
      const int col = n0 + n, kk = k0 + c * 8;
      const bool valid = col < p.N && kk < p.K;
      const T* src = wexp + ((int64_t)h * p.N + col) * p.K + kk;  // h = 1: the up rows, N further
      cp_async16(Bs + n * C::ROW + c * 8, valid ? src : wexp, valid);
    }
  }
}

template <typename T, typename C>
__global__ void __launch_bounds__(C::NTH) moe_gemm_mma_kernel(MoeGemmArgs p) {
  pdl_trigger();
  pdl_wait();
  const int tile = blockIdx.x;
  const int e = p.tile_expert[tile];
  if (e < 0) return;
  extern __shared__ float4 moe_smem4[];
  T* smem = reinterpret_cast<T*>(moe_smem4);
  int* s_rid = reinterpret_cast<int*>(smem + C::STAGES * C::STAGE_ELEMS);  // entry of each row, -1: padding
  int* s_src = s_rid + C::BM;                                               // the A row it reads, -1: none
  const int r0 = tile * C::BM;
  for (int m = threadIdx.x; m < C::BM; m += C::NTH) {
    const int rid = p.sorted_rows[r0 + m];
    s_rid[m] = rid;
    s_src[m] = rid < 0 ? -1 : (C::GATED ? rid / p.topk : r0 + m);
  }
  __syncthreads();

  const int n0 = blockIdx.y * C::BN;
  const T* wexp = static_cast<const T*>(p.w) + (int64_t)e * C::NB * p.N * p.K;
  const int nk = (p.K + C::BK - 1) / C::BK;
#pragma unroll
  for (int st = 0; st < C::STAGES - 1; ++st) {
    if (st < nk) moe_mma_load<T, C>(p, smem, st, st * C::BK, s_src, wexp, n0);
    cp_async_commit();
  }

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp / C::WN, wn = warp - (warp / C::WN) * C::WN;
  // ldmatrix lane addressing (mma_sync.cuh): A rows lane % 16, column 8 (lane / 16); B rows (lane % 8) +
  // 8 (lane / 16), column 8 (lane / 8 % 2).
  const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 8 * (lane >> 4);
  const int b_row = (lane & 7) + 8 * (lane >> 4), b_col = 8 * ((lane >> 3) & 1);
  float acc[C::NB][C::MT][C::NT][4];
#pragma unroll
  for (int h = 0; h < C::NB; ++h)
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt) acc[h][mt][nt][0] = acc[h][mt][nt][1] = acc[h][mt][nt][2] = acc[h][mt][nt][3] = 0.f;

  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<C::STAGES - 2>();
    __syncthreads();  // chunk kt landed for every thread; every warp is done with chunk kt - 1's stage
    if (kt + C::STAGES - 1 < nk)
      moe_mma_load<T, C>(p, smem, (kt + C::STAGES - 1) % C::STAGES, (kt + C::STAGES - 1) * C::BK, s_src, wexp, n0);
    cp_async_commit();  // always: the wait above counts groups
    const T* As = smem + (kt % C::STAGES) * C::STAGE_ELEMS;
#pragma unroll
    for (int kk = 0; kk < C::BK / 16; ++kk) {
      uint32_t af[C::MT][4];
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt) ldsm_x4(af[mt], As + (wm * C::WTM + mt * 16 + a_row) * C::ROW + kk * 16 + a_col);
#pragma unroll
      for (int h = 0; h < C::NB; ++h) {
        const T* Bs = As + C::A_ELEMS + h * C::B_ELEMS;
#pragma unroll
        for (int np = 0; np < C::NT / 2; ++np) {
          uint32_t bf[4];
          ldsm_x4(bf, Bs + (wn * C::WTN + np * 16 + b_row) * C::ROW + kk * 16 + b_col);
#pragma unroll
          for (int mt = 0; mt < C::MT; ++mt) {
            mma16816<T>(acc[h][mt][2 * np], af[mt], bf[0], bf[1]);
            mma16816<T>(acc[h][mt][2 * np + 1], af[mt], bf[2], bf[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();  // nothing in flight when the block exits

  // Epilogue: this thread holds rows wm WTM + mt 16 + lane / 4 + 8 hf, columns wn WTN + nt 8 + 2 (lane % 4) + {0, 1}.
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int m = wm * C::WTM + mt * 16 + (lane >> 2) + 8 * hf;
      const int rid = s_rid[m];
      if (rid < 0) continue;
      float wq = 0.f;
      if (!C::GATED) wq = round_to<T>(p.topk_w[rid]);
      T* orow = static_cast<T*>(p.out) + (C::GATED ? (int64_t)(r0 + m) : (int64_t)rid) * p.N;
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt) {
        const int n = n0 + wn * C::WTN + nt * 8 + 2 * (lane & 3);
        if (n >= p.N) continue;  // N is even, so n + 1 < N too
        float v[2];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          if (C::GATED) {
            const float g = round_to<T>(acc[0][mt][nt][hf * 2 + q]);
            const float u = round_to<T>(acc[C::NB - 1][mt][nt][hf * 2 + q]);
            v[q] = round_to<T>(g / (1.f + expf(-g))) * u;
          } else {
            v[q] = round_to<T>(acc[0][mt][nt][hf * 2 + q]) * wq;
          }
        }
        *reinterpret_cast<uint32_t*>(orow + n) = pack2<T>(v[0], v[1]);
      }
    }
}

}  // namespace
}  // namespace fdl
