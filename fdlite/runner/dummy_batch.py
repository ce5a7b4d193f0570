"""Dummy flat batches for the runs at startup (profiling prefill, SOT warm-up, CUDA-graph capture and its
self-check), all through the one flat-batch builder real steps use (`input_batch.flat_batch`)."""

from __future__ import annotations

import numpy as np

from fdlite.graph.capture_sizes import even_parts
from fdlite.kvcache.block_allocator import blocks_for
from fdlite.layers.forward_meta import FlatBatch
from fdlite.runner.input_batch import flat_batch


def even_split(num_tokens: int, num_seqs: int) -> list[int]:
    """`num_tokens` over at most `num_seqs` sequences, as evenly as possible."""
    return even_parts(num_tokens, max(1, min(num_seqs, num_tokens)))


def small_prefill_lengths(max_num_seqs: int, max_model_len: int, block_size: int, max_tokens: int) -> list[int]:
    """A few prompts of different lengths, the first crossing a KV-block boundary, within `max_tokens`.

    What a forward must show without measuring memory (the CPU profiling run): a prefill of several
    sequences at once through every kernel of a real step (varlen attention, block tables of more than
    one block, the cache writes, the logits of each row), at a fraction of a full step's cost.
    """
    wanted = [block_size + 1, block_size // 2 + 1, 2][:max_num_seqs]
    lengths = []
    for n in wanted:
        n = min(n, max_model_len, max_tokens - sum(lengths))
        if n < 1:
            break
        lengths.append(n)
    return lengths


def dummy_batch(lengths: list[int], block_size: int, num_blocks: int, decode: bool = False,
                rng: np.random.Generator | None = None, computed: list[int] | None = None) -> FlatBatch:
    """A flat batch of dummy sequences of the given lengths, block tables laid out from block 0.

    decode=False: each row prefills its whole length. decode=True: each row computes only its
    last token, after a cached context of length - 1 (a decode step). `computed`: each row's cached context
    instead (the row computes the rest of its length; rows that compute one token must come first). Block ids wrap around
    `num_blocks`: the contents of a dummy run's cache are never read by real requests. Token ids
    are 0, or drawn from `rng` in [0, 100) (a graph's self-check compares two forwards on them).
    """
    lengths = np.asarray(lengths, np.int64)
    width = blocks_for(int(lengths.max()), block_size)
    starts = np.concatenate([[0], np.cumsum([blocks_for(int(n), block_size) for n in lengths])[:-1]])
    tables = ((starts[:, None] + np.arange(width)) % num_blocks).astype(np.int32)
    if computed is not None:
        computed = np.asarray(computed, np.int64)
    else:
        computed = lengths - 1 if decode else np.zeros_like(lengths)
    counts = lengths - computed
    shape = (len(lengths), int(lengths.max()))
    tokens = np.zeros(shape, np.int32) if rng is None else rng.integers(0, 100, size=shape).astype(np.int32)
    return flat_batch(tokens, np.arange(len(lengths)), computed, counts, tables, block_size,
                      np.ones(len(lengths), bool))
