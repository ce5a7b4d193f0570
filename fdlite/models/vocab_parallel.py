"""The LM head split across tensor-parallel ranks by vocabulary rows.

Rank r holds vocabulary rows [r * n, (r + 1) * n) with n = ceil(vocab / tp) (`TPPartition`), like the
embedding (`fdlite.layers.embedding`); the head computes this rank's slice of the logits and
`fdlite.layers.logits` joins the slices. With a tied head the embedding's rows serve both.
"""

from __future__ import annotations

from fdlite.models.tp_partition import TPPartition
from fdlite.layers.linear import Linear


class ParallelLMHead(Linear):
    """This rank's vocabulary slice of the LM head: [hidden, vocab_per_rank] on CPU, transposed on GPU (`Linear`)."""

    def __init__(self, hidden: int, dtype: str, partition: TPPartition):
        super().__init__(hidden, partition.vocab_per_rank, False, dtype)
