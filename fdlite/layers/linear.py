"""y = x W^T (+ b): Paddle's matmul on CPU, fdlite's GEMV / cuBLASLt (bias in the epilogue) on GPU.

The weight's orientation is the device's, fixed at construction (`weight_out_in`):

- CPU: [in, out], because Paddle's CPU matmul pays a full copy for `transpose_y`.
- GPU: [out, in] (Hugging Face's own), because the decode-time GEMV (M <= 4 rows, `ops_linear.cu`)
  reads each output's weights as one contiguous row, and cuBLASLt runs the transposed operand at the
  same speed for larger batches (measured, docs/benchmarks.md).

The loader writes the checkpoint into either orientation with one copy. The tensor-parallel variants
(models/parallel_linear.py) build on this one and decide which rank adds the bias.
"""

from __future__ import annotations

import paddle

from fdlite.kernels import gpu as gpu_ops
from fdlite.kernels import platform
from fdlite.kernels.custom_op import CustomOp


class Linear(CustomOp):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str):
        super().__init__()
        self.weight_out_in = platform.is_gpu()
        shape = [out_features, in_features] if self.weight_out_in else [in_features, out_features]
        self.weight = self.create_parameter(shape, dtype=dtype)
        self.bias = self.create_parameter([out_features], dtype=dtype, is_bias=True) if bias else None

    def forward_cpu(self, x: paddle.Tensor, add_bias: bool = True) -> paddle.Tensor:
        y = paddle.matmul(x, self.weight)
        return y + self.bias if add_bias and self.bias is not None else y

    def forward_gpu(self, x: paddle.Tensor, add_bias: bool = True) -> paddle.Tensor:
        return gpu_ops.linear(x, self.weight, self.bias if add_bias else None, trans_w=self.weight_out_in,
                              static_w=True)
