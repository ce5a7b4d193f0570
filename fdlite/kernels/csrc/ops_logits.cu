// Logits processors on the GPU, in place on the float32 logits [R, V] before the sampler draws: the
// repetition / frequency / presence penalties from per-slot token tables kept on the device, sparse
// (row, token) updates (min_tokens bans, and the tables' own upkeep), and the grammar bitmask of
// structured outputs. Hand-written for the same reason as the rest (ops_common.cuh), and so that a
// batch with any of these features never copies logits to the host (the CPU sampler's numpy code did
// that for such rows, 600 KB a row at a 150k vocabulary).
//
// The arithmetic is the CPU sampler's (fdlite/sample/sampler.py, apply_penalties), operation by operation
// in float32 with round-to-nearest and no contraction, so both give the same bits:
//   seen = count > 0 or in the prompt;  x = seen ? (x > 0 ? x / rep : x * rep) : x
//   x = (x - freq * count) - pres * (count > 0)
// A launch's grid depends only on the number of rows and the vocabulary; each element is its own.
#include <math_constants.h>

#include <algorithm>
#include <type_traits>

#include "ops_common.cuh"

namespace fdl {
namespace {

constexpr int NT = 256;
constexpr int kMaxColBlocks = 64;  // blocks per row: V = 151,936 is 594 chunks of 256, 10 per block

inline dim3 row_grid(int64_t rows, int V) {
  return dim3((unsigned)std::min<int64_t>(ceil_div(V, NT), kMaxColBlocks), (unsigned)rows);
}

__global__ void penalties_kernel(float* __restrict__ logits, int V, const int64_t* __restrict__ rows,
                                 const int64_t* __restrict__ slots, const float* __restrict__ counts,
                                 const uint8_t* __restrict__ prompt, const float* __restrict__ rep,
                                 const float* __restrict__ freq, const float* __restrict__ pres) {
  const int p = blockIdx.y;
  float* x = logits + rows[p] * (int64_t)V;
  const float* c = counts + slots[p] * (int64_t)V;
  const uint8_t* in_prompt = prompt + slots[p] * (int64_t)V;
  const float r = rep[p], f = freq[p], q = pres[p];
  for (int v = blockIdx.x * NT + threadIdx.x; v < V; v += gridDim.x * NT) {
    float l = x[v];
    const float n = c[v];
    if (n > 0.f || in_prompt[v]) l = l > 0.f ? __fdiv_rn(l, r) : __fmul_rn(l, r);
    l = __fsub_rn(l, __fmul_rn(f, n));
    l = __fsub_rn(l, __fmul_rn(q, n > 0.f ? 1.f : 0.f));
    x[v] = l;
  }
}

template <typename T>
__global__ void scatter_kernel(T* __restrict__ dst, int64_t V, const int64_t* __restrict__ rows,
                               const int64_t* __restrict__ cols, const float* __restrict__ values, int64_t n,
                               bool add) {
  const int64_t i = (int64_t)blockIdx.x * NT + threadIdx.x;
  if (i >= n) return;
  T* at = dst + rows[i] * V + cols[i];
  if constexpr (std::is_same<T, float>::value) {
    if (add) atomicAdd(at, values[i]);  // a token may repeat in one call (a sequence's outputs)
    else *at = values[i];
  } else {
    *at = (T)(add ? (float)*at + values[i] : values[i]);  // uint8 marks: set only (checked by the op)
  }
}

__global__ void bitmask_kernel(float* __restrict__ logits, int V, const int64_t* __restrict__ rows,
                               const int32_t* __restrict__ mask, int words) {
  const int c = blockIdx.y;
  float* x = logits + rows[c] * (int64_t)V;
  const int32_t* m = mask + (int64_t)c * words;
  for (int v = blockIdx.x * NT + threadIdx.x; v < V; v += gridDim.x * NT)
    if (!((m[v >> 5] >> (v & 31)) & 1)) x[v] = -CUDART_INF_F;
}

void check_index(const paddle::Tensor& t, int64_t n, const char* op, const char* name) {
  check_gpu(t, op, name);
  PD_CHECK(t.dtype() == paddle::DataType::INT64 && t.numel() == n, op, ": ", name, " must be int64 [", n, "]");
}

void check_param(const paddle::Tensor& t, int64_t n, const char* op, const char* name) {
  check_gpu(t, op, name);
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT32 && t.numel() == n, op, ": ", name, " must be float32 [", n, "]");
}

}  // namespace
}  // namespace fdl

using namespace fdl;

// fdl_apply_penalties_(logits [R, V] f32, rows [P] i64, slots [P] i64, counts [S, V] f32, prompt [S, V] u8,
//                      rep [P] f32, freq [P] f32, pres [P] f32): penalties on rows `rows` of logits, in place,
// row p reading the token tables' row slots[p].
std::vector<paddle::Tensor> ApplyPenalties(paddle::Tensor& logits, const paddle::Tensor& rows,
                                           const paddle::Tensor& slots, const paddle::Tensor& counts,
                                           const paddle::Tensor& prompt, const paddle::Tensor& rep,
                                           const paddle::Tensor& freq, const paddle::Tensor& pres) {
  const char* op = "fdl_apply_penalties_";
  check_gpu(logits, op, "logits");
  PD_CHECK(logits.dtype() == paddle::DataType::FLOAT32 && logits.shape().size() == 2, op, ": logits must be [R, V] float32");
  const int V = (int)logits.shape()[1];
  const int64_t P = rows.numel();
  check_index(rows, P, op, "rows");
  check_index(slots, P, op, "slots");
  check_gpu(counts, op, "counts");
  check_gpu(prompt, op, "prompt");
  PD_CHECK(counts.dtype() == paddle::DataType::FLOAT32 && counts.shape().size() == 2 && counts.shape()[1] == V, op,
           ": counts must be [S, V] float32");
  PD_CHECK(prompt.dtype() == paddle::DataType::UINT8 && prompt.shape() == counts.shape(), op,
           ": prompt must be [S, V] uint8, the shape of counts");
  check_param(rep, P, op, "rep");
  check_param(freq, P, op, "freq");
  check_param(pres, P, op, "pres");
  if (P > 0)
    launch("penalties_kernel", penalties_kernel, row_grid(P, V), NT, 0, stream_of(logits), false, logits.data<float>(), V,
           rows.data<int64_t>(), slots.data<int64_t>(), counts.data<float>(), prompt.data<uint8_t>(), rep.data<float>(),
           freq.data<float>(), pres.data<float>());
  FDL_CHECK_LAUNCH(op);
  return {};
}

PD_BUILD_OP(fdl_apply_penalties_)
    .Inputs({"Logits", "Rows", "Slots", "Counts", "Prompt", "Rep", "Freq", "Pres"})
    .Outputs({"Out"})
    .SetInplaceMap({{"Logits", "Out"}})
    .SetKernelFn(PD_KERNEL(ApplyPenalties));

// fdl_scatter_(dst [N, V] f32 or u8, rows [K] i64, cols [K] i64, values [K] f32, add): dst[rows[i], cols[i]]
// = values[i], or += values[i] with add (float32 only; repeated positions add up). Bans (-inf into logits),
// and the token tables' upkeep (counts of sampled tokens, prompt marks).
std::vector<paddle::Tensor> Scatter(paddle::Tensor& dst, const paddle::Tensor& rows, const paddle::Tensor& cols,
                                    const paddle::Tensor& values, bool add) {
  const char* op = "fdl_scatter_";
  check_gpu(dst, op, "dst");
  PD_CHECK(dst.shape().size() == 2, op, ": dst must be [N, V]");
  const int64_t K = rows.numel();
  check_index(rows, K, op, "rows");
  check_index(cols, K, op, "cols");
  check_param(values, K, op, "values");
  const int64_t V = dst.shape()[1];
  cudaStream_t s = stream_of(dst);
  if (K > 0) {
    const dim3 grid((unsigned)ceil_div(K, NT));
    if (dst.dtype() == paddle::DataType::FLOAT32) {
      launch("scatter_kernel", scatter_kernel<float>, grid, NT, 0, s, false, dst.data<float>(), V, rows.data<int64_t>(),
             cols.data<int64_t>(), values.data<float>(), K, add);
    } else {
      PD_CHECK(dst.dtype() == paddle::DataType::UINT8 && !add, op, ": dst must be float32, or uint8 without add");
      launch("scatter_kernel", scatter_kernel<uint8_t>, grid, NT, 0, s, false, dst.data<uint8_t>(), V,
             rows.data<int64_t>(), cols.data<int64_t>(), values.data<float>(), K, add);
    }
  }
  FDL_CHECK_LAUNCH(op);
  return {};
}

PD_BUILD_OP(fdl_scatter_)
    .Inputs({"Dst", "Rows", "Cols", "Values"})
    .Outputs({"Out"})
    .Attrs({"add: bool"})
    .SetInplaceMap({{"Dst", "Out"}})
    .SetKernelFn(PD_KERNEL(Scatter));

// fdl_apply_bitmask_(logits [R, V] f32, rows [C] i64, mask [C, W] i32): logits[rows[c], v] = -inf where bit
// v % 32 of word v / 32 of mask row c is 0 (llguidance's and vLLM's layout), in place.
std::vector<paddle::Tensor> ApplyBitmask(paddle::Tensor& logits, const paddle::Tensor& rows, const paddle::Tensor& mask) {
  const char* op = "fdl_apply_bitmask_";
  check_gpu(logits, op, "logits");
  PD_CHECK(logits.dtype() == paddle::DataType::FLOAT32 && logits.shape().size() == 2, op, ": logits must be [R, V] float32");
  const int V = (int)logits.shape()[1];
  const int64_t C = rows.numel();
  check_index(rows, C, op, "rows");
  check_gpu(mask, op, "mask");
  const int words = (int)ceil_div(V, 32);
  PD_CHECK(mask.dtype() == paddle::DataType::INT32 && mask.shape().size() == 2 && mask.shape()[0] == C &&
               mask.shape()[1] >= words, op, ": mask must be [C, ceil(V / 32)] int32");
  if (C > 0)
    launch("bitmask_kernel", bitmask_kernel, row_grid(C, V), NT, 0, stream_of(logits), false, logits.data<float>(), V,
           rows.data<int64_t>(), mask.data<int32_t>(), (int)mask.shape()[1]);
  FDL_CHECK_LAUNCH(op);
  return {};
}

PD_BUILD_OP(fdl_apply_bitmask_)
    .Inputs({"Logits", "Rows", "Mask"})
    .Outputs({"Out"})
    .SetInplaceMap({{"Logits", "Out"}})
    .SetKernelFn(PD_KERNEL(ApplyBitmask));
