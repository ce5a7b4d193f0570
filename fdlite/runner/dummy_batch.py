"""Dummy sequences for the runs at startup (profiling prefill, SOT warm-up) that go through the real input path."""

from __future__ import annotations

from fdlite.kvcache.block_allocator import blocks_for
from fdlite.runner.sequence import Sequence
from fdlite.sampling_params import SamplingParams

_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


def even_split(num_tokens: int, num_seqs: int) -> list[int]:
    """`num_tokens` over at most `num_seqs` sequences, as evenly as possible."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    base, extra = divmod(num_tokens, num_seqs)
    return [base + (1 if i < extra else 0) for i in range(num_seqs)]


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


def dummy_rows(lengths: list[int], block_size: int, num_blocks: int, decode: bool = False) -> list[tuple[Sequence, int]]:
    """Rows of dummy sequences of the given lengths, with block tables laid out from block 0.

    decode=False: each row prefills its whole length. decode=True: each row computes only its
    last token, after a cached context of length - 1 (a decode step). Block ids wrap around
    `num_blocks`: the contents of a dummy run's cache are never read by real requests.
    """
    rows, next_block = [], 0
    for i, n in enumerate(lengths):
        seq = Sequence(request_index=-1, child_index=i, prompt_token_ids=[0] * n, params=_PARAMS, generator=None)
        need = blocks_for(n, block_size)
        seq.block_table = [(next_block + j) % num_blocks for j in range(need)]
        next_block += need
        seq.num_computed_tokens = n - 1 if decode else 0
        rows.append((seq, 1 if decode else n))
    return rows
