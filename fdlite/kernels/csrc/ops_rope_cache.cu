// Rotary embedding (NeoX / rotate_half layout) fused with Qwen3's per-head q/k RMSNorm and the
// KV-cache write, from the fused qkv projection: one pass over qkv instead of split + norm + rope +
// scatter (each a Paddle kernel that does nothing on sm_90 with PyPI's wheel; see ops_common.cuh).
//
//   qkv [T, (h + 2 kvh) d] -> q [T, h, d] (normed, rotated);
//   k (normed, rotated) and v go to k_cache / v_cache [num_blocks + 1, kvh, block_size, d] at each
//   token's slot: cache row ((slot / block_size) * kvh + head) * block_size + slot % block_size.
//   A negative slot writes nothing (padded tokens may also point at the scratch block).
//
// FP8 caches (kv_cache_dtype="fp8", fdl_rope_qk_norm_cache_fp8): k and v are rounded to the model dtype (what a
// model-dtype cache would hold), then each (token, KV head) vector is written as e4m3 bits of value / scale with
// scale = amax / 448 into a float32 scale per cache row, as fdlite/kvcache/fp8_cache.py does on the CPU.
//
// cos / sin are the CPU path's tables [max_positions, d] (llama3 scaling already folded in), float32
// or the model dtype. Arithmetic in float32; the q/k norm output is rounded to the model dtype
// before rotation (as the CPU path / Hugging Face, where the norm is a separate op).
//
// Two kernels, the same arithmetic (outputs equal bit for bit): rope_cache_kernel, 32 lanes a head and pairs of
// elements per access, for small decode batches (latency-bound) and shapes without whole 16-byte chunks; and from
// kRopeWideFrom tokens (FP8 caches: kRopeWideFromF8) rope_cache_wide_kernel, 8 lanes a head, 4 heads a warp at once
// and 16-byte accesses (FP8: 8-byte stores of e4m3 bits), for larger decode steps and the memory-bound prefill pass
// (the first's 4-byte accesses and one head after another reached about 64% of HBM bandwidth at 8k tokens of
// Qwen3-30B-A3B under Nsight Compute; the op at 8,192 tokens, H100: 81.6 -> 67.2 us; over an FP8 cache, one byte a
// store, 83.1 -> 59.5 us at Qwen3-0.6B's heads). Its q/k norm adds the sum of squares in the first kernel's order,
// so the float is the same.
#include <type_traits>

#include "ops_common.cuh"

namespace fdl {
namespace {

// rope_cache_kernel: heads of one token per warp (HPW 4: they share its cos / sin row) from this many tokens on, for
// the shapes and caches the wide kernel does not take. Below it one head per warp, as many warps as heads in flight
// (a decode step's few tokens are latency-bound: 4 heads a warp took 3.3 us at one token against 1.9).
constexpr int64_t kRopeGroupFrom = 512;
// rope_cache_wide_kernel from this many tokens (shapes of whole 16-byte chunks): where it overtook one head a warp on
// the H100 at Qwen3-0.6B's heads (docs/benchmarks.md, "Elementwise ops"; one head a warp vs wide, bf16 cache: 64
// tokens 2.40 vs 2.54 us, 128: 2.77 vs 2.67, 256: 4.08 vs 3.15; FP8 cache: 128: 3.28 vs 3.57, 256: 4.65 vs 4.24).
constexpr int64_t kRopeWideFrom = 128, kRopeWideFromF8 = 256;

// The cache row of a token's slot for KV head j: ((slot / block_size) * kvh + j) * block_size + slot % block_size,
// named once for both kernels. I: the division's type, int64_t, or unsigned where the caller knows the slot fits
// (rope_cache_wide_kernel: a 32-bit division, cheaper than the 64-bit one).
template <typename I>
__device__ __forceinline__ int64_t slot_cache_row(I slot, int block_size, int kvh, int j) {
  const I bs = (I)block_size;
  return ((int64_t)(slot / bs) * kvh + j) * block_size + slot % bs;
}

// One warp per (token, group of HPW consecutive heads) of q, k and v heads: the token's cos / sin row is read once per
// group (read per head, those table reads were 3x the qkv bytes at head_dim 128; HPW 4 from kRopeGroupFrom tokens).
// Lane l holds VEC consecutive pairs (i, i + d/2), i = VEC l + 32 VEC p + v, so the rotate_half partner is in the same
// thread and every load and store moves VEC elements (VEC = 2 when d/2 is even). STEPS = ceil(d/2 / (32 VEC)).
// Small decode steps (below kRopeWideFrom / kRopeWideFromF8 tokens), shapes without whole 16-byte chunks and float32
// models over FP8 caches; its arithmetic (the sum of squares' order included) is the reference that
// rope_cache_wide_kernel reproduces.
template <typename T, typename C, int STEPS, int VEC, int HPW, bool F8>
__global__ void rope_cache_kernel(T* __restrict__ q_out, void* __restrict__ k_cache, void* __restrict__ v_cache,
                                  float* __restrict__ k_scale, float* __restrict__ v_scale, const T* __restrict__ qkv, const int64_t* __restrict__ positions,
                                  const int64_t* __restrict__ slots, const C* __restrict__ cos_t,
                                  const C* __restrict__ sin_t, const T* __restrict__ qw, const T* __restrict__ kw,
                                  int64_t tokens, int h, int kvh, int d, int block_size, int64_t max_pos,
                                  bool qk_norm, float eps) {
  pdl_trigger();
  pdl_wait();
  using VT = Vec<T, VEC>;
  using VC = Vec<C, VEC>;
  const int heads = h + 2 * kvh, groups = (heads + HPW - 1) / HPW;
  const int64_t unit = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (unit >= tokens * groups) return;
  const int lane = threadIdx.x & 31;
  const int64_t t = unit / groups;
  const int hd0 = (int)(unit - t * groups) * HPW;
  const int hd_end = min(heads, hd0 + HPW);
  const int half = d >> 1;
  const int64_t slot = hd_end > h ? slots[t] : -1;  // k / v heads in the group: the token's cache slot
  // the token's cos / sin, when the group rotates a head (q or k)
  VC c1[STEPS], c2[STEPS], s1[STEPS], s2[STEPS];
  if (hd0 < h + kvh) {
    int64_t pos = positions[t];
    pos = pos < 0 ? 0 : (pos >= max_pos ? max_pos - 1 : pos);
    const C* cr = cos_t + pos * d;
    const C* sr = sin_t + pos * d;
#pragma unroll
    for (int p = 0; p < STEPS; ++p) {
      const int i = VEC * lane + 32 * VEC * p;
      if (i < half) {
        c1[p] = *reinterpret_cast<const VC*>(cr + i);
        c2[p] = *reinterpret_cast<const VC*>(cr + i + half);
        s1[p] = *reinterpret_cast<const VC*>(sr + i);
        s2[p] = *reinterpret_cast<const VC*>(sr + i + half);
      }
    }
  }
  // the group's heads loaded together (their loads in flight at once), then each normed, rotated and stored
  VT xa[HPW][STEPS], xb[HPW][STEPS];
#pragma unroll
  for (int u = 0; u < HPW; ++u) {
    const T* src = qkv + t * (int64_t)heads * d + (int64_t)(hd0 + u) * d;
#pragma unroll
    for (int p = 0; p < STEPS; ++p) {
      const int i = VEC * lane + 32 * VEC * p;
      if (hd0 + u < hd_end && i < half) {
        xa[u][p] = *reinterpret_cast<const VT*>(src + i);
        xb[u][p] = *reinterpret_cast<const VT*>(src + i + half);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < HPW; ++u) {
    const int hd = hd0 + u;
    if (hd >= hd_end) break;
    float x1[STEPS][VEC], x2[STEPS][VEC];
#pragma unroll
    for (int p = 0; p < STEPS; ++p) {
      const int i = VEC * lane + 32 * VEC * p;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        x1[p][v] = i < half ? to_f<T>(xa[u][p].v[v]) : 0.f;
        x2[p][v] = i < half ? to_f<T>(xb[u][p].v[v]) : 0.f;
      }
    }
    const bool is_q = hd < h, is_k = !is_q && hd < h + kvh;
    if (is_q || is_k) {
      if (qk_norm) {
        float ss = 0.f;
#pragma unroll
        for (int p = 0; p < STEPS; ++p)
#pragma unroll
          for (int v = 0; v < VEC; ++v) ss += x1[p][v] * x1[p][v] + x2[p][v] * x2[p][v];
        const float inv = rsqrtf(warp_sum(ss) / (float)d + eps);
        const T* w = is_q ? qw : kw;
#pragma unroll
        for (int p = 0; p < STEPS; ++p) {
          const int i = VEC * lane + 32 * VEC * p;
          if (i < half) {
            const VT w1 = *reinterpret_cast<const VT*>(w + i), w2 = *reinterpret_cast<const VT*>(w + i + half);
#pragma unroll
            for (int v = 0; v < VEC; ++v) {
              x1[p][v] = round_to<T>(round_to<T>(x1[p][v] * inv) * to_f<T>(w1.v[v]));
              x2[p][v] = round_to<T>(round_to<T>(x2[p][v] * inv) * to_f<T>(w2.v[v]));
            }
          }
        }
      }
#pragma unroll
      for (int p = 0; p < STEPS; ++p) {
        const int i = VEC * lane + 32 * VEC * p;
        if (i < half) {
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            const float a = x1[p][v], b = x2[p][v];
            // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
            x1[p][v] = a * to_f<C>(c1[p].v[v]) - b * to_f<C>(s1[p].v[v]);
            x2[p][v] = b * to_f<C>(c2[p].v[v]) + a * to_f<C>(s2[p].v[v]);
          }
        }
      }
    }
    T* dst;
    if (is_q) {
      dst = q_out + (t * h + hd) * (int64_t)d;
    } else {
      if (slot < 0) continue;  // padded tokens write no cache row (the whole warp: uniform)
      const int j = is_k ? hd - h : hd - h - kvh;
      const int64_t row = slot_cache_row(slot, block_size, kvh, j);
      if constexpr (F8) {
        float amax = 0.f;
#pragma unroll
        for (int p = 0; p < STEPS; ++p)
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            x1[p][v] = round_to<T>(x1[p][v]);  // 0 for i >= half
            x2[p][v] = round_to<T>(x2[p][v]);
            amax = fmaxf(amax, fmaxf(fabsf(x1[p][v]), fabsf(x2[p][v])));
          }
        amax = warp_max(amax);
        const float sc = amax > 0.f ? amax / 448.f : 1.f;
        uint8_t* d8 = static_cast<uint8_t*>(is_k ? k_cache : v_cache) + row * d;
#pragma unroll
        for (int p = 0; p < STEPS; ++p) {
          const int i = VEC * lane + 32 * VEC * p;
          if (i < half) {
#pragma unroll
            for (int v = 0; v < VEC; ++v) {
              d8[i + v] = f_to_e4m3(x1[p][v] / sc);
              d8[i + v + half] = f_to_e4m3(x2[p][v] / sc);
            }
          }
        }
        if (lane == 0) (is_k ? k_scale : v_scale)[row] = sc;
        continue;
      }
      dst = static_cast<T*>(is_k ? k_cache : v_cache) + row * d;
    }
#pragma unroll
    for (int p = 0; p < STEPS; ++p) {
      const int i = VEC * lane + 32 * VEC * p;
      if (i < half) {
        VT a, b;
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          a.v[v] = from_f<T>(x1[p][v]);
          b.v[v] = from_f<T>(x2[p][v]);
        }
        *reinterpret_cast<VT*>(dst + i) = a;
        *reinterpret_cast<VT*>(dst + i + half) = b;
      }
    }
  }
}

// ---------------------------------------------------------------- the wide path (large T)
// Lanes per head and elements per lane and step: lane j of a head holds, for each step p, the chunk of 8 elements
// i = 8 j + 64 p + e (e < 8) and their rotate_half partners i + d/2, so a bf16 / fp16 chunk is one 16-byte access.
// Shapes: d/2 a multiple of 8 (whole chunks, 16-byte aligned rows), d <= 256 (STEPS = ceil(d/2 / 64) <= 2).
constexpr int kWideLanes = 8;
constexpr int kWideWarps = 8;  // warps per block: a block's units span about one token's head groups (shared rows)

// A chunk of 8 elements of T or C as 16-byte pieces (2 for float). Not ops_common.cuh's Vec<X, 8>: held as elements
// of X, the chunks are unpacked at their loads instead of at their uses, which changes the generated code of every
// wide kernel (the measured code is this one).
template <typename X>
struct Chunk {
  static constexpr int kPieces = 8 * (int)sizeof(X) / 16;
  uint4 p[kPieces];
};

// qkv is read once: its 16-byte loads skip L1 (L1::no_allocate), which so keeps the cos / sin rows that every warp
// of a token reads. Volatile: kept after pdl_wait().
__device__ __forceinline__ uint4 ld_stream16(const void* ptr) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(ptr));
  return r;
}

// Brings the line of `ptr` into L1 without holding a register for it (volatile: kept after pdl_wait()).
__device__ __forceinline__ void prefetch_l1(const void* ptr) { asm volatile("prefetch.global.L1 [%0];" ::"l"(ptr)); }

template <typename X>
__device__ __forceinline__ Chunk<X> ld_chunk_stream(const X* ptr) {
  Chunk<X> c;
#pragma unroll
  for (int k = 0; k < Chunk<X>::kPieces; ++k) c.p[k] = ld_stream16(reinterpret_cast<const uint4*>(ptr) + k);
  return c;
}

template <typename X>
__device__ __forceinline__ Chunk<X> ld_chunk(const X* __restrict__ ptr) {
  Chunk<X> c;
#pragma unroll
  for (int k = 0; k < Chunk<X>::kPieces; ++k) c.p[k] = __ldg(reinterpret_cast<const uint4*>(ptr) + k);
  return c;
}

// Element e of a chunk as float (to_f of it: exact). memcpy: the bits move between types without aliasing them.
template <typename X>
__device__ __forceinline__ float chunk_f(const Chunk<X>& c, int e) {
  X x;
  memcpy(&x, reinterpret_cast<const char*>(c.p) + e * sizeof(X), sizeof(X));
  return to_f<X>(x);
}

template <typename X>
__device__ __forceinline__ void st_chunk(X* ptr, const float (&f)[8]) {
  Chunk<X> c;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const X x = from_f<X>(f[e]);
    memcpy(reinterpret_cast<char*>(c.p) + e * sizeof(X), &x, sizeof(X));
  }
#pragma unroll
  for (int k = 0; k < Chunk<X>::kPieces; ++k) reinterpret_cast<uint4*>(ptr)[k] = c.p[k];
}

// The head's sum of squares as rope_cache_kernel's warp_sum forms it, bit for bit. There lane l (of 32) holds the
// pairs i = 2 l + 64 p + v, here lane j (of the head's 8) holds those of its lanes 4 j + m, m < 4: part[m] is lane
// 4 j + m's partial sum, added in its order (p, then v). warp_sum's butterfly adds lanes l and l ^ o for o = 16, 8,
// 4, 2, 1: bits 4..2 of l are bits 2..0 of j, bits 1..0 are m's. So: o = 16, 8, 4 are xor-4, 2, 1 shuffles over j,
// each lane keeping half of what is left of m (the other half sent to its partner, who keeps it), 4 values to 1;
// then o = 2 (m ^ 2, now held by lane j ^ 4) and o = 1 (m ^ 1, by lane j ^ 2). Each step adds the same two floats as
// warp_sum's (a + b == b + a), so the result is its float; 6 shuffles for 4 heads, where warp_sum takes 5 per head.
__device__ __forceinline__ float head_sum_of_squares(const float (&part)[4], int j) {
  constexpr unsigned all = 0xffffffffu;
  const bool hi = j & 4, mid = j & 2;
  const float a0 = __fadd_rn(hi ? part[2] : part[0], __shfl_xor_sync(all, hi ? part[0] : part[2], 4));
  const float a1 = __fadd_rn(hi ? part[3] : part[1], __shfl_xor_sync(all, hi ? part[1] : part[3], 4));
  const float b = __fadd_rn(mid ? a1 : a0, __shfl_xor_sync(all, mid ? a0 : a1, 2));  // m = (hi ? 2 : 0) + (mid ? 1 : 0)
  const float c = __fadd_rn(b, __shfl_xor_sync(all, b, 1));
  const float e = __fadd_rn(c, __shfl_xor_sync(all, c, 4));
  return __fadd_rn(e, __shfl_xor_sync(all, e, 2));
}

// One warp per (token, group of 4 consecutive heads), as rope_cache_kernel's HPW = 4 path (the token's cos / sin row
// read once per group), but 8 lanes a head: lane 8 g + j holds head hd0 + g's chunks (see kWideLanes), the 4 heads
// normed and rotated at once. Per lane and step (bf16 / fp16; float: twice the 16-byte pieces): 2 16-byte loads of
// qkv, 2 of the norm weight, 4 chunks of cos / sin (the same for the group's 4 heads), 2 16-byte stores. The
// arithmetic is rope_cache_kernel's, in the same order with the same rounding, its fused multiply-adds spelled out
// as that kernel's compiled code has them (fma(x1, x1, x2 x2) in the sum of squares, fma(a, c1, -(b s1)) and
// fma(b, c2, a s2) in the rotation): the outputs are the same bits. At most 64 registers at one step: 32 warps an SM.
// F8: the cache rows as rope_cache_kernel writes them (e4m3 bits, the head's amax from its 8 lanes' shuffles).
template <typename T, typename C, int STEPS, bool F8>
__global__ void __launch_bounds__(kWideWarps * 32, STEPS == 1 ? 4 : 2)
    rope_cache_wide_kernel(T* __restrict__ q_out, void* __restrict__ k_cache, void* __restrict__ v_cache,
                           float* __restrict__ k_scale, float* __restrict__ v_scale, const T* __restrict__ qkv,
                           const int64_t* __restrict__ positions,
                           const int64_t* __restrict__ slots, const C* __restrict__ cos_t,
                           const C* __restrict__ sin_t, const T* __restrict__ qw, const T* __restrict__ kw,
                           int64_t tokens, int h, int kvh, int d, int block_size, int64_t max_pos, bool qk_norm,
                           float eps) {
  pdl_trigger();
  pdl_wait();
  // 32-bit unit arithmetic: the host takes this kernel only while tokens x groups < 2^31
  const int heads = h + 2 * kvh, groups = (heads + 3) / 4;
  const unsigned unit = blockIdx.x * kWideWarps + (threadIdx.x >> 5);
  if (unit >= (unsigned)tokens * groups) return;  // the whole warp: the shuffles below see all 32 lanes
  const int lane = threadIdx.x & 31, j = lane & (kWideLanes - 1);
  const int64_t t = unit / (unsigned)groups;
  const int hd0 = (int)(unit - (unsigned)t * groups) * 4;
  const int hd = hd0 + lane / kWideLanes;
  const int half = d >> 1;
  const bool live = hd < heads;  // a group past the last head has idle lanes (they still shuffle)
  const bool is_q = hd < h, is_k = !is_q && hd < h + kvh, rot = is_q || is_k;
  const int64_t slot = live && !is_q ? slots[t] : -1;
  Chunk<T> ra[STEPS], rb[STEPS];
#pragma unroll
  for (int p = 0; p < STEPS; ++p) {
    const int i = kWideLanes * j + 64 * p;
    if (live && i < half) {
      const T* src = qkv + (t * heads + hd) * (int64_t)d + i;
      ra[p] = ld_chunk_stream(src);
      rb[p] = ld_chunk_stream(src + half);
    }
  }
  // the norm weight's chunks, loaded with the rest (not after the sum: one latency less)
  Chunk<T> w1[STEPS], w2[STEPS];
  if (qk_norm && rot) {
    const T* w = is_q ? qw : kw;
#pragma unroll
    for (int p = 0; p < STEPS; ++p) {
      const int i = kWideLanes * j + 64 * p;
      if (i < half) {
        w1[p] = ld_chunk(w + i);
        w2[p] = ld_chunk(w + i + half);
      }
    }
  }
  const bool rotates = hd0 < h + kvh;  // the group rotates a head (uniform over the warp)
  int64_t pos = rotates ? positions[t] : 0;
  pos = pos < 0 ? 0 : (pos >= max_pos ? max_pos - 1 : pos);
  if (rotates && qk_norm) {
    // cos / sin are read after the norm (fewer registers live across it: 64 with 32 warps an SM); their lines are
    // requested before it, so the table's L2 / DRAM latency overlaps the norm's sums and shuffles
#pragma unroll
    for (int p = 0; p < STEPS; ++p) {
      const int i = kWideLanes * j + 64 * p;
      if (i < half) {
        prefetch_l1(cos_t + pos * d + i);
        prefetch_l1(cos_t + pos * d + i + half);
        prefetch_l1(sin_t + pos * d + i);
        prefetch_l1(sin_t + pos * d + i + half);
      }
    }
  }
  float x1[STEPS][8], x2[STEPS][8];
#pragma unroll
  for (int p = 0; p < STEPS; ++p) {
    const bool in = live && kWideLanes * j + 64 * p < half;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      x1[p][e] = in ? chunk_f(ra[p], e) : 0.f;
      x2[p][e] = in ? chunk_f(rb[p], e) : 0.f;
    }
  }
  if (qk_norm) {  // every lane, v heads' and idle ones too: the shuffles need the whole warp
    float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int p = 0; p < STEPS; ++p)
#pragma unroll
      for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int v = 0; v < 2; ++v) {
          const float a = x1[p][2 * m + v], b = x2[p][2 * m + v];
          part[m] = __fadd_rn(part[m], __fmaf_rn(a, a, __fmul_rn(b, b)));
        }
    const float ss = head_sum_of_squares(part, j);
    if (rot) {
      const float inv = rsqrtf(ss / (float)d + eps);
#pragma unroll
      for (int p = 0; p < STEPS; ++p) {
        if (kWideLanes * j + 64 * p < half) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            x1[p][e] = round_to<T>(__fmul_rn(round_to<T>(__fmul_rn(x1[p][e], inv)), chunk_f(w1[p], e)));
            x2[p][e] = round_to<T>(__fmul_rn(round_to<T>(__fmul_rn(x2[p][e], inv)), chunk_f(w2[p], e)));
          }
        }
      }
    }
  }
  if (!live) return;
  if (rot) {
    // cos / sin: prefetched above, shared by the token's warps
#pragma unroll
    for (int p = 0; p < STEPS; ++p) {
      const int i = kWideLanes * j + 64 * p;
      if (i < half) {
        const Chunk<C> c1 = ld_chunk(cos_t + pos * d + i), c2 = ld_chunk(cos_t + pos * d + i + half);
        const Chunk<C> s1 = ld_chunk(sin_t + pos * d + i), s2 = ld_chunk(sin_t + pos * d + i + half);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float a = x1[p][e], b = x2[p][e];
          // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
          x1[p][e] = __fmaf_rn(a, chunk_f(c1, e), -__fmul_rn(b, chunk_f(s1, e)));
          x2[p][e] = __fmaf_rn(b, chunk_f(c2, e), __fmul_rn(a, chunk_f(s2, e)));
        }
      }
    }
  }
  T* dst;
  if (is_q) {
    dst = q_out + (t * h + hd) * (int64_t)d;
  } else {
    if (slot < 0) return;  // padded tokens write no cache row (the token's warps: whole 8-lane heads)
    const int jh = is_k ? hd - h : hd - h - kvh;
    // unsigned: a 32-bit division (a cache of 2^32 slots would not fit in memory)
    const int64_t row = slot_cache_row((unsigned)slot, block_size, kvh, jh);
    if constexpr (F8) {
      // rope_cache_kernel's FP8 rule: the values rounded to T, scale = amax / 448 over the head's d values (a max:
      // the same float in any order), e4m3 bits of value / scale; 8 bytes a chunk, one store
      float amax = 0.f;
#pragma unroll
      for (int p = 0; p < STEPS; ++p)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          x1[p][e] = round_to<T>(x1[p][e]);  // 0 for the chunks past d/2
          x2[p][e] = round_to<T>(x2[p][e]);
          amax = fmaxf(amax, fmaxf(fabsf(x1[p][e]), fabsf(x2[p][e])));
        }
      // the head's 8 lanes (all present: heads are live or not, slots valid or not, by whole heads)
      const unsigned head_lanes = 0xffu << (lane & ~(kWideLanes - 1));
      amax = fmaxf(amax, __shfl_xor_sync(head_lanes, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(head_lanes, amax, 2));
      amax = fmaxf(amax, __shfl_xor_sync(head_lanes, amax, 4));
      const float sc = amax > 0.f ? amax / 448.f : 1.f;
      uint8_t* d8 = static_cast<uint8_t*>(is_k ? k_cache : v_cache) + row * d;
#pragma unroll
      for (int p = 0; p < STEPS; ++p) {
        const int i = kWideLanes * j + 64 * p;
        if (i < half) {
          uint8_t b1[8], b2[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            b1[e] = f_to_e4m3(x1[p][e] / sc);
            b2[e] = f_to_e4m3(x2[p][e] / sc);
          }
          uint2 u1, u2;
          memcpy(&u1, b1, 8);
          memcpy(&u2, b2, 8);
          *reinterpret_cast<uint2*>(d8 + i) = u1;
          *reinterpret_cast<uint2*>(d8 + i + half) = u2;
        }
      }
      if (j == 0) (is_k ? k_scale : v_scale)[row] = sc;
      return;
    }
    dst = static_cast<T*>(is_k ? k_cache : v_cache) + row * d;
  }
#pragma unroll
  for (int p = 0; p < STEPS; ++p) {
    const int i = kWideLanes * j + 64 * p;
    if (i < half) {
      st_chunk(dst + i, x1[p]);
      st_chunk(dst + i + half, x2[p]);
    }
  }
}

template <typename T, typename C, bool F8>
void launch_rope(T* q, void* kc, void* vc, float* ksc, float* vsc, const T* qkv, const int64_t* pos, const int64_t* slots, const C* cs, const C* sn,
                 const T* qw, const T* kw, int64_t tokens, int h, int kvh, int d, int bs, int64_t max_pos, bool norm,
                 float eps, cudaStream_t s) {
  if (tokens == 0) return;
  const int half = d / 2;
  // the wide path: whole 16-byte chunks (d/2 a multiple of 8 elements, every base 16-byte aligned, as fresh tensors
  // are) and 32-bit unit numbers; the rest takes rope_cache_kernel, as do float32 models over FP8 caches (the wide
  // kernel's instance spills there)
  if constexpr (!F8 || sizeof(T) == 2) {
    const int64_t wide_units = tokens * ceil_div(h + 2 * kvh, 4);
    if (tokens >= (F8 ? kRopeWideFromF8 : kRopeWideFrom) && half % 8 == 0 && wide_units < (int64_t{1} << 31) &&
        aligned16(q) && aligned16(kc) && aligned16(vc) && aligned16(qkv) && aligned16(cs) && aligned16(sn) &&
        (!norm || (aligned16(qw) && aligned16(kw)))) {
      const unsigned blocks = (unsigned)ceil_div(wide_units, kWideWarps);
#define FDL_ROPE_W(STEPS)                                                                                        \
  launch("rope_cache_wide_kernel", rope_cache_wide_kernel<T, C, STEPS, F8>, blocks, kWideWarps * 32, 0, s,         \
         pdl_rows(tokens), q, kc, vc, ksc, vsc, qkv, pos, slots, cs, sn, qw, kw, tokens, h, kvh, d, bs, max_pos, norm, eps)
      if (half <= 64) FDL_ROPE_W(1);
      else FDL_ROPE_W(2);
#undef FDL_ROPE_W
      return;
    }
  }
  const int warps = 4;
  const int hpw = tokens >= kRopeGroupFrom ? 4 : 1;
  const int64_t units = tokens * ceil_div(h + 2 * kvh, hpw);
  const unsigned blocks = (unsigned)ceil_div(units, warps);
#define FDL_ROPE_H(STEPS, VEC, HPW)                                                                                 \
  launch("rope_cache_kernel", rope_cache_kernel<T, C, STEPS, VEC, HPW, F8>, blocks, warps * 32, 0, s, pdl_rows(tokens), q, kc, vc, ksc, vsc, qkv, pos, slots, cs, sn, qw, kw, \
                                                            tokens, h, kvh, d, bs, max_pos, norm, eps)
#define FDL_ROPE(STEPS, VEC)                    \
  do {                                          \
    if (hpw == 4) FDL_ROPE_H(STEPS, VEC, 4);    \
    else FDL_ROPE_H(STEPS, VEC, 1);             \
  } while (0)
  if (half % 2 == 0) {  // every real head_dim (64, 80, 96, 128, 256): pairs of elements per load
    if (half <= 64) FDL_ROPE(1, 2);
    else FDL_ROPE(2, 2);
  } else {
    if (half <= 32) FDL_ROPE(1, 1);
    else if (half <= 64) FDL_ROPE(2, 1);
    else FDL_ROPE(4, 1);
  }
#undef FDL_ROPE
#undef FDL_ROPE_H
}

}  // namespace
}  // namespace fdl

using namespace fdl;

// fdl_rope_qk_norm_cache(qkv, positions, slot_mapping, cos, sin, q_norm_w, k_norm_w, k_cache, v_cache,
//                        num_heads, qk_norm, epsilon) -> q [T, h, d]; k_cache / v_cache written in place.
// q_norm_w / k_norm_w [d] are read only with qk_norm (pass any GPU tensor otherwise).
// fdl_rope_qk_norm_cache_fp8(..., k_cache, v_cache, k_scale, v_scale, ...): the same into an FP8 cache (uint8
// e4m3 bits [blocks, kv_heads, block_size, head_dim] and float32 scales [blocks, kv_heads, block_size]).
namespace {
std::vector<paddle::Tensor> rope_impl(const char* op, const paddle::Tensor& qkv, const paddle::Tensor& positions,
                                      const paddle::Tensor& slots, const paddle::Tensor& cos_t,
                                      const paddle::Tensor& sin_t, const paddle::Tensor& qw, const paddle::Tensor& kw,
                                      paddle::Tensor& k_cache, paddle::Tensor& v_cache, paddle::Tensor* k_scale,
                                      paddle::Tensor* v_scale, int num_heads, bool qk_norm, float eps) {
  const bool f8 = k_scale != nullptr;
  for (const paddle::Tensor* t : std::initializer_list<const paddle::Tensor*>{&qkv, &positions, &slots, &cos_t, &sin_t, &k_cache, &v_cache}) check_gpu(*t, op, "input");
  const auto& cs = k_cache.shape();
  PD_CHECK(cs.size() == 4 && v_cache.shape() == cs, op, ": caches must be [blocks, kv_heads, block_size, head_dim]");
  const int kvh = (int)cs[1], bs = (int)cs[2], d = (int)cs[3];
  PD_CHECK(d % 2 == 0 && d <= 256, op, ": head_dim must be even and at most 256");
  PD_CHECK(num_heads > 0 && num_heads % kvh == 0, op, ": num_heads must be a multiple of kv_heads");
  const int64_t width = (int64_t)(num_heads + 2 * kvh) * d;
  PD_CHECK(!qkv.shape().empty() && qkv.shape().back() == width, op, ": qkv.shape[-1] must be (h + 2 kvh) * d");
  const int64_t tokens = qkv.numel() / width;
  PD_CHECK(positions.numel() == tokens && slots.numel() == tokens, op, ": positions / slot_mapping must be [T]");
  PD_CHECK(positions.dtype() == paddle::DataType::INT64 && slots.dtype() == paddle::DataType::INT64, op,
           ": positions and slot_mapping must be int64");
  if (f8) {
    check_fp8_caches(op, k_cache, v_cache, *k_scale, *v_scale, d);
  } else {
    PD_CHECK(k_cache.dtype() == qkv.dtype() && v_cache.dtype() == qkv.dtype(), op, ": caches must have qkv's dtype");
  }
  PD_CHECK(cos_t.shape().size() == 2 && cos_t.shape()[1] == d && sin_t.shape() == cos_t.shape() &&
               sin_t.dtype() == cos_t.dtype(),
           op, ": cos / sin must be [max_positions, head_dim] of one dtype");
  PD_CHECK(cos_t.dtype() == paddle::DataType::FLOAT32 || cos_t.dtype() == qkv.dtype(), op,
           ": cos / sin must be float32 or qkv's dtype");
  if (qk_norm) {
    check_gpu(qw, op, "q_norm_w");
    check_gpu(kw, op, "k_norm_w");
    PD_CHECK(qw.numel() == d && kw.numel() == d && qw.dtype() == qkv.dtype() && kw.dtype() == qkv.dtype(), op,
             ": q/k norm weights must be [head_dim] of qkv's dtype");
  }
  paddle::Tensor q = paddle::empty({tokens, num_heads, d}, qkv.dtype(), qkv.place());
  cudaStream_t s = stream_of(qkv);
  const int64_t max_pos = cos_t.shape()[0];
  float* ksc = f8 ? static_cast<float*>(k_scale->data()) : nullptr;
  float* vsc = f8 ? static_cast<float*>(v_scale->data()) : nullptr;
  FDL_FLOAT_SWITCH(qkv.dtype(), T, op, {
    const T* qwp = qk_norm ? static_cast<const T*>(qw.data()) : nullptr;
    const T* kwp = qk_norm ? static_cast<const T*>(kw.data()) : nullptr;
    auto go = [&](auto f8_tag) {
      constexpr bool F8 = decltype(f8_tag)::value;
      if (cos_t.dtype() == paddle::DataType::FLOAT32)
        launch_rope<T, float, F8>(static_cast<T*>(q.data()), k_cache.data(), v_cache.data(), ksc, vsc,
                                  static_cast<const T*>(qkv.data()), positions.data<int64_t>(), slots.data<int64_t>(),
                                  static_cast<const float*>(cos_t.data()), static_cast<const float*>(sin_t.data()), qwp,
                                  kwp, tokens, num_heads, kvh, d, bs, max_pos, qk_norm, eps, s);
      else
        launch_rope<T, T, F8>(static_cast<T*>(q.data()), k_cache.data(), v_cache.data(), ksc, vsc,
                              static_cast<const T*>(qkv.data()), positions.data<int64_t>(), slots.data<int64_t>(),
                              static_cast<const T*>(cos_t.data()), static_cast<const T*>(sin_t.data()), qwp, kwp,
                              tokens, num_heads, kvh, d, bs, max_pos, qk_norm, eps, s);
    };
    if (f8) go(std::true_type{});
    else go(std::false_type{});
  });
  FDL_CHECK_LAUNCH(op);
  return {q};
}
}  // namespace

std::vector<paddle::Tensor> RopeQkNormCache(const paddle::Tensor& qkv, const paddle::Tensor& positions,
                                            const paddle::Tensor& slots, const paddle::Tensor& cos_t,
                                            const paddle::Tensor& sin_t, const paddle::Tensor& qw,
                                            const paddle::Tensor& kw, paddle::Tensor& k_cache,
                                            paddle::Tensor& v_cache, int num_heads, bool qk_norm, float eps) {
  return rope_impl("fdl_rope_qk_norm_cache", qkv, positions, slots, cos_t, sin_t, qw, kw, k_cache, v_cache, nullptr,
                   nullptr, num_heads, qk_norm, eps);
}

std::vector<paddle::Tensor> RopeQkNormCacheFp8(const paddle::Tensor& qkv, const paddle::Tensor& positions,
                                               const paddle::Tensor& slots, const paddle::Tensor& cos_t,
                                               const paddle::Tensor& sin_t, const paddle::Tensor& qw,
                                               const paddle::Tensor& kw, paddle::Tensor& k_cache,
                                               paddle::Tensor& v_cache, paddle::Tensor& k_scale,
                                               paddle::Tensor& v_scale, int num_heads, bool qk_norm, float eps) {
  return rope_impl("fdl_rope_qk_norm_cache_fp8", qkv, positions, slots, cos_t, sin_t, qw, kw, k_cache, v_cache,
                   &k_scale, &v_scale, num_heads, qk_norm, eps);
}

PD_BUILD_OP(fdl_rope_qk_norm_cache)
    .Inputs({"QKV", "Positions", "SlotMapping", "Cos", "Sin", "QNormW", "KNormW", "KCache", "VCache"})
    .Outputs({"Q", "KCacheOut", "VCacheOut"})
    .Attrs({"num_heads: int", "qk_norm: bool", "epsilon: float"})
    .SetInplaceMap({{"KCache", "KCacheOut"}, {"VCache", "VCacheOut"}})
    .SetKernelFn(PD_KERNEL(RopeQkNormCache));

PD_BUILD_OP(fdl_rope_qk_norm_cache_fp8)
    .Inputs({"QKV", "Positions", "SlotMapping", "Cos", "Sin", "QNormW", "KNormW", "KCache", "VCache", "KScale", "VScale"})
    .Outputs({"Q", "KCacheOut", "VCacheOut", "KScaleOut", "VScaleOut"})
    .Attrs({"num_heads: int", "qk_norm: bool", "epsilon: float"})
    .SetInplaceMap({{"KCache", "KCacheOut"}, {"VCache", "VCacheOut"}, {"KScale", "KScaleOut"}, {"VScale", "VScaleOut"}})
    .SetKernelFn(PD_KERNEL(RopeQkNormCacheFp8));
