// Paddle custom op `custom_all_reduce` over fdlite's C ABI (custom_all_reduce_capi.h).
//
// Hand-written because FastDeploy's own binding is tied to its build; this one only
// forwards a Paddle tensor, its stream and the handle made by the Python side
// (fdlite.kernels.allreduce.custom_all_reduce.CustomAllReduce, attribute `handle` = its
// fdar_ctx pointer) to the same library the ctypes loader and the GPU harness use.
// Built by fdlite/kernels/setup_ops.py with paddle.utils.cpp_extension on GPU machines;
// the extension also exports the fdar_* C symbols, so FDLITE_OPS_LIB may point at it.
#include <string>
#include <vector>

#include "custom_all_reduce_capi.h"
#include "paddle/extension.h"

namespace {

int fdar_dtype(paddle::DataType t) {
  switch (t) {
    case paddle::DataType::BFLOAT16:
      return FDAR_BF16;
    case paddle::DataType::FLOAT16:
      return FDAR_FP16;
    case paddle::DataType::FLOAT32:
      return FDAR_FP32;
    default:
      PD_THROW("custom_all_reduce supports bfloat16, float16 and float32");
  }
}

}  // namespace

// Out of place: inside graph capture the kernel then reads `x` where it lies (through
// the registered-pointer table) instead of copying it into the staging buffer.
std::vector<paddle::Tensor> CustomAllReduceForward(const paddle::Tensor& x, int64_t handle) {
  PD_CHECK(x.is_gpu(), "custom_all_reduce: x must be on the GPU");
  PD_CHECK(handle != 0, "custom_all_reduce: null handle");
#if defined(PADDLE_WITH_CUDA)
  void* stream = reinterpret_cast<void*>(x.stream());
#else
  // A CPU-only Paddle (e.g. the CPU wheel used to compile-check this file) has no
  // Tensor::stream(); the op still registers, and refuses to run.
  void* stream = nullptr;
  PD_THROW("custom_all_reduce: this Paddle build has no CUDA");
#endif
  paddle::Tensor out = paddle::empty_like(x);
  const int rc = fdar_all_reduce(reinterpret_cast<fdar_ctx*>(handle), x.data(), out.data(),
                                 x.numel(), fdar_dtype(x.dtype()), stream);
  PD_CHECK(rc == 0, "custom_all_reduce failed (", rc, "): ", std::string(fdar_last_error()));
  return {out};
}

std::vector<std::vector<int64_t>> CustomAllReduceInferShape(const std::vector<int64_t>& x) {
  return {x};
}

std::vector<paddle::DataType> CustomAllReduceInferDtype(const paddle::DataType& x) { return {x}; }

PD_BUILD_OP(custom_all_reduce)
    .Inputs({"x"})
    .Outputs({"out"})
    .Attrs({"handle: int64_t"})
    .SetKernelFn(PD_KERNEL(CustomAllReduceForward))
    .SetInferShapeFn(PD_INFER_SHAPE(CustomAllReduceInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(CustomAllReduceInferDtype));
