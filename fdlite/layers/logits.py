"""`LogitsProcessor`: float32 logits over the whole vocabulary, for the rows that sample only.

A prefill computes hidden states for every prompt token but samples from the last one, so the LM head
runs on the gathered rows (`logits_indices`), not on all tokens: at a 150k vocabulary it is the
largest GEMM of a step. The head is the model's own (`lm_head`, [hidden, vocab_per_rank]) or, tied,
the embedding read transposed ([vocab_per_rank, hidden]).

CPU: gather, matmul (a tied head uses a transposed copy made once: Paddle's CPU matmul pays a full
copy for `transpose_y` on every call), then float32. GPU: one gather kernel and one cuBLASLt GEMM that
reads the tied embedding transposed for free and writes float32 directly. With tensor parallelism
each rank computes its vocabulary slice and an all-gather joins them (on a GPU, fdlite's gather
kernel writes the [tokens, vocab] result directly: `Communicator.all_gather_last_axis`).
"""

from __future__ import annotations

import paddle

from fdlite.kernels import gpu as gpu_ops
from fdlite.kernels.custom_op import CustomOp


class LogitsProcessor(CustomOp):
    def __init__(self, head, embedding, vocab_size: int, tp_size: int):
        super().__init__()
        # A tuple, so Paddle does not register the model's own layers a second time under this one.
        self._layers = (head, embedding)
        self.vocab_size = vocab_size
        self.tp_size = tp_size
        self._tied_t: paddle.Tensor | None = None

    def _local_cpu(self, hidden: paddle.Tensor) -> paddle.Tensor:
        head, embedding = self._layers
        if head is not None:
            return paddle.matmul(hidden, head.weight)
        if self._tied_t is None:
            self._tied_t = embedding.weight.t().contiguous()
        return paddle.matmul(hidden, self._tied_t)

    def forward_cpu(self, hidden: paddle.Tensor, logits_indices: paddle.Tensor) -> paddle.Tensor:
        local = self._local_cpu(paddle.gather(hidden, logits_indices))
        return gather_vocab(local, self.vocab_size, self.tp_size).astype("float32")

    def forward_gpu(self, hidden: paddle.Tensor, logits_indices: paddle.Tensor) -> paddle.Tensor:
        head, embedding = self._layers
        if head is not None:
            local = gpu_ops.lm_head_logits(hidden, logits_indices, head.weight, trans_w=head.weight_out_in,
                                           static_w=True)
        else:
            local = gpu_ops.lm_head_logits(hidden, logits_indices, embedding.weight, trans_w=True, static_w=True)
        return gather_vocab(local, self.vocab_size, self.tp_size)


def gather_vocab(local_logits: paddle.Tensor, vocab_size: int, tp_size: int) -> paddle.Tensor:
    """[tokens, vocab_per_rank] on each of `tp_size` ranks -> [tokens, vocab_size] on every rank."""
    if tp_size == 1:
        return local_logits
    from fdlite.distributed.communicator import get_communicator  # noqa: PLC0415

    return get_communicator().all_gather_last_axis(local_logits, vocab_size)
