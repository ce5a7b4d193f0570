"""Test hooks of the sampler, kept out of the package: rows described by their request, and the distribution
each row is sampled from.

The engine builds `SamplingBatch` from its persistent slots (fdlite/runner/input_batch.py); tests describe rows
one by one (`SamplingRow`) and bin their counts from token lists here (`rows_to_batch`), so the two ways can be
compared. `probs` evaluates the sampler's weights and nucleus predicate for every token at once (with a sort)
instead of by rejection.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

from fdlite.sample.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    adjust_logits,
    filtered_weights,
    row_totals,
    stop_tokens_while_short,
    token_counts,
)
from fdlite.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One row described by its request (tests and tools; the engine builds `SamplingBatch` from slots)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int


def rows_to_batch(rows: list[SamplingRow], eos_token_ids: set[int], vocab: int) -> SamplingBatch:
    """A `SamplingBatch` from per-row descriptions (counts binned from the token lists)."""
    ps = [r.params for r in rows]
    batch = SamplingBatch(
        temperature=np.asarray([0.0 if p.is_greedy else p.temperature for p in ps], np.float32),
        top_k=np.asarray([p.top_k for p in ps], np.int64),
        top_p=np.asarray([p.top_p for p in ps], np.float32),
        min_p=np.asarray([p.min_p for p in ps], np.float32),
        seeds=np.asarray([r.seed for r in rows], np.uint64),
        positions=np.asarray([len(r.prompt_token_ids) + len(r.output_token_ids) for r in rows], np.int64),
        num_logprobs=np.asarray([-1 if p.logprobs is None else p.logprobs for p in ps], np.int64),
    )
    banned = [(i, t) for i, r in enumerate(rows) for t in stop_tokens_while_short(r.params, len(r.output_token_ids),
                                                                                  eos_token_ids, vocab)]
    if banned:
        batch.banned_rows, batch.banned_tokens = (np.asarray(a, np.int64) for a in zip(*banned))
    pen = [i for i, p in enumerate(ps) if p.has_penalties]
    if pen:
        batch.penalty_rows = np.asarray(pen, np.int64)
        batch.repetition_penalty = np.asarray([ps[i].repetition_penalty for i in pen], np.float32)
        batch.frequency_penalty = np.asarray([ps[i].frequency_penalty for i in pen], np.float32)
        batch.presence_penalty = np.asarray([ps[i].presence_penalty for i in pen], np.float32)
        batch.output_counts = np.stack([token_counts(rows[i].output_token_ids, vocab) for i in pen])
        batch.prompt_seen = np.stack([token_counts(rows[i].prompt_token_ids, vocab) > 0 for i in pen])
    return batch


def _as_batch(logits: paddle.Tensor, rows: SamplingBatch | list[SamplingRow], eos_token_ids: set[int] | None):
    if isinstance(rows, SamplingBatch):
        return rows
    return rows_to_batch(rows, eos_token_ids or set(), logits.shape[-1])


@paddle.no_grad()
def probs(logits: paddle.Tensor, rows: SamplingBatch | list[SamplingRow],
          eos_token_ids: set[int] | None = None) -> paddle.Tensor:
    """The distribution each row is sampled from, `[rows, vocab]` float32; greedy rows one-hot: the sampler's
    weights and nucleus predicate, evaluated for every token at once (with a sort) instead of by rejection."""
    batch = _as_batch(logits, rows, eos_token_ids)
    if logits.ndim != 2 or logits.shape[0] != batch.num_rows:
        raise ValueError(f"logits must be [rows={batch.num_rows}, vocab], got shape {list(logits.shape)}")
    x = logits.astype("float32").numpy()
    processed = adjust_logits(x, batch)
    out = np.zeros(processed.shape, np.float64)
    greedy = batch.temperature <= 0.0
    out[np.nonzero(greedy)[0], processed[greedy].argmax(axis=1)] = 1.0
    rand = np.nonzero(~greedy)[0]
    if len(rand):
        sub = SamplingBatch(temperature=batch.temperature[rand], top_k=batch.top_k[rand], top_p=batch.top_p[rand],
                            min_p=batch.min_p[rand], seeds=batch.seeds[rand], positions=batch.positions[rand],
                            num_logprobs=batch.num_logprobs[rand])
        w, nucleus_mass = filtered_weights(processed[rand], sub)
        nucleus_mass = np.where(np.isnan(nucleus_mass), row_totals(w), nucleus_mass)
        w = w.astype(np.float64)
        order = np.argsort(-w, axis=1, kind="stable")
        sorted_w = np.take_along_axis(w, order, axis=1)
        before = np.cumsum(sorted_w, axis=1) - sorted_w  # mass strictly before each token
        keep_sorted = before < sub.top_p[:, None].astype(np.float64) * nucleus_mass[:, None]
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=1)
        w = np.where(keep, w, 0.0)
        out[rand] = w / w.sum(axis=1, keepdims=True)
    return paddle.to_tensor(out.astype(np.float32))


class RowSampler:
    """A `Sampler` that also takes per-row descriptions: `sampler(logits, rows, eos_token_ids)`."""

    def __init__(self, sampler: Sampler | None = None) -> None:
        self.sampler = sampler or Sampler()

    def __call__(self, logits: paddle.Tensor, rows: SamplingBatch | list[SamplingRow],
                 eos_token_ids: set[int] | None = None) -> SamplerOutput:
        return self.sampler(logits, _as_batch(logits, rows, eos_token_ids))

    def probs(self, logits: paddle.Tensor, rows: SamplingBatch | list[SamplingRow],
              eos_token_ids: set[int] | None = None) -> paddle.Tensor:
        return probs(logits, rows, eos_token_ids)
