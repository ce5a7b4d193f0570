// fdl_cpu_paged_attention: paged attention over the flat varlen batch, on the CPU, float32.
//
// Hand-written because Paddle has no CPU paged attention (its fused block attention is GPU-only), and
// the Paddle-op chain of fdlite/layers/attention.py (the reference this op must match) pays for a gather
// copy of every row's whole context from the cache plus ~10 op dispatches per layer. Here every query
// token reads K/V where they lie in the cache, through its row's block table, with an online softmax.
//
// Cache layout (FastDeploy's): [num_blocks, kv_heads, block_size, head_dim]; a block's keys of one head
// are block_size contiguous rows of head_dim floats.
//
// Two ways to say which row and how much context each token has:
//   per_token = false (eager steps): rows = cu_seqlens_q [B + 1], lens = seq_lens_kv [B]; token i of row r
//     (i in [0, q_len)) sits at position seq_lens_kv[r] - q_len + i and sees positions <= that.
//   per_token = true (captured graphs, which carry no host batch structure): rows = token_rows [T],
//     lens = positions [T]; token t reads table row rows[t] up to position lens[t] inclusive.
// Index tensors may be int32 or int64.
//
// fdl_cpu_paged_attention_fp8 reads an FP8 cache (kv_cache_dtype="fp8", fdlite/kvcache/fp8_cache.py): e4m3 bytes
// in the same layout plus a float32 scale per (slot, KV head); each block of keys and values is widened into
// float scratch (a 256-entry table, times its rows' scales) before the same float32 code runs on it.
//
// Work item = (token, KV head): the query heads sharing that KV head are done together, so each K/V
// row is pulled into cache once for all of them (GQA). Items run in parallel on OpenMP threads
// (OMP_NUM_THREADS, or the num_threads attribute when > 0), handed out by an atomic counter. Scores are kept in base 2: q is pre-scaled
// by scale * log2(e), so the softmax needs exp2 only. With AVX2 + FMA (the build adds -mavx2 -mfma only
// where the CPU has them) the dot products, the exp2 and the P.V update are 8-wide; otherwise plain loops.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "paddle/extension.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FDL_AVX2 1
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int64_t kChunkMin = 4;  // fewer items than this: one thread

struct Span {
  int64_t row;     // row of block_tables
  int64_t kv_len;  // keys this token sees: positions [0, kv_len)
};

int64_t read_index(const paddle::Tensor& t, int64_t i) {
  return t.dtype() == paddle::DataType::INT32 ? static_cast<int64_t>(t.data<int32_t>()[i]) : t.data<int64_t>()[i];
}

#ifdef FDL_AVX2
// 2^x for x <= 0 (clamped at -126: underflow gives 2^-126, not 0, which is below float precision next
// to the running sum, that holds at least 1). Round to nearest, then 2^f for |f| <= 0.5 by a degree-6
// Taylor polynomial of e^(f ln 2) (relative error ~1e-7), times 2^n built in the exponent bits.
inline __m256 exp2_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(x, n), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// Eight vectors -> one vector of their eight horizontal sums.
inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// One query head against n keys of one block: s[j] = q . k_j (q already scaled into base 2).
inline void scores_block(const float* q, const float* k, int64_t n, int64_t d, float* s) {
#ifdef FDL_AVX2
  if (d % 8 == 0) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 acc[8];
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + c);
        for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (j + u) * d + c), acc[u]);
      }
      _mm256_storeu_ps(s + j, hsum8(acc));
    }
    for (; j < n; ++j) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + j * d + c), acc);
      s[j] = hsum(acc);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    float acc = 0.0f;
    const float* kj = k + j * d;
    for (int64_t c = 0; c < d; ++c) acc += q[c] * kj[c];
    s[j] = acc;
  }
}

// s[j] <- 2^(s[j] - m) for j < n; returns their sum.
inline float exp2_block(float* s, int64_t n, float m) {
  float sum = 0.0f;
  int64_t j = 0;
#ifdef FDL_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 p = exp2_neg(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, p);
    acc = _mm256_add_ps(acc, p);
  }
  sum = hsum(acc);
#endif
  for (; j < n; ++j) {
    s[j] = std::exp2(s[j] - m);
    sum += s[j];
  }
  return sum;
}

#ifdef FDL_AVX2
// o[0, 8W) += sum_j p[j] * v_j[0, 8W): W is a compile-time constant so the accumulators stay in registers.
template <int W>
inline void pv_tile(const float* p, const float* v, int64_t n, int64_t d, float* o) {
  __m256 acc[W];
  for (int u = 0; u < W; ++u) acc[u] = _mm256_loadu_ps(o + 8 * u);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = v + j * d;
    for (int u = 0; u < W; ++u) acc[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * u), acc[u]);
  }
  for (int u = 0; u < W; ++u) _mm256_storeu_ps(o + 8 * u, acc[u]);
}
#endif

// o[0, d) += sum_j p[j] * v_j over n value rows.
inline void pv_block(const float* p, const float* v, int64_t n, int64_t d, float* o) {
#ifdef FDL_AVX2
  if (d % 8 == 0) {
    for (int64_t c0 = 0; c0 < d; c0 += 64) {  // tiles of 64 floats: 8 accumulators + operands fit in 16 registers
      switch (std::min<int64_t>(64, d - c0) / 8) {
        case 8: pv_tile<8>(p, v + c0, n, d, o + c0); break;
        case 7: pv_tile<7>(p, v + c0, n, d, o + c0); break;
        case 6: pv_tile<6>(p, v + c0, n, d, o + c0); break;
        case 5: pv_tile<5>(p, v + c0, n, d, o + c0); break;
        case 4: pv_tile<4>(p, v + c0, n, d, o + c0); break;
        case 3: pv_tile<3>(p, v + c0, n, d, o + c0); break;
        case 2: pv_tile<2>(p, v + c0, n, d, o + c0); break;
        default: pv_tile<1>(p, v + c0, n, d, o + c0); break;
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const float* vj = v + j * d;
    for (int64_t c = 0; c < d; ++c) o[c] += pj * vj[c];
  }
}

inline void scale_vec(float* o, int64_t d, float a) {
  for (int64_t c = 0; c < d; ++c) o[c] *= a;
}

struct Shape {
  int64_t h, kvh, g, d, bs, width, num_blocks;
};

// The K/V cache of one layer: float32, or e4m3 bytes with a float32 scale per (block, head, slot).
struct Cache {
  const float* k = nullptr;
  const float* v = nullptr;
  const uint8_t* k8 = nullptr;
  const uint8_t* v8 = nullptr;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
};

// e4m3fn byte -> float: 4 exponent bits (bias 7), 3 mantissa bits, subnormals at exponent 0, NaN at S.1111.111.
struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int x = 0; x < 256; ++x) {
      const int e = (x >> 3) & 15, m = x & 7;
      float f = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 15 && m == 7) f = std::numeric_limits<float>::quiet_NaN();
      v[x] = (x & 128) ? -f : f;
    }
  }
};
const E4m3Table kE4m3;

// n rows of d e4m3 bytes starting at `src` (row r scaled by scale[r]) -> dst [n, d] floats.
void widen_rows(const uint8_t* src, const float* scale, int64_t n, int64_t d, float* dst) {
  for (int64_t r = 0; r < n; ++r) {
    const float sc = scale[r];
    for (int64_t c = 0; c < d; ++c) dst[r * d + c] = kE4m3.v[src[r * d + c]] * sc;
  }
}

// One (token, KV head): g query heads over the token's kv_len keys, block by block, online softmax.
// scratch: g * bs scores, g * d accumulators, g * d scaled queries (then 2 * bs * d widened K/V for FP8).
void attend_item(const float* q, const Cache& cache, const int32_t* table, int64_t kv_len, int64_t head,
                 const Shape& sh, float qscale, float* scratch, float* out) {
  const int64_t g = sh.g, d = sh.d, bs = sh.bs;
  float* s = scratch;                  // [g, bs]
  float* acc = scratch + g * bs;       // [g, d]
  float* qv = scratch + g * (bs + d);  // [g, d]
  for (int64_t k = 0; k < g * d; ++k) qv[k] = q[head * g * d + k] * qscale;
  std::fill(acc, acc + g * d, 0.0f);
  float m[64], l[64];  // g <= 64 checked by the op
  for (int64_t k = 0; k < g; ++k) {
    m[k] = -std::numeric_limits<float>::infinity();
    l[k] = 0.0f;
  }
  const int64_t nblocks = (kv_len + bs - 1) / bs;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t n = std::min(bs, kv_len - b * bs);
    const int64_t base = (static_cast<int64_t>(table[b]) * sh.kvh + head) * bs * d;
    const float* kb = cache.k + base;
    const float* vb = cache.v + base;
    if (cache.k8 != nullptr) {
      float* kw = scratch + g * (bs + 2 * d);
      float* vw = kw + bs * d;
      widen_rows(cache.k8 + base, cache.k_scale + base / d, n, d, kw);
      widen_rows(cache.v8 + base, cache.v_scale + base / d, n, d, vw);
      kb = kw;
      vb = vw;
    }
    for (int64_t k = 0; k < g; ++k) {
      float* sk = s + k * bs;
      scores_block(qv + k * d, kb, n, d, sk);
      float mx = m[k];
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sk[j]);
      if (mx > m[k]) {  // rescale what was accumulated under the old maximum
        if (l[k] > 0.0f) {
          const float corr = std::exp2(m[k] - mx);
          l[k] *= corr;
          scale_vec(acc + k * d, d, corr);
        }
        m[k] = mx;
      }
      l[k] += exp2_block(sk, n, m[k]);
      pv_block(sk, vb, n, d, acc + k * d);
    }
  }
  for (int64_t k = 0; k < g; ++k) {
    const float inv = l[k] > 0.0f ? 1.0f / l[k] : 0.0f;
    float* o = out + (head * g + k) * d;
    for (int64_t c = 0; c < d; ++c) o[c] = acc[k * d + c] * inv;
  }
}

}  // namespace

namespace {

// Both ops: k_scale / v_scale are null for a float32 cache.
std::vector<paddle::Tensor> paged_attention_impl(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                                 const paddle::Tensor& v_cache, const paddle::Tensor* k_scale,
                                                 const paddle::Tensor* v_scale, const paddle::Tensor& block_tables,
                                                 const paddle::Tensor& rows, const paddle::Tensor& lens, float scale,
                                                 bool per_token, int num_threads) {
  const bool fp8 = k_scale != nullptr;
  PD_CHECK(q.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu(), "fdl_cpu_paged_attention: CPU tensors only");
  const paddle::DataType cache_dtype = fp8 ? paddle::DataType::UINT8 : paddle::DataType::FLOAT32;
  PD_CHECK(q.dtype() == paddle::DataType::FLOAT32 && k_cache.dtype() == cache_dtype && v_cache.dtype() == cache_dtype,
           "fdl_cpu_paged_attention: float32 q, and float32 caches (or e4m3 bytes with the _fp8 op)");
  PD_CHECK(block_tables.dtype() == paddle::DataType::INT32, "fdl_cpu_paged_attention: block_tables must be int32");
  for (const paddle::Tensor* t : {&rows, &lens})
    PD_CHECK(t->dtype() == paddle::DataType::INT32 || t->dtype() == paddle::DataType::INT64,
             "fdl_cpu_paged_attention: index tensors must be int32 or int64");
  const auto qs = q.shape();
  const auto cs = k_cache.shape();
  PD_CHECK(qs.size() == 3 && cs.size() == 4 && v_cache.shape() == cs && block_tables.shape().size() == 2,
           "fdl_cpu_paged_attention: q [T, h, d], caches [blocks, kv_heads, block_size, d], tables [rows, width]");
  Shape sh;
  const int64_t T = qs[0];
  sh.h = qs[1];
  sh.d = qs[2];
  sh.num_blocks = cs[0];
  sh.kvh = cs[1];
  sh.bs = cs[2];
  sh.width = block_tables.shape()[1];
  PD_CHECK(cs[3] == sh.d && sh.kvh > 0 && sh.h % sh.kvh == 0, "fdl_cpu_paged_attention: head shapes do not match");
  if (fp8) {
    const std::vector<int64_t> ss(cs.begin(), cs.end() - 1);
    PD_CHECK(k_scale->dtype() == paddle::DataType::FLOAT32 && v_scale->dtype() == paddle::DataType::FLOAT32 &&
                 k_scale->shape() == ss && v_scale->shape() == ss,
             "fdl_cpu_paged_attention_fp8: scales must be float32 [blocks, kv_heads, block_size]");
  }
  sh.g = sh.h / sh.kvh;
  PD_CHECK(sh.g <= 64, "fdl_cpu_paged_attention: more than 64 query heads per KV head");
  const int64_t num_rows = block_tables.shape()[0];

  // Each token's row and context length, checked here so the parallel loop cannot read out of bounds.
  std::vector<Span> spans(T, Span{0, 0});
  if (per_token) {
    PD_CHECK(rows.numel() >= T && lens.numel() >= T, "fdl_cpu_paged_attention: token_rows/positions shorter than q");
    for (int64_t t = 0; t < T; ++t) spans[t] = Span{read_index(rows, t), read_index(lens, t) + 1};
  } else {
    const int64_t B = lens.numel();
    PD_CHECK(rows.numel() == B + 1, "fdl_cpu_paged_attention: cu_seqlens_q must have one more entry than seq_lens_kv");
    for (int64_t r = 0; r < B; ++r) {
      const int64_t t0 = read_index(rows, r), t1 = read_index(rows, r + 1), kv = read_index(lens, r);
      PD_CHECK(0 <= t0 && t0 <= t1 && t1 <= T && kv >= t1 - t0, "fdl_cpu_paged_attention: bad cu_seqlens_q/seq_lens_kv");
      for (int64_t t = t0; t < t1; ++t) spans[t] = Span{r, kv - (t1 - 1 - t)};  // the last token sees all kv
    }
  }
  const int32_t* tables = block_tables.data<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    const Span& sp = spans[t];
    if (sp.kv_len <= 0) continue;
    PD_CHECK(0 <= sp.row && sp.row < num_rows && sp.kv_len <= sh.width * sh.bs,
             "fdl_cpu_paged_attention: token row or context length outside the block table");
    const int32_t* tb = tables + sp.row * sh.width;
    for (int64_t b = 0; b < (sp.kv_len + sh.bs - 1) / sh.bs; ++b)
      PD_CHECK(0 <= tb[b] && tb[b] < sh.num_blocks, "fdl_cpu_paged_attention: block id outside the cache");
  }

  paddle::Tensor out = paddle::empty({T, sh.h * sh.d}, paddle::DataType::FLOAT32, q.place());
  const float* qp = q.data<float>();
  Cache cache;
  if (fp8) {
    cache.k8 = k_cache.data<uint8_t>();
    cache.v8 = v_cache.data<uint8_t>();
    cache.k_scale = k_scale->data<float>();
    cache.v_scale = v_scale->data<float>();
  } else {
    cache.k = k_cache.data<float>();
    cache.v = v_cache.data<float>();
  }
  float* op = out.data<float>();
  const float qscale = scale * kLog2e;
  const int64_t items = T * sh.kvh;
  int64_t work = 0;  // keys read over the batch: small batches are not worth waking threads for
  for (const Span& sp : spans) work += std::max<int64_t>(sp.kv_len, 0);
  work *= sh.h * sh.d;
  const size_t scratch_size = static_cast<size_t>(sh.g * (sh.bs + 2 * sh.d) + (fp8 ? 2 * sh.bs * sh.d : 0));

  // Items are handed out by an atomic counter (dynamic balance: prefill tokens differ in context
  // length) rather than an OpenMP worksharing loop, so only GOMP_parallel and omp_get_max_threads are
  // needed from the runtime: both exist in Intel's libiomp5 as in libgomp (see cpu_attention.py).
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    std::vector<float> scratch(scratch_size);
    constexpr int64_t kChunk = 4;
    for (;;) {
      const int64_t first = next.fetch_add(kChunk, std::memory_order_relaxed);
      if (first >= items) break;
      for (int64_t it = first; it < std::min(items, first + kChunk); ++it) {
        const int64_t t = it / sh.kvh, head = it % sh.kvh;
        const Span& sp = spans[t];
        float* o = op + t * sh.h * sh.d;
        if (sp.kv_len <= 0) {
          std::fill(o + head * sh.g * sh.d, o + (head + 1) * sh.g * sh.d, 0.0f);
          continue;
        }
        attend_item(qp + t * sh.h * sh.d, cache, tables + sp.row * sh.width, sp.kv_len, head, sh, qscale,
                    scratch.data(), o);
      }
    }
  };
#ifdef _OPENMP
  const int nt = num_threads > 0 ? num_threads : omp_get_max_threads();
  if (nt > 1 && items > kChunkMin && work > (1 << 16)) {
#pragma omp parallel num_threads(nt)
    worker();
  } else {
    worker();
  }
#else
  worker();
#endif
  return {out};
}

}  // namespace

std::vector<paddle::Tensor> PagedAttentionCpu(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                              const paddle::Tensor& v_cache, const paddle::Tensor& block_tables,
                                              const paddle::Tensor& rows, const paddle::Tensor& lens, float scale,
                                              bool per_token, int num_threads) {
  return paged_attention_impl(q, k_cache, v_cache, nullptr, nullptr, block_tables, rows, lens, scale, per_token,
                              num_threads);
}

std::vector<paddle::Tensor> PagedAttentionCpuFp8(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                                 const paddle::Tensor& k_scale, const paddle::Tensor& v_cache,
                                                 const paddle::Tensor& v_scale, const paddle::Tensor& block_tables,
                                                 const paddle::Tensor& rows, const paddle::Tensor& lens, float scale,
                                                 bool per_token, int num_threads) {
  return paged_attention_impl(q, k_cache, v_cache, &k_scale, &v_scale, block_tables, rows, lens, scale, per_token,
                              num_threads);
}

std::vector<std::vector<int64_t>> PagedAttentionCpuInferShape(const std::vector<int64_t>& q,
                                                              const std::vector<int64_t>&,
                                                              const std::vector<int64_t>&,
                                                              const std::vector<int64_t>&,
                                                              const std::vector<int64_t>&,
                                                              const std::vector<int64_t>&) {
  return {{q[0], q[1] * q[2]}};
}

std::vector<paddle::DataType> PagedAttentionCpuInferDtype(const paddle::DataType& q, const paddle::DataType&,
                                                          const paddle::DataType&, const paddle::DataType&,
                                                          const paddle::DataType&, const paddle::DataType&) {
  return {q};
}

PD_BUILD_OP(fdl_cpu_paged_attention)
    .Inputs({"q", "k_cache", "v_cache", "block_tables", "rows", "lens"})
    .Outputs({"out"})
    .Attrs({"scale: float", "per_token: bool", "num_threads: int"})
    .SetKernelFn(PD_KERNEL(PagedAttentionCpu))
    .SetInferShapeFn(PD_INFER_SHAPE(PagedAttentionCpuInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PagedAttentionCpuInferDtype));

std::vector<std::vector<int64_t>> PagedAttentionCpuFp8InferShape(
    const std::vector<int64_t>& q, const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&) {
  return {{q[0], q[1] * q[2]}};
}

std::vector<paddle::DataType> PagedAttentionCpuFp8InferDtype(const paddle::DataType& q, const paddle::DataType&,
                                                             const paddle::DataType&, const paddle::DataType&,
                                                             const paddle::DataType&, const paddle::DataType&,
                                                             const paddle::DataType&, const paddle::DataType&) {
  return {q};
}

PD_BUILD_OP(fdl_cpu_paged_attention_fp8)
    .Inputs({"q", "k_cache", "k_scale", "v_cache", "v_scale", "block_tables", "rows", "lens"})
    .Outputs({"out"})
    .Attrs({"scale: float", "per_token: bool", "num_threads: int"})
    .SetKernelFn(PD_KERNEL(PagedAttentionCpuFp8))
    .SetInferShapeFn(PD_INFER_SHAPE(PagedAttentionCpuFp8InferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PagedAttentionCpuFp8InferDtype));

// Lets the loader confirm it opened the library it built (and which code paths it has).
extern "C" int fdl_cpu_ops_abi(void) {
#ifdef FDL_AVX2
  return 1001;
#else
  return 1000;
#endif
}
