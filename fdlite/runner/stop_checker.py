"""When a sequence is done, after it has taken one more token (vLLM's order of checks).

The rules live here once, in two forms: `stop_candidates` is the vectorised first pass the worker
runs over every sampled row (on its per-slot arrays), and lets through every row that `check_stop`
could stop; `check_stop` is the exact decision, made by the scheduler for those rows only, so a
step costs Python only for the rows that may stop.
"""

from __future__ import annotations

import numpy as np

from fdlite.runner.sequence import Sequence


def stop_candidates(tokens: np.ndarray, num_tokens: np.ndarray, num_prompt: np.ndarray, max_tokens: np.ndarray,
                    ignore_eos: np.ndarray, has_stop_ids: np.ndarray, watch_text: np.ndarray,
                    eos_token_ids: set[int], max_model_len: int) -> np.ndarray:
    """Rows (indices into `tokens`) that may stop after taking `tokens`: an EOS, a stop id or string
    to check, or a length limit. Arrays are per row, counted with the new token; `check_stop`
    decides (it also applies min_tokens, which only ever holds a stop back)."""
    maybe = np.zeros(len(tokens), bool)
    for e in eos_token_ids:  # a few ids: cheaper than np.isin
        maybe |= tokens == e
    maybe &= ~ignore_eos
    maybe |= has_stop_ids | watch_text
    maybe |= (num_tokens - num_prompt >= max_tokens) | (num_tokens >= max_model_len)
    return np.nonzero(maybe)[0]


def check_stop(seq: Sequence, token: int, stop_str: str | None, eos_token_ids: set[int], max_model_len: int):
    """(finish_reason, stop_reason) if `seq` stops after `token` (already appended), else None.

    `stop_str` is the stop string the detokenizer found in the new text, if any.
    """
    p = seq.params
    n_out = len(seq.output_token_ids)
    if n_out >= p.min_tokens:
        if not p.ignore_eos and token in eos_token_ids:
            return "stop", None
        if p.stop_token_ids and token in p.stop_token_ids:
            return "stop", token
        if stop_str is not None:
            return "stop", stop_str
    if p.max_tokens is not None and n_out >= p.max_tokens:
        return "length", None
    if seq.num_known_tokens >= max_model_len:
        return "length", None
    return None
