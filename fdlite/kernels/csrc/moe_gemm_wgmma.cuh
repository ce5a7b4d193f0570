// The grouped expert GEMMs of fdl_moe_experts (ops_moe.cu) for bf16 / fp16, on Hopper `wgmma`
// (sm_90a): the same contract as moe_gemm_mma.cuh (moe_gemm.cuh: A rows through the sorted row list, B from one
// expert's [out, in] weights, the gated or the down epilogue), with 128 x 256 tiles.
//
// Why another kernel: the mma.sync one reaches 150-200 TFLOP/s at 4,096 tokens, and its 64 x 64 tiles cannot
// feed tensor cores that read their operands from shared memory at twice its rate.
// Loads: B (an expert's weight rows) and the down GEMM's A (act, whose rows are already in sorted order) are tiles
// of 2D tensors and come by TMA, one thread issuing a chunk's boxes; the gate/up GEMM's A rows are gathered through
// the sorted row list (a token's hidden state), which a tensor map cannot describe, so the loader warpgroup copies
// them with cp.async into the 128-byte-swizzled layout TMA writes.
//
// Persistent blocks (one per SM) walk the (real M tile, N block) items in a fixed stride. A block is warp-specialized:
// warpgroup 0 loads each K chunk (BK = 64 columns: one 128-byte panel) of an item's 128 A rows and 256 B rows
// into one of STAGES shared-memory stages, running on into the next item while the last one's epilogue runs,
// mbarriers handing each stage to the computing warpgroups and back; warpgroups 1 and 2 take 64 rows each and run
// m64n256k16 wgmmas with both operands in shared memory, keeping one chunk's MMAs in flight while they wait for
// the next.
//  - gate/up (GATED): B rows 0-127 are the gate rows [n0, n0 + 128) of w13[e], rows 128-255 the up rows
//    [I + n0, I + n0 + 128): a thread's accumulator holds gate column n and up column n side by side (blocks nb
//    and nb + 16 of the m64n256 layout), so SiLU-and-multiply needs no exchange. 128 columns of act per block.
//  - down: B rows are [n0, n0 + 256) of w2[e]; 256 columns of y per block.
// Rows of a box past the expert's own (N not a multiple of the box) are the next rows of the tensor or TMA's zeros:
// they feed only output columns >= N, which are never written; act's padding rows (never written by the gate/up
// GEMM) feed only padding rows of y, never written either.
// Epilogue (WIDE, ops_moe.cu picks it from a quarter tile of rows per expert, moe_wide_stores): the accumulator
// layout gives a thread 2 columns of each 8-column block, so a 4-byte store per block fills only half of each 32-byte
// sector a warp's store touches; the lanes of a quad (which share their rows) transpose their packed words 4 blocks
// at a time, each lane then storing one whole block (8 columns, 16 bytes). The values and the columns and rows
// written are those of a store per pair. Measured on the H100 (Qwen3-30B-A3B layer): 11-13% faster at 4,096-8,192
// tokens, 2% at 1,024, but slower at 256 and below, where tiles are mostly padding rows (a warp whose rows are all
// padding skips the transpose; the others compute their padding rows' values too); there each thread stores its
// pairs.
// Each output element is a sum over K in chunk order (wgmma's own order inside a chunk), whatever the other rows
// of its tile are: a token's result does not depend on its batch among launches of this kernel. A computing
// warpgroup whose 64 rows are all padding (the tail of an expert's last tile) skips its MMAs.
#pragma once

#include "mma_sync.cuh"
#include "moe_gemm.cuh"
#include "wgmma.cuh"

namespace fdl {
namespace {

template <bool GATED_, bool WIDE_>
struct MoeWgCfg {
  static constexpr bool GATED = GATED_;
  static constexpr bool WIDE = WIDE_;         // 16-byte epilogue stores (the header)
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
  static constexpr int A_CPT = BM * 8 / WG;  // gate/up: 16-byte A copies per loader thread per chunk
  static constexpr int B_BOX = GATED ? BN / 2 : BN;  // rows of a B box: the gate and the up half, or all
  static constexpr int RSTEP = WG / 8;        // rows between a loader thread's successive copies
  static_assert(RSTEP % 8 == 0, "a loader thread's rows share one swizzle phase");
  // stages | mbarriers full[STAGES], empty[STAGES], + room to align the base to 1024
  static constexpr size_t BAR_OFF = (size_t)STAGES * STAGE;
  static constexpr size_t bytes = BAR_OFF + 2 * STAGES * 8 + 1024;
};

// The kernel's TMA descriptors: a (the down GEMM's act [rows, K]; unused by the gate/up GEMM) and b (the weights as
// [E out, K]), both in boxes of 64 columns by C::BM or C::B_BOX rows.
struct MoeTmaps {
  CUtensorMap a, b;
};

// The output element of a thread's accumulator pair column q, block nb, row half hf (the layout below): SiLU(gate) *
// up (gate/up), or the down projection times the row's router weight wq, each operand rounded as the CPU path does.
template <typename T, typename C>
__device__ __forceinline__ float moe_out_value(const float (&acc)[128], int nb, int hf, int q, float wq) {
  if (C::GATED) {
    const float g = round_to<T>(acc[nb * 4 + hf * 2 + q]);
    const float u = round_to<T>(acc[(nb + C::OUT_N / 8) * 4 + hf * 2 + q]);
    return round_to<T>(g / (1.f + expf(-g))) * u;
  }
  return round_to<T>(acc[nb * 4 + hf * 2 + q]) * wq;
}

template <typename T, typename C>
__global__ void __launch_bounds__(C::NTH, 1)
    moe_gemm_wgmma_kernel(MoeGemmArgs p, int tiles, int nblocks, const __grid_constant__ MoeTmaps tm) {
  pdl_trigger();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ float4 moe_wg_smem4[];
  uint8_t* smem = smem_align1024(moe_wg_smem4);
  const uint32_t full0 = (uint32_t)__cvta_generic_to_shared(smem + C::BAR_OFF), empty0 = full0 + 8 * C::STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::STAGES; ++s) {
      mbar_init(full0 + 8 * s, C::GATED ? C::WG + 1 : 1);  // gate/up: every cp.async thread + the TMA thread
      mbar_init(empty0 + 8 * s, C::WG * C::CONSUMERS);  // every computing thread arrives
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  pdl_wait();
  // The real tiles are a prefix of the grid's (moe_align.cuh): count them, so that the items spread evenly over the
  // blocks (skipping the others in place left some blocks two items more than others).
  int real = 0;
  for (int t0 = 0; t0 < tiles; t0 += C::NTH) {
    const int t = t0 + threadIdx.x;
    real += __syncthreads_count(t < tiles && p.tile_expert[t] >= 0);
  }
  const int items = real * nblocks;
  const int nk = (p.K + C::BK - 1) / C::BK;
  // the role is warp-uniform, and ptxas must see that: a wgmma after a branch it thinks divergent is serialized
  const int wg = __shfl_sync(0xffffffffu, threadIdx.x / C::WG, 0);
  // Persistent: every role walks the same items and counts the same chunks, so stage i % STAGES and phase
  // i / STAGES of chunk i agree without a hand-over of the schedule. Item = N block + nblocks x M tile: the blocks
  // that run together take every N block of a few M tiles, so a tile's A rows come from HBM once (with the M tile
  // varying fastest they were read once per N block: 6 to 8 times, which bound the gate/up GEMM by HBM), and an
  // expert's weights once for its few consecutive tiles.

  if (wg == 0) {  // ---------------------------------------------------------------------------------- loader
    const int tid = threadIdx.x, c = tid & 7, rr = tid >> 3;  // gate/up: piece c of A rows rr + n RSTEP
    if (!C::GATED && tid != 0) return;  // down: TMA only, from one thread
    const int soff = sw128(rr, c);  // rows rr + n RSTEP keep rr's swizzle phase
    const T* a = static_cast<const T*>(p.a);
    const uint32_t st0 = (uint32_t)__cvta_generic_to_shared(smem);
    int it = 0;  // chunks issued so far
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      const int tile = item / nblocks, n0 = item % nblocks * C::OUT_N;
      const int e = p.tile_expert[tile];
      const int brow = e * (C::GATED ? 2 : 1) * p.N + n0;  // the item's first B row in the [E out, K] view
      const T* asrc[C::A_CPT];
      if (C::GATED) {
#pragma unroll
        for (int n = 0; n < C::A_CPT; ++n) {
          const int rid = p.sorted_rows[tile * C::BM + rr + n * C::RSTEP];  // -1: padding
          asrc[n] = rid >= 0 ? a + (int64_t)(rid / p.topk) * p.K + c * 8 : nullptr;
        }
      }
      for (int kc = 0; kc < nk; ++kc, ++it) {
        const int s = it % C::STAGES;
        const uint32_t full = full0 + 8 * s;
        mbar_wait(empty0 + 8 * s, ((it / C::STAGES) & 1) ^ 1);  // chunk it - STAGES released the stage
        const uint32_t As = st0 + s * C::STAGE, Bs = As + C::A_BYTES;
        const int k0 = kc * C::BK;
        if (tid == 0) {
          mbar_arrive_expect_tx(full, C::GATED ? C::B_BYTES : C::STAGE);
          if (C::GATED) {  // gate rows, then the up rows N further on
            tma_load_2d(Bs, &tm.b, k0, brow, full);
            tma_load_2d(Bs + C::B_BOX * 128, &tm.b, k0, brow + p.N, full);
          } else {
            tma_load_2d(As, &tm.a, k0, tile * C::BM, full);
            tma_load_2d(Bs, &tm.b, k0, brow, full);
          }
        }
        if (C::GATED) {
          const bool kin = k0 + c * 8 < p.K;  // K is a multiple of 8: a piece is wholly inside or outside
          uint8_t* Ag = smem + s * C::STAGE;
#pragma unroll
          for (int n = 0; n < C::A_CPT; ++n) {
            const bool valid = kin && asrc[n] != nullptr;
            cp_async16(Ag + soff + n * C::RSTEP * 128, valid ? asrc[n] + k0 : a, valid);  // invalid: zeros
          }
          cp_async_commit();
          stage_full_lagging<C::LAG>(full0, C::STAGES, it, it + 1);  // one stream across the items
        }
      }
    }
    if (C::GATED) stages_rest_full<C::LAG>(full0, C::STAGES, it, it);
    return;
  }

  // ------------------------------------------------------------------------------------------ computing warpgroups
  // This thread's rows: (wg - 1) 64 + 16 warp + lane / 4 + 8 hf; its columns 8 nb + 2 (lane % 4) + {0, 1} of the
  // m64n256 accumulator (acc[nb 4 + hf 2 + q]).
  const int lane = threadIdx.x & 31, warp = (threadIdx.x % C::WG) >> 5;
  const int mrow = (wg - 1) * 64 + 16 * warp + (lane >> 2);
  const uint32_t st0 = (uint32_t)__cvta_generic_to_shared(smem);
  float acc[128];
  int it = 0;  // chunks consumed so far
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int tile = item / nblocks, n0 = item % nblocks * C::OUT_N;
    const int r0 = tile * C::BM;
    // padding is a suffix of an expert's last tile: a warpgroup whose first row is padding has no real row (read by
    // one lane: ptxas must see the wgmma branch uniform)
    const bool active = __shfl_sync(0xffffffffu, p.sorted_rows[r0 + (wg - 1) * 64] >= 0, 0);
    int rid[2];
    float wq[2] = {0.f, 0.f};
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {  // read before the MMAs: their latency hides under them
      rid[hf] = p.sorted_rows[r0 + mrow + 8 * hf];
      if (!C::GATED && rid[hf] >= 0) wq[hf] = round_to<T>(p.topk_w[rid[hf]]);
    }
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    for (int kc = 0; kc < nk; ++kc, ++it) {
      const int s = it % C::STAGES;
      mbar_wait(full0 + 8 * s, (it / C::STAGES) & 1);
      if (!active) {
        mbar_arrive(empty0 + 8 * s);
        continue;
      }
      const uint32_t a_addr = st0 + s * C::STAGE + (wg - 1) * 64 * 128, b_addr = st0 + s * C::STAGE + C::A_BYTES;
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < C::BK / 16; ++kk)  // 16 columns (32 bytes) of the panel per MMA
        wgmma_m64n256k16_ss<T>(acc, wg_desc(a_addr + kk * 32, 16, 1024), wg_desc(b_addr + kk * 32, 16, 1024));
      wg_commit();
      if (kc > 0) {  // chunk it - 1's MMAs are done: release its stage
        wg_wait<1>();
        mbar_arrive(empty0 + 8 * ((it - 1) % C::STAGES));
      }
    }
    if (!active) continue;  // no real row: nothing to write
    wg_wait<0>();
    mbar_arrive(empty0 + 8 * ((it - 1) % C::STAGES));  // the item's last stage: the loader is into the next item
    wg_pin(acc);

    if constexpr (C::WIDE) {
      // 16-byte stores: lane q of a quad holds words (2 columns) q of blocks nb0..nb0 + 3; a 4 x 4 transpose of words
      // across the quad gives it the 4 words of block nb0 + q, 8 consecutive columns. A warp's store then fills 8 rows
      // x 64 bytes (whole 32-byte sectors, not half of each), and a quarter as many stores go out. The quad shares its
      // rows (lane / 4), so rid is quad-uniform; the shuffles still run on every lane (only the store is predicated),
      // except in a warp whose 8 rows are all padding, which skips them (the layer 0.8-3.8% faster at 4,096-8,192
      // tokens, measured).
      const int q4 = lane & 3;
      const bool hi2 = q4 & 2, odd = q4 & 1;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        if (!__any_sync(0xffffffffu, rid[hf] >= 0)) continue;  // a warp whose 8 rows are all padding: warp-uniform
        const int m = mrow + 8 * hf;
#pragma unroll
        for (int nb0 = 0; nb0 < C::OUT_N / 8; nb0 += 4) {
          // N is a multiple of 8 (ops_moe.cu): an 8-column block is wholly inside or outside; n0 is warp-uniform, so a
          // group of 4 blocks all outside skips its shuffles on every lane alike
          if (n0 + nb0 * 8 >= p.N) break;
          uint32_t w[4];  // w[j]: columns 8 (nb0 + j) + 2 q4 + {0, 1}
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int nb = nb0 + j;
            float v[2];
#pragma unroll
            for (int q = 0; q < 2; ++q) v[q] = moe_out_value<T, C>(acc, nb, hf, q, wq[hf]);
            w[j] = pack2<T>(v[0], v[1]);
          }
          // The quad's words as a 4 x 4 matrix [lane q4][block j] = [[A, B], [C, D]] (2 x 2 blocks): swapping B and C
          // across lanes q4 ^ 2, then transposing each 2 x 2 block across lanes q4 ^ 1, gives [[A', C'], [B', D']], the
          // transpose: lane q4 holds block nb0 + q4's words of lanes 0-3 in order, its columns 0-7. Selects, not
          // indexing by lane: w stays in registers.
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const uint32_t r = __shfl_xor_sync(0xffffffffu, hi2 ? w[j] : w[j + 2], 2);
            if (hi2) w[j] = r;
            else w[j + 2] = r;
          }
#pragma unroll
          for (int j = 0; j < 4; j += 2) {
            const uint32_t r = __shfl_xor_sync(0xffffffffu, odd ? w[j] : w[j + 1], 1);
            if (odd) w[j] = r;
            else w[j + 1] = r;
          }
          const int n = n0 + (nb0 + q4) * 8;
          if (rid[hf] >= 0 && n < p.N) {
            T* orow = static_cast<T*>(p.out) + (C::GATED ? (int64_t)(r0 + m) : (int64_t)rid[hf]) * p.N;
            *reinterpret_cast<uint4*>(orow + n) = make_uint4(w[0], w[1], w[2], w[3]);  // N, n0: multiples of 8
          }
        }
      }
    } else {  // a 4-byte store per column pair: tiles mostly padding skip the padding rows' work
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        if (rid[hf] < 0) continue;
        const int m = mrow + 8 * hf;
        T* orow = static_cast<T*>(p.out) + (C::GATED ? (int64_t)(r0 + m) : (int64_t)rid[hf]) * p.N;
#pragma unroll
        for (int nb = 0; nb < C::OUT_N / 8; ++nb) {
          const int n = n0 + nb * 8 + 2 * (lane & 3);
          if (n >= p.N) continue;  // N is even, so n + 1 < N too
          float v[2];
#pragma unroll
          for (int q = 0; q < 2; ++q) v[q] = moe_out_value<T, C>(acc, nb, hf, q, wq[hf]);
          *reinterpret_cast<uint32_t*>(orow + n) = pack2<T>(v[0], v[1]);
        }
      }
    }
  }
#else
  pdl_wait();
#endif
}

}  // namespace
}  // namespace fdl
