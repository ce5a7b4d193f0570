// The ops library's run-time switches, in one instance for the whole library (an inline function's static).
// The C++ side reads no environment: fdlite/kernels/gpu.py sets them once, from fdlite/envs.py, through
// `fdl_set_options` (ops_capi.cu) when it loads the library, before any op runs. No Paddle or CUDA headers.
#pragma once

namespace fdl {

struct Options {
  // FDLITE_PDL: 0 = never; 1 = every launch that allows it; 2 (default) = only when the previous launch on
  // this thread was one of ours too (after cuBLAS or a copy, a normal launch: see `note_foreign_work` in
  // ops_common.cuh).
  int pdl = 2;
  // FDLITE_GEMV: false sends [N, K] weights at <= 4 rows to cuBLASLt too (ops_linear.cu).
  bool gemv = true;
  // FDLITE_ATTN_MMA: the bf16 / fp16 prefill attention kernel (ops_attention.cu): 2 (default) wgmma where the
  // library has sm_90a code and the GPU is sm_90, else mma.sync; 1 mma.sync; 0 the CUDA-core tile kernel (for
  // side-by-side measurements).
  int attn_mma = 2;
  // FDLITE_DECODE_MMA: false sends bf16 / fp16 decode attention to the CUDA-core per-token kernel instead of the
  // mma.sync one (ops_attention.cu, decode_on_mma; for side-by-side measurements).
  bool decode_mma = true;
  // FDLITE_DECODE_SPLIT_KEYS: in decode-only steps a row of more keys than this gets ceil(keys / this) KV splits, up
  // to kMaxRowSplits (ops_attention.cu, decode_split); twice this over FP8 caches (the same bytes a split); 0 = the
  // shape rule's count for every row. 0 or a multiple of 64 up to 4096.
  int decode_split_keys = 512;
};

inline Options& options() {
  static Options o;
  return o;
}

}  // namespace fdl
