// The grouped expert GEMMs of fdl_moe_experts (ops_moe.cu) for bf16 / fp16 at prefill sizes, on Hopper `wgmma`
// (sm_90a): the same contract as moe_gemm_mma.cuh (moe_gemm.cuh: A rows through the sorted row list, B from one
// expert's [out, in] weights, the gated or the down epilogue), with 128 x 256 tiles.
//
// Why another kernel: the mma.sync one reaches 150-200 TFLOP/s at 4,096 tokens, and its 64 x 64 tiles cannot
// feed tensor cores that read their operands from shared memory at twice its rate. Why not TMA: A's rows are
// gathered through the sorted row list (a token's hidden state, or its row of act), which a tensor map cannot
// describe; cp.async writes the 128-byte-swizzled layout TMA would, as in attention_wgmma.cuh.
//
// A block is warp-specialized: warpgroup 0 copies each K chunk (BK = 64 columns: one 128-byte panel) of the
// tile's 128 A rows and 256 B rows into one of STAGES shared-memory stages, mbarriers handing each stage to the
// computing warpgroups and back; warpgroups 1 and 2 take 64 rows each and run m64n256k16 wgmmas with both
// operands in shared memory, keeping one chunk's MMAs in flight while they wait for the next.
//  - gate/up (GATED): B rows 0-127 are the gate rows [n0, n0 + 128) of w13[e], rows 128-255 the up rows
//    [I + n0, I + n0 + 128): a thread's accumulator holds gate column n and up column n side by side (blocks nb
//    and nb + 16 of the m64n256 layout), so SiLU-and-multiply needs no exchange. 128 columns of act per block.
//  - down: B rows are [n0, n0 + 256) of w2[e]; 256 columns of y per block.
// Each output element is a sum over K in chunk order (wgmma's own order inside a chunk), whatever the other rows
// of its tile are: a token's result does not depend on its batch among launches of this kernel.
#pragma once

#include "moe_gemm.cuh"
#include "wgmma.cuh"

namespace fdl {
namespace {

template <bool GATED_>
struct MoeWgCfg {
  static constexpr bool GATED = GATED_;
  static constexpr int WG = 128;              // threads of a warpgroup
  static constexpr int CONSUMERS = 2;         // computing warpgroups, 64 rows each; warpgroup 0 loads
  static constexpr int NTH = WG * (1 + CONSUMERS);
  static constexpr int BM = 64 * CONSUMERS;   // rows per M tile (moe_align pads each expert to a multiple)
  static constexpr int BN = 256;              // B rows per tile
  static constexpr int OUT_N = GATED ? BN / 2 : BN;  // output columns per block
  static constexpr int BK = 64;               // K columns per chunk: one 128-byte swizzled panel
  static constexpr int STAGES = 4;
  static constexpr int LAG = 2;               // chunks the loader keeps in flight before marking one full
  // chunk c is marked full after chunk c + LAG is issued, which waits for chunk c + LAG - STAGES's stage to be
  // released, which happens once chunk c + LAG - STAGES + 1 is full: no cycle iff LAG <= STAGES - 2
  static_assert(LAG <= STAGES - 2, "the stage hand-over would deadlock");
  static constexpr int A_BYTES = BM * 128, B_BYTES = BN * 128, STAGE = A_BYTES + B_BYTES;
  static constexpr int A_CPT = BM * 8 / WG, B_CPT = BN * 8 / WG;  // 16-byte copies per loader thread per chunk
  static constexpr int RSTEP = WG / 8;        // rows between a loader thread's successive copies
  static_assert(RSTEP % 8 == 0, "a loader thread's rows share one swizzle phase");
  // stages | mbarriers full[STAGES], empty[STAGES] | s_rid[BM], s_src[BM], + room to align the base to 1024
  static constexpr size_t BAR_OFF = (size_t)STAGES * STAGE;
  static constexpr size_t ROWS_OFF = BAR_OFF + 2 * STAGES * 8;
  static constexpr size_t bytes = ROWS_OFF + 2 * BM * sizeof(int) + 1024;
};

template <typename T, typename C>
__global__ void __launch_bounds__(C::NTH, 1) moe_gemm_wgmma_kernel(MoeGemmArgs p) {
  pdl_trigger();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int tile = blockIdx.x;
  extern __shared__ float4 moe_wg_smem4[];
  // the swizzle pattern repeats every 1024 bytes of the shared address space, from a 1024-aligned address
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(moe_wg_smem4);
  uint8_t* smem = reinterpret_cast<uint8_t*>(moe_wg_smem4) + (((base + 1023) & ~1023u) - base);
  const uint32_t full0 = (uint32_t)__cvta_generic_to_shared(smem + C::BAR_OFF), empty0 = full0 + 8 * C::STAGES;
  int* s_rid = reinterpret_cast<int*>(smem + C::ROWS_OFF);  // entry of each row, -1: padding
  int* s_src = s_rid + C::BM;                               // the A row it reads, -1: none
  pdl_wait();
  const int e = p.tile_expert[tile];
  if (e < 0) return;
  const int r0 = tile * C::BM;
  for (int m = threadIdx.x; m < C::BM; m += C::NTH) {
    const int rid = p.sorted_rows[r0 + m];
    s_rid[m] = rid;
    s_src[m] = rid < 0 ? -1 : (C::GATED ? rid / p.topk : r0 + m);
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::STAGES; ++s) {
      mbar_init(full0 + 8 * s, C::WG);                     // every loader thread arrives
      mbar_init(empty0 + 8 * s, C::WG * C::CONSUMERS);     // every computing thread arrives
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int n0 = blockIdx.y * C::OUT_N;
  const int nk = (p.K + C::BK - 1) / C::BK;
  // the role is warp-uniform, and ptxas must see that: a wgmma after a branch it thinks divergent is serialized
  const int wg = __shfl_sync(0xffffffffu, threadIdx.x / C::WG, 0);

  if (wg == 0) {  // ---------------------------------------------------------------------------------- loader
    const int tid = threadIdx.x, c = tid & 7, rr = tid >> 3;  // piece c of rows rr + n RSTEP
    const T* a = static_cast<const T*>(p.a);
    const T* wexp = static_cast<const T*>(p.w) + (int64_t)e * (C::GATED ? 2 : 1) * p.N * p.K;
    const T* asrc[C::A_CPT];
    const T* bsrc[C::B_CPT];
#pragma unroll
    for (int n = 0; n < C::A_CPT; ++n) {
      const int src = s_src[rr + n * C::RSTEP];
      asrc[n] = src >= 0 ? a + (int64_t)src * p.K + c * 8 : nullptr;
    }
#pragma unroll
    for (int n = 0; n < C::B_CPT; ++n) {
      const int row = rr + n * C::RSTEP;
      int wrow;  // the weight row, or -1 past the matrix
      if (C::GATED) {
        const int col = n0 + (row < C::OUT_N ? row : row - C::OUT_N);
        wrow = col < p.N ? (row < C::OUT_N ? col : p.N + col) : -1;
      } else {
        wrow = n0 + row < p.N ? n0 + row : -1;
      }
      bsrc[n] = wrow >= 0 ? wexp + (int64_t)wrow * p.K + c * 8 : nullptr;
    }
    const int soff = sw128(rr, c);  // rows rr + n RSTEP keep rr's swizzle phase
    for (int kc = 0; kc < nk; ++kc) {
      const int s = kc % C::STAGES;
      mbar_wait(empty0 + 8 * s, ((kc / C::STAGES) & 1) ^ 1);  // chunk kc - STAGES released the stage
      uint8_t* As = smem + s * C::STAGE;
      uint8_t* Bs = As + C::A_BYTES;
      const int k0 = kc * C::BK;
      const bool kin = k0 + c * 8 < p.K;  // K is a multiple of 8: a piece is wholly inside or outside
#pragma unroll
      for (int n = 0; n < C::A_CPT; ++n) {
        const bool valid = kin && asrc[n] != nullptr;
        cp_async16(As + soff + n * C::RSTEP * 128, valid ? asrc[n] + k0 : a, valid);  // invalid: zeros
      }
#pragma unroll
      for (int n = 0; n < C::B_CPT; ++n) {
        const bool valid = kin && bsrc[n] != nullptr;
        cp_async16(Bs + soff + n * C::RSTEP * 128, valid ? bsrc[n] + k0 : wexp, valid);
      }
      cp_async_commit();
      if (kc >= C::LAG) {  // chunk kc - LAG has landed: make it visible to the MMAs (async proxy), mark it full
        cp_async_wait<C::LAG>();
        fence_proxy_async();
        mbar_arrive(full0 + 8 * ((kc - C::LAG) % C::STAGES));
      }
    }
    for (int kc = max(0, nk - C::LAG); kc < nk; ++kc) {
      if (nk - 1 - kc >= 1) cp_async_wait<1>();
      else cp_async_wait<0>();
      fence_proxy_async();
      mbar_arrive(full0 + 8 * (kc % C::STAGES));
    }
    return;
  }

  // ------------------------------------------------------------------------------------------ computing warpgroups
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  const uint32_t st0 = (uint32_t)__cvta_generic_to_shared(smem);
  for (int kc = 0; kc < nk; ++kc) {
    const int s = kc % C::STAGES;
    mbar_wait(full0 + 8 * s, (kc / C::STAGES) & 1);
    const uint32_t a_addr = st0 + s * C::STAGE + (wg - 1) * 64 * 128, b_addr = st0 + s * C::STAGE + C::A_BYTES;
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < C::BK / 16; ++kk)  // 16 columns (32 bytes) of the panel per MMA
      wgmma_m64n256k16_ss<T>(acc, wg_desc(a_addr + kk * 32, 16, 1024), wg_desc(b_addr + kk * 32, 16, 1024));
    wg_commit();
    if (kc > 0) {  // chunk kc - 1's MMAs are done: release its stage
      wg_wait<1>();
      mbar_arrive(empty0 + 8 * ((kc - 1) % C::STAGES));
    }
  }
  wg_wait<0>();
  wg_pin(acc);

  // Epilogue: this thread holds rows (wg - 1) 64 + 16 warp + lane / 4 + 8 hf, columns 8 nb + 2 (lane % 4) + {0, 1}
  // of the m64n256 accumulator (acc[nb 4 + hf 2 + q]).
  const int lane = threadIdx.x & 31, warp = (threadIdx.x % C::WG) >> 5;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int m = (wg - 1) * 64 + 16 * warp + (lane >> 2) + 8 * hf;
    const int rid = s_rid[m];
    if (rid < 0) continue;
    float wq = 0.f;
    if (!C::GATED) wq = round_to<T>(p.topk_w[rid]);
    T* orow = static_cast<T*>(p.out) + (C::GATED ? (int64_t)(r0 + m) : (int64_t)rid) * p.N;
#pragma unroll
    for (int nb = 0; nb < C::OUT_N / 8; ++nb) {
      const int n = n0 + nb * 8 + 2 * (lane & 3);
      if (n >= p.N) continue;  // N is even, so n + 1 < N too
      float v[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        if (C::GATED) {
          const float g = round_to<T>(acc[nb * 4 + hf * 2 + q]);
          const float u = round_to<T>(acc[(nb + C::OUT_N / 8) * 4 + hf * 2 + q]);
          v[q] = round_to<T>(g / (1.f + expf(-g))) * u;
        } else {
          v[q] = round_to<T>(acc[nb * 4 + hf * 2 + q]) * wq;
        }
      }
      *reinterpret_cast<uint32_t*>(orow + n) = pack2<T>(v[0], v[1]);
    }
  }
#else
  pdl_wait();
#endif
}

}  // namespace
}  // namespace fdl
