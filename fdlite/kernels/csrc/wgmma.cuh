// Hopper (sm_90a) building blocks shared by the warp-specialized wgmma kernels (attention_wgmma.cuh,
// moe_gemm_wgmma.cuh): mbarriers and named barriers for the hand-over between a loader warpgroup and computing
// warpgroups, the 128-byte swizzle that cp.async gathers write and wgmma reads, TMA tile loads (the same layout,
// for operands that are tiles of a 2D tensor), shared-memory matrix descriptors, and the wgmma instructions
// themselves (inline PTX: the CUDA toolkit has no intrinsics for them).
// The instructions exist only in sm_90a code (__CUDA_ARCH_FEAT_SM90_ALL); `wgmma_ready()` tells the host whether
// such code was built (FDL_HAVE_SM90A, set by build.py) and can run on the current GPU.
#pragma once

#include <cuda.h>          // CUtensorMap
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include "ops_common.cuh"

namespace fdl {
namespace {

// Whether a wgmma kernel can run: the library was compiled for sm_90a (FDL_HAVE_SM90A, set by build.py when
// FDLITE_CUDA_ARCHS holds "90a") and the device is compute capability 9.0, the only one sm_90a code runs on.
inline bool wgmma_ready() {
#if defined(FDL_HAVE_SM90A)
  return compute_capability() == 90;
#else
  return false;
#endif
}

// mbarriers in shared memory (addresses in the shared window).
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives and expects `bytes` more of asynchronous copies (TMA) to complete on this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Returns once the phase of parity `parity` has completed (a phase not yet begun counts as the previous one).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// Named barriers (id 0 is __syncthreads'): sync waits for `count` threads to reach id, arrive counts itself and
// goes on (the attention kernel's computing warpgroups take turns issuing MMAs through barriers 1 and 2).
__device__ __forceinline__ void named_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// TMA: the box at (column x, row y) of the 2D tensor that `map` describes, copied into shared memory at `dst`
// (128-byte swizzled, 1024-aligned: the layout sw128 gives), its bytes completing on mbarrier `bar`. Out-of-range
// parts of the box read as zeros.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// The tensor map of a row-major [rows, cols] matrix of 2-byte elements (bf16 / fp16) read in boxes of 64 columns
// (one 128-byte swizzled panel) by `box_rows` rows. The driver's encoder is reached through the runtime (no
// link to libcuda). cols * 2 must be a multiple of 16 and the base 16-byte aligned (the callers check both).
inline CUtensorMap tma_map_2d(const void* base, int64_t rows, int64_t cols, int box_rows, const char* op) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                           &found);
    return e == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn) : nullptr;
  }();
  PD_CHECK(encode != nullptr, op, ": the CUDA driver has no cuTensorMapEncodeTiled (TMA needs a CUDA 12 driver)");
  CUtensorMap map;
  const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)cols * 2};
  const cuuint32_t box[2] = {64, (cuuint32_t)box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<void*>(base), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  PD_CHECK(r == CUDA_SUCCESS, op, ": cuTensorMapEncodeTiled failed (", (int)r, ") for a [", rows, ", ", cols,
           "] matrix");
  return map;
}

// Byte offset of 16-byte piece `c` (0-7) of row `r` in a 128-byte-swizzled panel.
__device__ __forceinline__ int sw128(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// wgmma shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte offsets
// (16-byte units; the leading offset matters only for N-major operands wider than one panel).
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// The descriptor of the matrix `bytes` further on in shared memory: only the start address field (bits 0-13, 16-byte
// units) changes, and it never carries into the next field (shared memory ends below 2^18 bytes), so a kernel builds
// one descriptor per stage and steps through its k-slices and panels with one 32-bit add each.
__device__ __forceinline__ uint64_t wg_desc_add(uint64_t d, uint32_t bytes) {
  return (d & 0xFFFFFFFF00000000ull) | (uint32_t)((uint32_t)d + (bytes >> 4));
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// cp.async writes shared memory through the generic proxy, wgmma reads it through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// The loader's side of the hand-over of cp.async-filled stages to wgmma, LAG chunks behind its copies (each chunk's
// copies one commit group): after committing chunk i, chunk i - LAG has landed; it is made visible to the MMAs (the
// async proxy) and its stage marked full (mbarrier full0 + 8 ((i - LAG) % stages)). `issued`: chunks committed since
// the last stages_rest_full (chunk i included), so the chunks before it are not marked twice.
template <int LAG>
__device__ __forceinline__ void stage_full_lagging(uint32_t full0, int stages, int i, int issued) {
  if (issued > LAG) {
    cp_async_wait<LAG>();
    fence_proxy_async();
    mbar_arrive(full0 + 8 * ((i - LAG) % stages));
  }
}
// ... and the last min(n, LAG) of the n chunks committed since, ending before chunk `end`, marked full as they land.
template <int LAG>
__device__ __forceinline__ void stages_rest_full(uint32_t full0, int stages, int end, int n) {
  static_assert(LAG <= 2, "the waits below count down from one group in flight");
  for (int c = max(0, n - LAG); c < n; ++c) {  // chunk end - n + c
    if (n - 1 - c >= 1) cp_async_wait<1>();
    else cp_async_wait<0>();
    fence_proxy_async();
    mbar_arrive(full0 + 8 * ((end - n + c) % stages));
  }
}

// The dynamic shared memory from the first 1024-byte boundary at or after p: the 128-byte swizzle repeats every
// 1024 bytes of the shared address space, from a 1024-aligned address (kernels reserve 1024 bytes more for it).
__device__ __forceinline__ uint8_t* smem_align1024(void* p) {
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(p);
  return reinterpret_cast<uint8_t*>(p) + (((base + 1023) & ~1023u) - base);
}

// Keeps the compiler from moving reads or writes of accumulators across a wgmma issue or wait.
template <int N>
__device__ __forceinline__ void wg_pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 x 64, fp32) (+)= A (64 x 16, K-major in smem) * B (16 x 64, K-major in smem); scale_d 0: d = A B.
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t da, uint64_t db, int scale_d);
// d (64 x 64, fp32) += A (64 x 16, registers) * B (16 x 64, N-major in smem).
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16_rs_tb(float (&d)[32], const uint32_t (&a)[4], uint64_t db);

// d (64 x 256, fp32) += A (64 x 16, K-major in smem) * B (16 x 256, K-major in smem).
template <typename T>
__device__ __forceinline__ void wgmma_m64n256k16_ss(float (&d)[128], uint64_t da, uint64_t db);

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// One definition per element type: inline PTX needs the type's name as a literal (PT: "bf16" or "f16").
#define FDL_WGMMA_M64N64K16(T, PT)                                                                          \
  template <>                                                                                               \
  __device__ __forceinline__ void wgmma_m64n64k16_ss<T>(float (&d)[32], uint64_t da, uint64_t db, int scale_d) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                 \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PT "." PT " "                                 \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}" ", %32, %33, p, 1, 1, 0, 0;\n}\n"      \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),    \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),    \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),    \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                                               \
                 : "l"(da), "l"(db), "r"(scale_d));                                                          \
  }                                                                                                         \
  template <>                                                                                               \
  __device__ __forceinline__ void wgmma_m64n64k16_rs_tb<T>(float (&d)[32], const uint32_t (&a)[4], uint64_t db) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                 \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PT "." PT " "                                 \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}" ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),    \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),    \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),    \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                                               \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));                             \
  }
FDL_WGMMA_M64N64K16(__nv_bfloat16, "bf16")
FDL_WGMMA_M64N64K16(__half, "f16")
#undef FDL_WGMMA_M64N64K16
#define FDL_WGMMA_M64N256K16(T, PT) \
  template <> \
  __device__ __forceinline__ void wgmma_m64n256k16_ss<T>(float (&d)[128], uint64_t da, uint64_t db) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." PT "." PT " {" \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
                 "}, %128, %129, p, 1, 1, 0, 0;\n}\n" \
                 : \
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
                 : "l"(da), "l"(db), "r"(1)); \
  }
FDL_WGMMA_M64N256K16(__nv_bfloat16, "bf16")
FDL_WGMMA_M64N256K16(__half, "f16")
#undef FDL_WGMMA_M64N256K16
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace
}  // namespace fdl
