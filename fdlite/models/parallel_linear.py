"""Linear layers split across tensor-parallel ranks (Megatron's column/row pairing).

A column-parallel layer holds a slice of the output columns and needs no communication; the
row-parallel layer after it holds the matching slice of the input rows, so its matmul yields a
partial sum that one all-reduce completes. Attention (qkv -> o_proj) and the MLP (gate_up -> down)
thus cost one all-reduce each per layer. The matmul itself is the device's (`fdlite.layers.linear`).
"""

from __future__ import annotations

import paddle

from fdlite.distributed.communicator import tensor_parallel_all_reduce
from fdlite.layers.linear import Linear
from fdlite.models.tp_partition import TPPartition


class ColumnParallelLinear(Linear):
    """This rank's output columns (and their bias): `out_features` is the per-rank width.

    For the fused qkv and gate_up matrices the columns are this rank's share of each part, side by
    side ([q | k | v] and [gate | up]), so the split after the matmul is the same as with one rank.
    """


class RowParallelLinear(Linear):
    """This rank's input rows: a partial product, summed over ranks, the bias counted once.

    CPU adds the bias after the sum; GPU lets rank 0 add it in the GEMM epilogue before the sum (no
    extra kernel), which is the same value: the bias enters the all-reduce from one rank only.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str, tp: TPPartition):
        super().__init__(in_features, out_features, bias, dtype)
        self.tp_size, self.tp_rank = tp.size, tp.rank

    def forward_cpu(self, x: paddle.Tensor) -> paddle.Tensor:
        y = super().forward_cpu(x, add_bias=self.tp_size == 1)
        if self.tp_size == 1:
            return y
        y = tensor_parallel_all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def forward_gpu(self, x: paddle.Tensor) -> paddle.Tensor:
        y = super().forward_gpu(x, add_bias=self.tp_rank == 0)
        return tensor_parallel_all_reduce(y) if self.tp_size > 1 else y
