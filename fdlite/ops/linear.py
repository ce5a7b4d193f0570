"""y = x @ W (+ b) with W stored [in, out]: Paddle's matmul on CPU, cuBLASLt (bias in its epilogue) on GPU.

Weights are [in, out] because Paddle's CPU matmul pays a full copy for `transpose_y`; the loader
transposes Hugging Face's [out, in] once. The tensor-parallel variants (models/parallel_linear.py)
build on this one and decide which rank adds the bias.
"""

from __future__ import annotations

import paddle

from fdlite.ops import gpu as gpu_ops
from fdlite.ops.custom_op import CustomOp


class Linear(CustomOp):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str):
        super().__init__()
        self.weight = self.create_parameter([in_features, out_features], dtype=dtype)
        self.bias = self.create_parameter([out_features], dtype=dtype, is_bias=True) if bias else None

    def forward_cpu(self, x: paddle.Tensor, add_bias: bool = True) -> paddle.Tensor:
        y = paddle.matmul(x, self.weight)
        return y + self.bias if add_bias and self.bias is not None else y

    def forward_gpu(self, x: paddle.Tensor, add_bias: bool = True) -> paddle.Tensor:
        return gpu_ops.linear(x, self.weight, self.bias if add_bias else None)
