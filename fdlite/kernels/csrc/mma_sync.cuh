// Tensor-core primitives shared by fdlite's mma.sync kernels (the paged-attention tile and decode kernels,
// attention_mma.cuh and attention_decode_mma.cuh, and the grouped expert GEMMs, moe_gemm_mma.cuh): ldmatrix loads
// from shared memory, the m16n8k16 and m16n8k8 bf16 / fp16 MMAs with fp32 accumulators, and the packing of two floats
// into one register. One copy, so the kernels agree on the fragment layouts they rely on:
//   A (16x16, row-major) a0..a3 = (row g, k 0-7), (row g + 8, k 0-7), (row g, k 8-15), (row g + 8, k 8-15);
//   B (16x8, "col": an [n][k] row-major tile) b0 = k 0-7, b1 = k 8-15 of column g;
//   C c0, c1 = row g, columns 2 q, 2 q + 1; c2, c3 = row g + 8, same columns (g = lane / 4, q = lane % 4).
#pragma once

#include "ops_common.cuh"

namespace fdl {
namespace {

__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const void* p) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], const void* p) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// c += a (16x16, row-major) * b (16x8, column-major), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<__half>(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same MMA over the tile's rows 0-7 only (`R` = 1: A rows 8-15 zero, their accumulators not kept: a = {a0, a2},
// c = {c0, c1}) or over all 16 (`R` = 2: a = {a0, a1, a2, a3}, c = {c0..c3}).
template <typename T>
__device__ __forceinline__ void mma16816_lo(float (&c)[2], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  float d2, d3;  // rows 8-15: zero queries, results dropped
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %10, %10};\n"
        : "+f"(c[0]), "+f"(c[1]), "=f"(d2), "=f"(d3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.f));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %10, %10};\n"
        : "+f"(c[0]), "+f"(c[1]), "=f"(d2), "=f"(d3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.f));
}
template <typename T, int R>
__device__ __forceinline__ void mma16816_rows(float (&c)[2 * R], const uint32_t (&a)[2 * R], uint32_t b0, uint32_t b1) {
  if constexpr (R == 2) mma16816<T>(c, a, b0, b1);
  else mma16816_lo<T>(c, a[0], a[1], b0, b1);
}

// c += a (16x8, row-major) * b (8x8, column-major): a0 = (row g, k 2q, 2q + 1), a1 = row g + 8; b0 = (k 2q, 2q + 1,
// column g); R as mma16816_rows (R = 1: a = {a0}, c = {c0, c1}).
template <typename T>
__device__ __forceinline__ void mma1688(float c[4], uint32_t a0, uint32_t a1, uint32_t b0);
template <>
__device__ __forceinline__ void mma1688<__nv_bfloat16>(float c[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(b0));
}
template <>
__device__ __forceinline__ void mma1688<__half>(float c[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(b0));
}
template <typename T>
__device__ __forceinline__ void mma1688_lo(float (&c)[2], uint32_t a0, uint32_t b0) {
  float d2, d3;
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %7, %7};\n"
                 : "+f"(c[0]), "+f"(c[1]), "=f"(d2), "=f"(d3)
                 : "r"(a0), "r"(0u), "r"(b0), "f"(0.f));
  else
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %7, %7};\n"
                 : "+f"(c[0]), "+f"(c[1]), "=f"(d2), "=f"(d3)
                 : "r"(a0), "r"(0u), "r"(b0), "f"(0.f));
}
template <typename T, int R>
__device__ __forceinline__ void mma1688_rows(float (&c)[2 * R], const uint32_t (&a)[R], uint32_t b0) {
  if constexpr (R == 2) mma1688<T>(c, a[0], a[1], b0);
  else mma1688_lo<T>(c, a[0], b0);
}

// Two floats as one register of two T (the lower column in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

}  // namespace
}  // namespace fdl
