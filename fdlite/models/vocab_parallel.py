"""Embedding and LM head split across tensor-parallel ranks by vocabulary rows.

Rank r holds rows [r * n, (r + 1) * n) with n = ceil(vocab / tp) (`TPPartition`). The embedding
looks up the tokens it holds, writes zeros for the others, and one all-reduce assembles every
token's vector. The LM head computes this rank's slice of the logits; an all-gather puts the slices
side by side, and the padding columns past the vocabulary are cut away. With a tied head the same
rows serve both.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from fdlite.models.parallel_linear import Linear
from fdlite.models.tp_partition import TPPartition
from fdlite.distributed.communicator import get_communicator, tensor_parallel_all_reduce


class VocabParallelEmbedding(nn.Layer):
    def __init__(self, dim: int, dtype: str, partition: TPPartition):
        super().__init__()
        self.weight = self.create_parameter([partition.vocab_per_rank, dim], dtype=dtype)
        self.tp_size = partition.size
        self.vocab_start = partition.rank * partition.vocab_per_rank
        self.vocab_per_rank = partition.vocab_per_rank

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        held = (local >= 0) & (local < self.vocab_per_rank)
        out = F.embedding(paddle.where(held, local, paddle.zeros_like(local)), self.weight)
        out = out * held.unsqueeze(-1).astype(out.dtype)
        return tensor_parallel_all_reduce(out)


class ParallelLMHead(Linear):
    """This rank's vocabulary columns of the LM head, stored [hidden, vocab_per_rank]."""

    def __init__(self, hidden: int, dtype: str, partition: TPPartition):
        super().__init__(hidden, partition.vocab_per_rank, False, dtype)


def gather_vocab(local_logits: paddle.Tensor, partition: TPPartition) -> paddle.Tensor:
    """[tokens, vocab_per_rank] on each rank -> [tokens, vocab] on every rank."""
    if partition.size == 1:
        return local_logits
    full = get_communicator().all_gather_last_axis(local_logits)
    return full[:, : partition.vocab_size] if full.shape[-1] != partition.vocab_size else full
