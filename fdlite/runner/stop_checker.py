"""When a sequence is done, after it has taken one more token (vLLM's order of checks)."""

from __future__ import annotations

from fdlite.runner.sequence import Sequence


def check_stop(seq: Sequence, token: int, stop_str: str | None, eos_token_ids: set[int], max_model_len: int):
    """(finish_reason, stop_reason) if `seq` stops after `token`, else None.

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
    if seq.num_tokens >= max_model_len:
        return "length", None
    return None
