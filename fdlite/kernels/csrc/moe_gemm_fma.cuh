// The grouped expert GEMMs of fdl_moe_experts (ops_moe.cu) for float32: true fp32 FMAs on CUDA cores (no
// TF32, which would round the operands to 10 mantissa bits: the fp32 model is checked token for token
// against transformers in fp32). Same contract as the tensor-core kernel (moe_gemm_mma.cuh, `MoeGemmArgs`):
// the same grid (tiles_max, ceil(N / 64)), the same gather of A rows through sorted_rows, the same
// epilogues (fp32: nothing to round).
//
// Block: 256 threads as 16 x 16; a BM x 64 output tile (gated: 64 gate and 64 up columns), thread (ty, tx)
// holding rows ty + 16 i (i < BM / 16) and columns tx + 16 j (j < 4): consecutive threads read
// consecutive B columns from shared memory (no bank conflict) and share A values (broadcast). K advances
// in chunks of 16, each element's sum in order of k.
#pragma once

#include "moe_gemm.cuh"

namespace fdl {
namespace {

constexpr int kFmaBN = 64, kFmaBK = 16, kFmaThreads = 256;

template <int BM, bool GATED>
__global__ void __launch_bounds__(kFmaThreads) moe_gemm_fma_kernel(MoeGemmArgs p) {
  pdl_trigger();
  pdl_wait();
  constexpr int NB = GATED ? 2 : 1, TM = BM / 16, TN = kFmaBN / 16;
  const int tile = blockIdx.x;
  const int e = p.tile_expert[tile];
  if (e < 0) return;
  __shared__ float As[kFmaBK][BM + 1];           // k-major: a column of A per k
  __shared__ float Bs[NB][kFmaBK][kFmaBN + 1];
  __shared__ int s_rid[BM], s_src[BM];
  const int r0 = tile * BM;
  for (int m = threadIdx.x; m < BM; m += kFmaThreads) {
    const int rid = p.sorted_rows[r0 + m];
    s_rid[m] = rid;
    s_src[m] = rid < 0 ? -1 : (GATED ? rid / p.topk : r0 + m);
  }
  __syncthreads();
  const int n0 = blockIdx.y * kFmaBN;
  const float* a = static_cast<const float*>(p.a);
  const float* wexp = static_cast<const float*>(p.w) + (int64_t)e * NB * p.N * p.K;
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  float acc[NB][TM][TN];
#pragma unroll
  for (int h = 0; h < NB; ++h)
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[h][i][j] = 0.f;

  for (int k0 = 0; k0 < p.K; k0 += kFmaBK) {
    // A: BM rows x 16 k as float4s (K % 4 == 0), stored transposed
    for (int i = threadIdx.x; i < BM * kFmaBK / 4; i += kFmaThreads) {
      const int m = i / (kFmaBK / 4), c = (i % (kFmaBK / 4)) * 4;
      const int src = s_src[m];
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (src >= 0 && k0 + c < p.K) v = *reinterpret_cast<const float4*>(a + (int64_t)src * p.K + k0 + c);
      As[c][m] = v.x;
      As[c + 1][m] = v.y;
      As[c + 2][m] = v.z;
      As[c + 3][m] = v.w;
    }
#pragma unroll
    for (int h = 0; h < NB; ++h)
      for (int i = threadIdx.x; i < kFmaBN * kFmaBK / 4; i += kFmaThreads) {
        const int n = i / (kFmaBK / 4), c = (i % (kFmaBK / 4)) * 4;
        const int col = n0 + n;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (col < p.N && k0 + c < p.K)
          v = *reinterpret_cast<const float4*>(wexp + ((int64_t)h * p.N + col) * p.K + k0 + c);
        Bs[h][c][n] = v.x;
        Bs[h][c + 1][n] = v.y;
        Bs[h][c + 2][n] = v.z;
        Bs[h][c + 3][n] = v.w;
      }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kFmaBK; ++kk) {
      float av[TM];
#pragma unroll
      for (int i = 0; i < TM; ++i) av[i] = As[kk][ty + 16 * i];
#pragma unroll
      for (int h = 0; h < NB; ++h)
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          const float bv = Bs[h][kk][tx + 16 * j];
#pragma unroll
          for (int i = 0; i < TM; ++i) acc[h][i][j] = fmaf(av[i], bv, acc[h][i][j]);
        }
    }
    __syncthreads();
  }

  float* out = static_cast<float*>(p.out);
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int m = ty + 16 * i;
    const int rid = s_rid[m];
    if (rid < 0) continue;
    const float wq = GATED ? 0.f : p.topk_w[rid];
    float* orow = out + (GATED ? (int64_t)(r0 + m) : (int64_t)rid) * p.N;
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int n = n0 + tx + 16 * j;
      if (n >= p.N) continue;
      if (GATED) {
        const float g = acc[0][i][j], u = acc[NB - 1][i][j];
        orow[n] = g / (1.f + expf(-g)) * u;
      } else {
        orow[n] = acc[0][i][j] * wq;
      }
    }
  }
}

}  // namespace
}  // namespace fdl
