"""Token embedding split across tensor-parallel ranks by vocabulary rows.

Rank r holds rows [r * n, (r + 1) * n) with n = ceil(vocab / tp) (`TPPartition`). Each rank looks up
the tokens it holds, writes zeros for the others, and one all-reduce assembles every token's vector.
CPU: a row gather plus a mask (not `F.embedding`: its padding-index check reads the table's row count, which SOT
makes symbolic once a second model with another vocabulary is translated in the process, and then refuses every
index); GPU: one gather kernel that writes the zeros itself.
"""

from __future__ import annotations

import paddle

from fdlite.distributed.communicator import tensor_parallel_all_reduce
from fdlite.kernels import gpu as gpu_ops
from fdlite.kernels.custom_op import CustomOp


class VocabParallelEmbedding(CustomOp):
    def __init__(self, dim: int, dtype: str, vocab_per_rank: int, tp_rank: int, tp_size: int):
        super().__init__()
        self.weight = self.create_parameter([vocab_per_rank, dim], dtype=dtype)
        self.tp_size = tp_size
        self.vocab_start = tp_rank * vocab_per_rank
        self.vocab_per_rank = vocab_per_rank

    def forward_cpu(self, ids: paddle.Tensor) -> paddle.Tensor:
        if self.tp_size == 1:
            return paddle.gather(self.weight, ids)
        local = ids - self.vocab_start
        held = (local >= 0) & (local < self.vocab_per_rank)
        out = paddle.gather(self.weight, paddle.where(held, local, paddle.zeros_like(local)))
        out = out * held.unsqueeze(-1).astype(out.dtype)
        return tensor_parallel_all_reduce(out)

    def forward_gpu(self, ids: paddle.Tensor) -> paddle.Tensor:
        out = gpu_ops.embedding(ids, self.weight, self.vocab_start)
        return tensor_parallel_all_reduce(out) if self.tp_size > 1 else out
