// Token selection on the GPU: greedy argmax, and seeded sampling with temperature, top-k, top-p and
// min-p, with no host round trip and no host RNG state. Hand-written because Paddle's kernels do
// nothing on sm_90 with PyPI's wheel (ops_common.cuh) and because the draw must not depend on the
// batch: the noise of row s comes from a counter-based hash of (its request's 64-bit seed, its
// position, a round number), the same function the CPU sampler uses.
//
//   u(seed, pos, round) = ((splitmix64(seed ^ pos * 0x9E3779B97F4A7C15 ^ round * 0xD1B54A32D192ED03) >> 40)
//                          + 0.5) * 2^-24                       (float32 in (0, 1), uint64 wraparound)
//
// Filtering follows fdlite.sample.sampler.apply_top_k_top_p_min_p exactly: x = logits / temperature
// (float32 division); top-k keeps x >= the k-th largest (ties survive); top-p keeps x >= the value
// at which the descending cumulative mass of the top-k survivors first reaches p; min-p keeps
// x >= max(x) + log(min_p); the kept set is x >= the largest of the three thresholds. The two
// thresholds are found by a select, not a sort: a histogram of 1/64-nat bins below the max, then a
// radix select (11/11/10 bits) over the order-preserving integer image of float32 of the chosen
// bin's elements (in shared memory when they fit). Then inverse-CDF sampling in vocabulary order with
// u(seed, pos, 0): the first token whose inclusive cumulative weight exceeds floor(u * Z).
//
// Rows are read in chunks of kChunk entries, one block each (chunk_max_kernel, chunk_mass_kernel), so a row's
// passes spread over many SMs at any batch; the chunking changes no result (the first index among equal
// maxima, integer masses). Rows with top-k or top-p then take sample_kernel's select, one block per row.
//
// Masses are integers, w = round(exp(x - max x) * 2^44), summed exactly, so the result is
// deterministic (no order-dependent float atomics) and a CPU implementation of the same rule draws
// the same token except where expf differs in the last bit at a boundary. Tokens with
// exp(x - max x) < 2^-45 weigh 0 (never drawn; relative probability below 3e-14).
#include <math_constants.h>

#include "ops_common.cuh"

namespace fdl {
namespace {

constexpr int NT = 1024;  // threads per row (one block per row)
constexpr float kWeightScale = 17592186044416.f;  // 2^44

__host__ __device__ inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__host__ __device__ inline float uniform01(uint64_t seed, uint64_t pos, uint64_t round) {
  const uint64_t z = splitmix64(seed ^ (pos * 0x9E3779B97F4A7C15ull) ^ (round * 0xD1B54A32D192ED03ull));
  return ((float)(z >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

__device__ __forceinline__ float clean(float f) { return isnan(f) ? -CUDART_INF_F : f; }

// Order-preserving map float -> uint32 (larger float, larger key).
__device__ __forceinline__ uint32_t fkey(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float kfloat(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ uint64_t weight(float x, float mx) {
  return (uint64_t)__float2ull_rn(expf(x - mx) * kWeightScale);
}

// The min-p cut in x = logits / temperature units: x >= max x + log(min_p) survives; -inf (keep all) when off.
__device__ __forceinline__ float min_p_threshold(float mx, float mp) { return mp > 0.f ? mx + logf(mp) : -CUDART_INF_F; }

// Block-wide inclusive scan of uint64 (NT threads). `tmp` holds 32 values of shared memory.
__device__ uint64_t block_scan(uint64_t v, uint64_t* tmp) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint64_t n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += n;
  }
  __syncthreads();
  if (lane == 31) tmp[wid] = v;
  __syncthreads();
  if (wid == 0) {
    uint64_t w = tmp[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint64_t n = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += n;
    }
    tmp[lane] = w;
  }
  __syncthreads();
  return wid > 0 ? v + tmp[wid - 1] : v;
}

constexpr int NBINS = 2048;     // histogram bins per level
constexpr int CAND = 4096;      // candidates kept in shared memory after the coarse level
constexpr float BIN_PER_NAT = 64.f;  // coarse level: bins of 1/64 nat below the max; the last bin
                                     // holds everything 32 nats or more below it

// Histograms of exact 64-bit sums kept as two 32-bit halves: shared memory has native 32-bit atomic
// adds only (a 64-bit add would be a compare-and-swap loop), and integer sums stay deterministic.
struct Shared {
  uint32_t lo[NBINS], hi[NBINS];
  float cand[CAND];
  uint64_t tmp[32];
  uint64_t above, target;
  uint32_t prefix, ncand;
  int bin;
  float f0;
  int i0;
};

// (value, index) of the warp's maximum, the lowest index among equal values, in every lane.
__device__ __forceinline__ void warp_argmax(float& bv, int& bi) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > bv || (ov == bv && oi < bi)) {
      bv = ov;
      bi = oi;
    }
  }
}

// ------------------------------------------------------------------ chunked row passes
// A step of 256 rows with one 1,024-thread block a row read its logits at about 1.4 TB/s (one load in flight a
// thread), and a single row ran on one SM. A chunk block issues all of its thread's loads before using any.
constexpr int kChunk = 8192;           // vocabulary entries a chunk block reads
constexpr int kCT = 256;               // threads of a chunk block
constexpr int kPerT = kChunk / kCT;    // entries a thread, loaded at once
constexpr int kWalkPerT = kChunk / NT;  // entries a thread of sample_kernel walks in the drawn chunk

struct ChunkMax {
  float v;  // the chunk's maximum (NaN as -inf)
  int i;    // its first index; INT_MAX when every entry is -inf
};
static_assert(sizeof(ChunkMax) == sizeof(uint64_t), "the workspace holds ChunkMax and uint64 masses alike");

// Row index of thread t's u-th entry of the chunk starting at c0. VEC 4: 16-byte loads (V % 4 == 0 and the
// logits 16-byte aligned), else single floats; either way a thread's indices increase with u.
template <int VEC>
__device__ __forceinline__ int chunk_index(int c0, int u) {
  return VEC == 4 ? c0 + ((u >> 2) * kCT + (int)threadIdx.x) * 4 + (u & 3) : c0 + u * kCT + (int)threadIdx.x;
}

// This thread's entries of chunk c (NaN as -inf; -inf past the row's end). A whole chunk loads without
// bounds tests, so every load is issued before the first is used (a test per load kept them in a chain).
template <int VEC, bool WHOLE>
__device__ __forceinline__ void load_entries(const float* row, int c0, int V, float (&x)[kPerT]) {
  if constexpr (VEC == 4) {
#pragma unroll
    for (int g = 0; g < kPerT / 4; ++g) {
      const int i = chunk_index<4>(c0, 4 * g);
      const float4 f = WHOLE || i < V ? __ldg(reinterpret_cast<const float4*>(row + i))
                                      : make_float4(-CUDART_INF_F, -CUDART_INF_F, -CUDART_INF_F, -CUDART_INF_F);
      x[4 * g] = f.x;
      x[4 * g + 1] = f.y;
      x[4 * g + 2] = f.z;
      x[4 * g + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int u = 0; u < kPerT; ++u) {
      const int i = chunk_index<1>(c0, u);
      x[u] = WHOLE || i < V ? __ldg(row + i) : -CUDART_INF_F;
    }
  }
#pragma unroll
  for (int u = 0; u < kPerT; ++u) x[u] = clean(x[u]);
}

template <int VEC>
__device__ __forceinline__ void load_chunk(const float* row, int c, int V, float (&x)[kPerT]) {
  const int c0 = c * kChunk;
  if (c0 + kChunk <= V) load_entries<VEC, true>(row, c0, V, x);
  else load_entries<VEC, false>(row, c0, V, x);
}

// (value, first index) of the row's maximum from its P chunk maxima, in every lane of the calling warp.
__device__ __forceinline__ ChunkMax row_max_of(const ChunkMax* part, int P) {
  float bv = -CUDART_INF_F;
  int bi = 0x7fffffff;
  for (int c = threadIdx.x & 31; c < P; c += 32) {
    const ChunkMax m = part[c];
    if (m.v > bv || (m.v == bv && m.i < bi)) {
      bv = m.v;
      bi = m.i;
    }
  }
  warp_argmax(bv, bi);
  return {bv, bi == 0x7fffffff ? 0 : bi};
}

// Block s * P + c: the maximum of row s's chunk c -> part[s * P + c].
template <int VEC>
__global__ void __launch_bounds__(kCT) chunk_max_kernel(ChunkMax* __restrict__ part, const float* __restrict__ logits,
                                                        int V, int P) {
  pdl_trigger();
  pdl_wait();
  __shared__ ChunkMax wm[kCT / 32];
  const int64_t s = blockIdx.x / P;
  const int c = (int)(blockIdx.x % P);
  float x[kPerT];
  load_chunk<VEC>(logits + s * (int64_t)V, c, V, x);
  float bv = -CUDART_INF_F;
  int bi = 0x7fffffff;
#pragma unroll
  for (int u = 0; u < kPerT; ++u) {
    if (x[u] > bv) {  // indices increase with u: the first maximum is kept
      bv = x[u];
      bi = chunk_index<VEC>(c * kChunk, u);
    }
  }
  warp_argmax(bv, bi);
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  if (lane == 0) wm[wid] = {bv, bi};
  __syncthreads();
  if (wid == 0) {
    bv = lane < kCT / 32 ? wm[lane].v : -CUDART_INF_F;
    bi = lane < kCT / 32 ? wm[lane].i : 0x7fffffff;
    warp_argmax(bv, bi);
    if (lane == 0) part[blockIdx.x] = {bv, bi};
  }
}

// fdl_argmax's second kernel: one warp a row.
__global__ void argmax_finish_kernel(int64_t* __restrict__ out, const ChunkMax* __restrict__ part, int P) {
  pdl_trigger();
  pdl_wait();
  const ChunkMax m = row_max_of(part + blockIdx.x * (int64_t)P, P);
  if (threadIdx.x == 0) out[blockIdx.x] = m.i;
}

__device__ __forceinline__ bool filtered_row(const int* top_k, const float* top_p, int64_t s, int V) {
  const int k = top_k[s];
  return (k > 0 && k < V) || top_p[s] < 1.f;
}

// Block s * P + c, after chunk_max_kernel. Greedy rows: block c = 0 writes the argmax. Rows with top-k or top-p:
// nothing (sample_kernel selects). Others: the integer mass of chunk c above the min-p threshold ->
// mass[s * P + c], for sample_kernel's draw.
template <int VEC>
__global__ void __launch_bounds__(kCT) chunk_mass_kernel(uint64_t* __restrict__ mass, int64_t* __restrict__ out,
                                                         const ChunkMax* __restrict__ part,
                                                         const float* __restrict__ logits, int V, int P,
                                                         const float* __restrict__ temperature,
                                                         const int* __restrict__ top_k, const float* __restrict__ top_p,
                                                         const float* __restrict__ min_p) {
  pdl_trigger();
  pdl_wait();
  __shared__ ChunkMax best;
  __shared__ uint64_t wsum[kCT / 32];
  const int64_t s = blockIdx.x / P;
  const int c = (int)(blockIdx.x % P);
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  if (wid == 0) {
    const ChunkMax m = row_max_of(part + s * P, P);
    if (lane == 0) best = m;
  }
  __syncthreads();
  const float temp = temperature[s];
  if (temp < 1e-5f || best.v == -CUDART_INF_F) {
    if (c == 0 && threadIdx.x == 0) out[s] = best.i;
    return;
  }
  if (filtered_row(top_k, top_p, s, V)) return;
  const float mx = best.v / temp;
  const float mp = min_p[s];
  const float thr = min_p_threshold(mx, mp);
  float x[kPerT];
  load_chunk<VEC>(logits + s * (int64_t)V, c, V, x);
  uint64_t sum = 0;
#pragma unroll
  for (int u = 0; u < kPerT; ++u) {
    const float y = x[u] / temp;
    if (y >= thr) sum += weight(y, mx);  // -inf past the row's end weighs 0
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) wsum[wid] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t t = 0;
#pragma unroll
    for (int w = 0; w < kCT / 32; ++w) t += wsum[w];
    mass[blockIdx.x] = t;
  }
}

__device__ __forceinline__ void hist_add(Shared& sh, int b, uint64_t w) {
  const uint32_t wl = (uint32_t)w, wh = (uint32_t)(w >> 32);
  const uint32_t old = atomicAdd(&sh.lo[b], wl);
  const uint32_t carry = old + wl < old ? 1u : 0u;  // the low half wrapped: carry into the high half
  if (wh + carry) atomicAdd(&sh.hi[b], wh + carry);
}

__device__ __forceinline__ uint64_t hist_get(const Shared& sh, int b) {
  return ((uint64_t)sh.hi[b] << 32) + sh.lo[b];
}

__device__ __forceinline__ int coarse_bin(float x, float mx) {
  const float d = (mx - x) * BIN_PER_NAT;  // monotone in x: larger x, smaller bin
  return d < (float)(NBINS - 1) ? (int)d : NBINS - 1;
}

// Thread t owns digits (positions) 2t and 2t + 1 of a histogram scanned in `order` (ascending bins
// or descending digits). Finds the position where the running total, starting at `above`, first
// reaches `target`; writes the chosen digit to sh.bin and the total before it to sh.above.
// With ceil_p >= 0 the target is ceil(ceil_p * total) (top-p), computed here from the scan.
__device__ void pick(int nb, bool descending, uint64_t above, uint64_t target, float ceil_p, Shared& sh) {
  const int pa = 2 * (int)threadIdx.x, pb = pa + 1;
  const int da = descending ? nb - 1 - pa : pa, db = descending ? nb - 1 - pb : pb;
  const uint64_t ha = pa < nb ? hist_get(sh, da) : 0, hb = pb < nb ? hist_get(sh, db) : 0;
  const uint64_t incl = block_scan(ha + hb, sh.tmp);
  if (ceil_p >= 0.f) {
    // at least the top token survives (p <= 0 would otherwise select nothing)
    if (threadIdx.x == NT - 1) sh.target = max((uint64_t)1, (uint64_t)ceil((double)ceil_p * (double)incl));
    __syncthreads();
    target = sh.target;
  }
  const uint64_t excl = above + incl - ha - hb;
  if (pa < nb && excl < target && target <= excl + ha) {
    sh.above = excl;
    sh.bin = da;
  } else if (pb < nb && excl + ha < target && target <= excl + ha + hb) {
    sh.above = excl + ha;
    sh.bin = db;
  }
  __syncthreads();
}

// The value v at which the descending cumulative W(x >= v) first reaches the target, over elements
// x >= floor_x; W counts elements (by_mass false, target count_target) or sums w(x) (target
// ceil(p * total)). Coarse level: linear bins below the max (no atomics piling onto the few float
// exponents that most logits share); then the order-preserving keys of the chosen bin's elements,
// 11/11/10 bits, from a shared-memory copy when they fit, else by re-reading the row.
__device__ float select_desc(const float* row, int V, float temp, float mx, float floor_x, bool by_mass,
                             uint64_t count_target, float p, Shared& sh) {
  for (int i = threadIdx.x; i < NBINS; i += NT) sh.lo[i] = sh.hi[i] = 0;
  if (threadIdx.x == 0) sh.ncand = 0;
  __syncthreads();
  uint64_t tail_w = 0;
  for (int i = threadIdx.x; i < V; i += NT) {
    const float x = clean(row[i]) / temp;
    if (!(x >= floor_x)) continue;
    const int b = coarse_bin(x, mx);
    const uint64_t w = by_mass ? weight(x, mx) : 1ull;
    if (b == NBINS - 1) tail_w += w;  // the far tail: one atomic per thread at the end
    else hist_add(sh, b, w);
  }
  if (tail_w) hist_add(sh, NBINS - 1, tail_w);
  __syncthreads();
  pick(NBINS, false, 0, count_target, by_mass ? p : -1.f, sh);
  const int bin = sh.bin;
  uint64_t above = sh.above;
  const uint64_t target = by_mass ? sh.target : count_target;
  __syncthreads();
  for (int i = threadIdx.x; i < V; i += NT) {  // the chosen bin's elements into shared memory, if they fit
    const float x = clean(row[i]) / temp;
    if (x >= floor_x && coarse_bin(x, mx) == bin) {
      const uint32_t at = atomicAdd(&sh.ncand, 1u);
      if (at < (uint32_t)CAND) sh.cand[at] = x;
    }
  }
  __syncthreads();
  const bool in_smem = sh.ncand <= (uint32_t)CAND;
  const int nc = (int)sh.ncand;
  uint32_t prefix = 0, mask = 0;
  const int shifts[3] = {21, 10, 0};
  const int widths[3] = {11, 11, 10};
#pragma unroll
  for (int level = 0; level < 3; ++level) {
    const int shift = shifts[level], nb = 1 << widths[level];
    for (int i = threadIdx.x; i < nb; i += NT) sh.lo[i] = sh.hi[i] = 0;
    __syncthreads();
    auto add = [&](float x) {
      const uint32_t k = fkey(x);
      if ((k & mask) != prefix) return;
      hist_add(sh, (k >> shift) & (nb - 1), by_mass ? weight(x, mx) : 1ull);
    };
    if (in_smem) {
      for (int i = threadIdx.x; i < nc; i += NT) add(sh.cand[i]);
    } else {
      for (int i = threadIdx.x; i < V; i += NT) {
        const float x = clean(row[i]) / temp;
        if (x >= floor_x && coarse_bin(x, mx) == bin) add(x);
      }
    }
    __syncthreads();
    pick(nb, true, above, target, -1.f, sh);
    above = sh.above;
    prefix |= (uint32_t)sh.bin << shift;
    mask |= (uint32_t)(nb - 1) << shift;
    __syncthreads();
  }
  return kfloat(prefix);
}

// Row s's draw from the masses of its chunks (chunk_mass_kernel): the chunk holding the target, then its
// entries, kWalkPerT consecutive ones a thread, scanned over the block. thr: the min-p threshold.
__device__ void draw_from_chunks(int64_t* out, const uint64_t* mass, const float* row, int V, int P, float temp,
                                 float mx, float thr, uint64_t seed, uint64_t pos, int best_i, Shared& sh) {
  if (threadIdx.x == 0) {
    uint64_t Z = 0;
    for (int c = 0; c < P; ++c) Z += mass[c];
    int chosen = -1;
    uint64_t target = 0;
    if (Z > 0) {
      const float u = uniform01(seed, pos, 0);
      target = (uint64_t)((double)u * (double)Z);
      if (target >= Z) target = Z - 1;
      for (int c = 0; c < P; ++c) {
        if (target < mass[c]) {
          chosen = c;
          break;
        }
        target -= mass[c];
      }
    }
    sh.bin = chosen;
    sh.target = target;  // relative to the chosen chunk's start
  }
  __syncthreads();
  const int c = sh.bin;
  if (c < 0) {  // nothing kept (cannot happen with a finite max): greedy
    if (threadIdx.x == 0) *out = best_i;
    return;
  }
  const uint64_t target = sh.target;
  const int i0 = c * kChunk + (int)threadIdx.x * kWalkPerT;
  float y[kWalkPerT];
  uint64_t mine = 0;
#pragma unroll
  for (int e = 0; e < kWalkPerT; ++e) {
    const int i = i0 + e;
    y[e] = i < V ? clean(row[i]) / temp : -CUDART_INF_F;
  }
#pragma unroll
  for (int e = 0; e < kWalkPerT; ++e)
    if (y[e] >= thr) mine += weight(y[e], mx);
  const uint64_t incl = block_scan(mine, sh.tmp);
  uint64_t acc = incl - mine;
  if (acc <= target && target < incl) {  // exactly one thread: the entry whose inclusive mass first exceeds target
    int found = i0 + kWalkPerT - 1;
#pragma unroll
    for (int e = 0; e < kWalkPerT; ++e) {
      if (y[e] >= thr) acc += weight(y[e], mx);
      if (acc > target) {
        found = i0 + e;
        break;
      }
    }
    *out = found;
  }
}

// One block per row, after chunk_mass_kernel (which wrote the greedy rows' tokens): rows without top-k and top-p
// draw from their chunk masses; the others find their thresholds by select, then draw over the whole row.
__global__ void __launch_bounds__(NT) sample_kernel(int64_t* __restrict__ out, const ChunkMax* __restrict__ maxima,
                                                    const uint64_t* __restrict__ mass, const float* __restrict__ logits,
                                                    int V, int P, const float* __restrict__ temperature,
                                                    const int* __restrict__ top_k, const float* __restrict__ top_p,
                                                    const float* __restrict__ min_p, const int64_t* __restrict__ seeds,
                                                    const int64_t* __restrict__ positions) {
  pdl_trigger();
  pdl_wait();
  __shared__ Shared sh;
  const int64_t s = blockIdx.x;
  const float* row = logits + s * (int64_t)V;
  if (threadIdx.x < 32) {
    const ChunkMax m = row_max_of(maxima + s * P, P);
    if (threadIdx.x == 0) {
      sh.f0 = m.v;
      sh.i0 = m.i;
    }
  }
  __syncthreads();
  const float best_v = sh.f0;
  const int best_i = sh.i0;
  const float temp = temperature[s];
  if (temp < 1e-5f || best_v == -CUDART_INF_F) return;  // greedy: chunk_mass_kernel wrote it
  const float mx = best_v / temp;  // division is monotone: max(x / t) == max(x) / t
  const float mp = min_p[s];
  if (!filtered_row(top_k, top_p, s, V)) {
    draw_from_chunks(out + s, mass + s * P, row, V, P, temp, mx, min_p_threshold(mx, mp),
                     (uint64_t)seeds[s], (uint64_t)positions[s], best_i, sh);
    return;
  }
  __syncthreads();  // sh.f0 / sh.i0 are reused below
  float thr = -CUDART_INF_F;
  const int k = top_k[s];
  if (k > 0 && k < V) thr = select_desc(row, V, temp, mx, -CUDART_INF_F, false, (uint64_t)k, 0.f, sh);
  const float p = top_p[s];
  if (p < 1.f) thr = fmaxf(thr, select_desc(row, V, temp, mx, thr, true, 0, p, sh));
  if (mp > 0.f) thr = fmaxf(thr, min_p_threshold(mx, mp));

  // Inverse CDF in vocabulary order. Warp w sums its chunk; one warp then walks the chunk holding the target.
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const int chunk = (V + 32 * 32 - 1) / (32 * 32) * 32;
  const int c0 = wid * chunk, c1 = min(V, c0 + chunk);
  uint64_t part = 0;
  for (int i = c0 + lane; i < c1; i += 32) {
    const float x = clean(row[i]) / temp;
    if (x >= thr) part += weight(x, mx);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
  __syncthreads();
  if (lane == 0) sh.tmp[wid] = part;
  __syncthreads();
  if (wid == 0) {
    const uint64_t mine = sh.tmp[lane];
    uint64_t incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint64_t n = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += n;
    }
    const uint64_t Z = __shfl_sync(0xffffffffu, incl, 31);
    const float u = uniform01((uint64_t)seeds[s], (uint64_t)positions[s], 0);
    uint64_t target = (uint64_t)((double)u * (double)Z);
    if (target >= Z) target = Z - 1;
    const unsigned hit = __ballot_sync(0xffffffffu, Z > 0 && incl > target && incl - mine <= target);
    if (lane == 0) {
      sh.target = target;
      sh.i0 = hit ? __ffs(hit) - 1 : -1;
    }
    if (hit) {
      const int w = __ffs(hit) - 1;
      if (lane == w) sh.above = incl - mine;  // mass before warp w's chunk
    }
  }
  __syncthreads();
  const int w = sh.i0;
  if (w < 0) {  // nothing kept (cannot happen with a finite max): fall back to greedy
    if (threadIdx.x == 0) out[s] = best_i;
    return;
  }
  if (wid == w) {
    uint64_t base = sh.above;
    const uint64_t target = sh.target;
    const int d0 = w * chunk, d1 = min(V, d0 + chunk);
    int found = -1;
    for (int i0 = d0; i0 < d1 && found < 0; i0 += 32) {
      const int i = i0 + lane;
      uint64_t v = 0;
      if (i < d1) {
        const float x = clean(row[i]) / temp;
        if (x >= thr) v = weight(x, mx);
      }
      uint64_t incl = v;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint64_t n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
      }
      const unsigned hit = __ballot_sync(0xffffffffu, base + incl > target);
      if (hit) found = i0 + __ffs(hit) - 1;
      base += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) out[s] = found >= 0 ? found : best_i;
  }
}

__global__ void uniform_kernel(float* out, const int64_t* seeds, const int64_t* positions, int64_t n, int round) {
  pdl_trigger();
  pdl_wait();
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) out[i] = uniform01((uint64_t)seeds[i], (uint64_t)positions[i], (uint64_t)(int64_t)round);
}

void check_logits(const paddle::Tensor& logits, const char* op) {
  check_gpu(logits, op, "logits");
  PD_CHECK(logits.dtype() == paddle::DataType::FLOAT32 && logits.shape().size() == 2, op,
           ": logits must be [S, V] float32");
}

// The chunk passes' workspace: S * P chunk maxima, then S * P chunk masses.
struct RowPasses {
  paddle::Tensor ws;
  int P;
  bool vec;
  ChunkMax* part() { return reinterpret_cast<ChunkMax*>(ws.data<int64_t>()); }
  uint64_t* mass(int64_t S) { return reinterpret_cast<uint64_t*>(ws.data<int64_t>() + S * P); }
};

// chunk_max_kernel over logits [S, V] (S > 0).
RowPasses chunk_maxima(const paddle::Tensor& logits, int64_t S, int V, cudaStream_t st, const char* op) {
  const int P = (int)ceil_div(V, kChunk);
  PD_CHECK(S * P < ((int64_t)1 << 31), op, ": too many rows for one launch");
  RowPasses r{paddle::empty({2 * S * P}, paddle::DataType::INT64, logits.place()), P,
              V % 4 == 0 && aligned16(logits.data())};
  launch("chunk_max_kernel", r.vec ? chunk_max_kernel<4> : chunk_max_kernel<1>, (unsigned)(S * P), kCT, 0, st,
         pdl_rows(S), r.part(), logits.data<float>(), V, P);
  FDL_CHECK_LAUNCH(op);
  return r;
}

}  // namespace
}  // namespace fdl

using namespace fdl;

// fdl_argmax(logits [S, V] float32) -> [S] int64 (first index of the maximum; NaN as -inf)
std::vector<paddle::Tensor> Argmax(const paddle::Tensor& logits) {
  check_logits(logits, "fdl_argmax");
  const int64_t S = logits.shape()[0];
  const int V = (int)logits.shape()[1];
  paddle::Tensor out = paddle::empty({S}, paddle::DataType::INT64, logits.place());
  if (S > 0) {
    cudaStream_t st = stream_of(logits);
    RowPasses r = chunk_maxima(logits, S, V, st, "fdl_argmax");
    launch("argmax_finish_kernel", argmax_finish_kernel, (unsigned)S, 32, 0, st, pdl_rows(S), out.data<int64_t>(),
           r.part(), r.P);
  }
  FDL_CHECK_LAUNCH("fdl_argmax");
  return {out};
}

PD_BUILD_OP(fdl_argmax).Inputs({"Logits"}).Outputs({"Out"}).SetKernelFn(PD_KERNEL(Argmax));

// fdl_sample(logits [S, V] f32, temperature [S] f32, top_k [S] i32, top_p [S] f32, min_p [S] f32,
//            seeds [S] i64, positions [S] i64) -> [S] int64. top_k <= 0 or >= V: off; top_p >= 1: off;
// min_p <= 0: off; temperature < 1e-5: greedy.
std::vector<paddle::Tensor> Sample(const paddle::Tensor& logits, const paddle::Tensor& temperature,
                                   const paddle::Tensor& top_k, const paddle::Tensor& top_p,
                                   const paddle::Tensor& min_p, const paddle::Tensor& seeds,
                                   const paddle::Tensor& positions) {
  const char* op = "fdl_sample";
  check_logits(logits, op);
  const int64_t S = logits.shape()[0];
  const int V = (int)logits.shape()[1];
  for (const paddle::Tensor* t : std::initializer_list<const paddle::Tensor*>{&temperature, &top_k, &top_p, &min_p, &seeds, &positions}) {
    check_gpu(*t, op, "parameter");
    PD_CHECK(t->numel() == S, op, ": every parameter tensor must be [S]");
  }
  PD_CHECK(temperature.dtype() == paddle::DataType::FLOAT32 && top_p.dtype() == paddle::DataType::FLOAT32 &&
               min_p.dtype() == paddle::DataType::FLOAT32 && top_k.dtype() == paddle::DataType::INT32 &&
               seeds.dtype() == paddle::DataType::INT64 && positions.dtype() == paddle::DataType::INT64,
           op, ": temperature/top_p/min_p float32, top_k int32, seeds/positions int64");
  paddle::Tensor out = paddle::empty({S}, paddle::DataType::INT64, logits.place());
  if (S > 0) {
    cudaStream_t st = stream_of(logits);
    RowPasses r = chunk_maxima(logits, S, V, st, op);
    const float* tp = temperature.data<float>();
    const int* tk = top_k.data<int>();
    const float *pp = top_p.data<float>(), *mp = min_p.data<float>();
    launch("chunk_mass_kernel", r.vec ? chunk_mass_kernel<4> : chunk_mass_kernel<1>, (unsigned)(S * r.P), kCT, 0, st,
           pdl_rows(S), r.mass(S), out.data<int64_t>(), r.part(), logits.data<float>(), V, r.P, tp, tk, pp, mp);
    launch("sample_kernel", sample_kernel, (unsigned)S, NT, 0, st, pdl_rows(S), out.data<int64_t>(), r.part(),
           r.mass(S), logits.data<float>(), V, r.P, tp, tk, pp, mp, seeds.data<int64_t>(),
           positions.data<int64_t>());
  }
  FDL_CHECK_LAUNCH(op);
  return {out};
}

PD_BUILD_OP(fdl_sample)
    .Inputs({"Logits", "Temperature", "TopK", "TopP", "MinP", "Seeds", "Positions"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(Sample));

// fdl_uniform(seeds [S] i64, positions [S] i64, round) -> [S] float32: the sampler's noise, for tests
// and for a CPU implementation to check itself against.
std::vector<paddle::Tensor> Uniform(const paddle::Tensor& seeds, const paddle::Tensor& positions, int round) {
  check_gpu(seeds, "fdl_uniform", "seeds");
  PD_CHECK(seeds.dtype() == paddle::DataType::INT64 && positions.dtype() == paddle::DataType::INT64 &&
               positions.numel() == seeds.numel(),
           "fdl_uniform: seeds and positions must be int64 of one size");
  const int64_t n = seeds.numel();
  paddle::Tensor out = paddle::empty({n}, paddle::DataType::FLOAT32, seeds.place());
  if (n > 0)
    launch("uniform_kernel", uniform_kernel, (unsigned)ceil_div(n, 256), 256, 0, stream_of(seeds), false, out.data<float>(), seeds.data<int64_t>(),
                                                                            positions.data<int64_t>(), n, round);
  FDL_CHECK_LAUNCH("fdl_uniform");
  return {out};
}

PD_BUILD_OP(fdl_uniform)
    .Inputs({"Seeds", "Positions"})
    .Outputs({"Out"})
    .Attrs({"round: int"})
    .SetKernelFn(PD_KERNEL(Uniform));
