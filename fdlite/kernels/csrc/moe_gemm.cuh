// The contract shared by the two grouped expert GEMM kernels of fdl_moe_experts (ops_moe.cu): the
// tensor-core one for bf16 / fp16 (moe_gemm_mma.cuh) and the fp32 one (moe_gemm_fma.cuh). Both read A rows
// through the sorted row list of moe_align.cuh, B from one expert's [out, in] weights, and end in one of
// two epilogues: gated (gate/up -> SiLU-and-multiply into act) or down (times the choice's router weight,
// into the choice's own row of y).
#pragma once

#include "ops_common.cuh"

namespace fdl {
namespace {

struct MoeGemmArgs {
  const void* a;             // gated: x [T, K]; down: act [rows, K]
  const void* w;             // gated: w13 [E, 2N, K]; down: w2 [E, N, K]
  void* out;                 // gated: act [rows, N]; down: y [T k, N]
  const int* sorted_rows;    // [tiles_max * BM]
  const int* tile_expert;    // [tiles_max]
  const float* topk_w;       // [T k] (down only)
  int N, K, topk;
};

}  // namespace
}  // namespace fdl
