"""Linear layers, whole or split across tensor-parallel ranks (Megatron's column/row pairing).

Weights are stored [in, out] (Paddle's CPU matmul pays a full copy for `transpose_y`; the loader
transposes Hugging Face's [out, in] once). A column-parallel layer holds a slice of the output
columns and needs no communication; the row-parallel layer after it holds the matching slice of the
input rows, so its matmul yields a partial sum that one all-reduce completes. Attention (qkv ->
o_proj) and the MLP (gate_up -> down) thus cost one all-reduce each per layer.
"""

from __future__ import annotations

import paddle
from paddle import nn

from fdlite.distributed.communicator import tensor_parallel_all_reduce


class Linear(nn.Layer):
    """y = x @ W (+ b) with W stored [in, out]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str):
        super().__init__()
        self.weight = self.create_parameter([in_features, out_features], dtype=dtype)
        self.bias = self.create_parameter([out_features], dtype=dtype, is_bias=True) if bias else None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        y = paddle.matmul(x, self.weight)
        return y + self.bias if self.bias is not None else y


class ColumnParallelLinear(Linear):
    """This rank's output columns (and their bias): `out_features` is the per-rank width.

    For the fused qkv and gate_up matrices the columns are this rank's share of each part, side by
    side ([q | k | v] and [gate | up]), so the split after the matmul is the same as with one rank.
    """


class RowParallelLinear(Linear):
    """This rank's input rows: a partial product, summed over ranks; the bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str, tp_size: int):
        super().__init__(in_features, out_features, bias, dtype)
        self.tp_size = tp_size

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        y = paddle.matmul(x, self.weight)
        if self.tp_size > 1:
            y = tensor_parallel_all_reduce(y)
        return y + self.bias if self.bias is not None else y
