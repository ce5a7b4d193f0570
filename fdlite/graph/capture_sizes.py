"""Which batch sizes (or token counts) get a CUDA graph, and which captured size a batch runs in.

FastDeploy's candidate list (FastDeploy's graph-optimization guide; docs/design.md, section "CUDA-graph capture sizes and padding") cut to [1, max_num_seqs], always with
max_num_seqs itself; a user list overrides it. A batch of n runs in the smallest captured size >= n
(its extra rows are padding); above the largest size it runs eagerly.
"""

from __future__ import annotations

import bisect

import numpy as np

# Prefill-only graphs are keyed by token count; FastDeploy's prefill-in-graph change (PR #3459) caps them at 512 tokens by default.
DEFAULT_MAX_PREFILL_CAPTURE = 512


def candidate_capture_sizes() -> list[int]:
    """[1, 2, 4, 8, 16, ..., 128, 144, ..., 256, 288, ..., 1024] as in FastDeploy.

    FastDeploy's guide says in its comment (docs/design.md, section "CUDA-graph capture sizes and padding") the last range is (256, 288, ..., 1024]; its code
    writes range(17, 33), which would skip 288..512. The comment's list is the one meant.
    """
    sizes = [1, 2, 4] + [8 * i for i in range(1, 17)]
    sizes += [16 * i for i in range(9, 17)]
    sizes += [32 * i for i in range(9, 33)]
    return sorted(set(sizes))


def _cut(limit: int, user_sizes: list[int] | None) -> list[int]:
    """The user's list, or the candidates, up to `limit`; the default list always holds `limit` itself."""
    if user_sizes is not None:
        return sorted({s for s in user_sizes if s <= limit})
    return sorted({s for s in candidate_capture_sizes() if s <= limit} | {limit})


def decode_capture_sizes(max_num_seqs: int, user_sizes: list[int] | None = None,
                         max_capture_size: int | None = None) -> list[int]:
    """Sorted decode batch sizes to capture."""
    return _cut(min(max_num_seqs, max_capture_size or max_num_seqs), user_sizes)


# Token counts of steps with prefill tokens: coarser than the decode list (a step's tokens vary more, and each
# graph keeps its own activation memory where Paddle has no shared pool), up to 8192 tokens.
DEFAULT_MIXED_CAPTURE_SIZES = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def mixed_capture_sizes(max_num_batched_tokens: int, user_sizes: list[int] | None = None) -> list[int]:
    """Sorted token counts to capture for steps holding prefill tokens (mixed or prefill-only)."""
    if user_sizes is not None:
        return sorted({s for s in user_sizes if s <= max_num_batched_tokens})
    top = max(DEFAULT_MIXED_CAPTURE_SIZES)
    sizes = {s for s in DEFAULT_MIXED_CAPTURE_SIZES if s <= max_num_batched_tokens}
    return sorted(sizes | ({max_num_batched_tokens} if max_num_batched_tokens <= top else set()))


def prefill_capture_sizes(max_num_batched_tokens: int, user_sizes: list[int] | None = None,
                          max_capture_size: int | None = None) -> list[int]:
    """Sorted prefill token counts to capture (`cudagraph_only_prefill`)."""
    return _cut(min(max_num_batched_tokens, max_capture_size or DEFAULT_MAX_PREFILL_CAPTURE), user_sizes)


def padded_size(sizes: list[int], n: int) -> int | None:
    """Smallest captured size >= n, or None when n is above them all (run eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def worst_case_prefill_split(num_tokens: int, max_seqs: int, max_len: int | None = None) -> list[int]:
    """Token count per sequence for capturing a prefill graph of `num_tokens` (docs/design.md, section "Prefill graphs: the worst-case split").

    Kernels whose grid depends on how tokens split across sequences are sized by the worst case:
    max_seqs - 1 sequences of one token and one holding the rest. Any real split then fits. With `max_len`
    (a row's most tokens) the rest is spread over as few rows of at most max_len as hold it.
    """
    if num_tokens <= max_seqs:
        return [1] * num_tokens
    longest = max_len or num_tokens
    for long_rows in range(1, max_seqs + 1):
        rest = num_tokens - (max_seqs - long_rows)
        if rest <= long_rows * longest:
            return [1] * (max_seqs - long_rows) + even_parts(rest, long_rows)
    raise ValueError(f"{num_tokens} tokens do not fit {max_seqs} rows of at most {max_len}")


def random_split(num_tokens: int, max_seqs: int, max_len: int, rng) -> list[int]:
    """A random split of `num_tokens` over at most `max_seqs` rows of at most `max_len` tokens, sorted (one-token
    rows first): what a graph's self-check replays."""
    fewest = -(-num_tokens // max_len)
    for _ in range(20):
        rows = int(rng.integers(fewest, min(num_tokens, max_seqs) + 1))
        cuts = np.sort(rng.choice(np.arange(1, num_tokens), size=rows - 1, replace=False)) if rows > 1 else []
        parts = np.diff([0, *cuts, num_tokens])
        if parts.max() <= max_len:
            return sorted(parts.tolist())
    return sorted(even_parts(num_tokens, min(max_seqs, num_tokens) if num_tokens <= max_seqs * max_len else fewest))


def even_parts(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
