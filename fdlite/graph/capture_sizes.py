"""Which batch sizes (or token counts) get a CUDA graph, and which captured size a batch runs in.

FastDeploy's candidate list (FastDeploy's graph-optimization guide; docs/design.md, section "CUDA-graph capture sizes and padding") cut to [1, max_num_seqs], always with
max_num_seqs itself; a user list overrides it. A batch of n runs in the smallest captured size >= n
(its extra rows are padding); above the largest size it runs eagerly.
"""

from __future__ import annotations

import bisect

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


def prefill_capture_sizes(max_num_batched_tokens: int, user_sizes: list[int] | None = None,
                          max_capture_size: int | None = None) -> list[int]:
    """Sorted prefill token counts to capture (`cudagraph_only_prefill`)."""
    return _cut(min(max_num_batched_tokens, max_capture_size or DEFAULT_MAX_PREFILL_CAPTURE), user_sizes)


def padded_size(sizes: list[int], n: int) -> int | None:
    """Smallest captured size >= n, or None when n is above them all (run eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def worst_case_prefill_split(num_tokens: int, max_seqs: int) -> list[int]:
    """Token count per sequence for capturing a prefill graph of `num_tokens` (docs/design.md, section "Prefill graphs: the worst-case split").

    Kernels whose grid depends on how tokens split across sequences are sized by the worst case:
    max_seqs - 1 sequences of one token and one holding the rest. Any real split then fits.
    """
    if num_tokens <= max_seqs:
        return [1] * num_tokens
    return [1] * (max_seqs - 1) + [num_tokens - max_seqs + 1]
