"""Batch token sampler on Paddle tensors (CPU or GPU), vectorised over the batch.

Order of operations follows vLLM:
  (a) raw logprobs = log_softmax(logits), reported to the user (vLLM v1's default "raw" logprobs);
  (b) min_tokens: eos / stop token ids masked while the output is too short;
  (c) repetition, frequency and presence penalties;
  (d) greedy rows: argmax;
  (e) other rows: temperature, top-k, top-p, min-p, then the exponential race
      argmax(probs / q), q ~ Exp(1) drawn from the row's own numpy generator, so a seeded request
      gets the same tokens whatever else shares its batch.

Per step, the only Python/numpy work that grows with the vocabulary is the noise draw of the
non-greedy rows; everything else is O(batch + tokens in the penalised sequences) on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import paddle
import paddle.nn.functional as F

from fdlite.outputs import Logprob
from fdlite.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One sequence to sample a token for in this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: np.random.Generator  # per sequence, see make_generator


@dataclass
class SamplerOutput:
    """Result of one sampling step, one entry per row."""

    token_ids: list[int]
    sampled_logprobs: list[float]  # logprob of each sampled token under the raw distribution
    # Per row: top-`params.logprobs` tokens plus the sampled one, with ranks; None when not asked.
    logprobs: list[dict[int, Logprob] | None]


def make_generator(seed: int | None, child_index: int, fallback: np.random.Generator) -> np.random.Generator:
    """Random source for one sequence: completion `child_index` of a request with `seed`.

    Seeded: depends only on (seed, child_index), so results are reproducible and the n
    completions of a request differ. Unseeded: an independent stream spawned from `fallback`.
    """
    if seed is None:
        return fallback.spawn(1)[0]
    # SeedSequence wants non-negative entropy; fold negative seeds into uint64 range.
    return np.random.default_rng([seed % 2**64, child_index])


class Sampler:
    """Picks the next token of every row of a batch of logits `[batch, vocab]`."""

    @paddle.no_grad()
    def __call__(self, logits: paddle.Tensor, rows: list[SamplingRow], eos_token_ids: set[int]) -> SamplerOutput:
        """Sample one token per row; see the module docstring for the order of operations."""
        logits = _as_float32(logits, rows)
        if _plain_greedy(rows):
            # Fast path: nothing changes the logits and nothing but the sampled logprob is reported.
            tokens = paddle.argmax(logits, axis=-1)
            picked = paddle.take_along_axis(logits, tokens.unsqueeze(1), axis=1).squeeze(1)
            sampled_lp = picked - paddle.logsumexp(logits, axis=-1)
            return SamplerOutput(tokens.tolist(), sampled_lp.tolist(), [None] * len(rows))

        raw_logprobs = _log_softmax(logits)
        processed = self._adjust(logits, rows, eos_token_ids)
        # Greedy rows keep this argmax; the random rows are overwritten below.
        tokens = paddle.argmax(processed, axis=-1)
        rand = _random_rows(rows)
        if rand:
            probs = self._filtered_probs(processed, rows, rand)
            noise = np.stack([rows[i].generator.standard_exponential(probs.shape[1], dtype=np.float32) for i in rand])
            # Clip guards the (measure-zero, but float32-possible) q == 0 against inf / nan.
            q = paddle.clip(paddle.to_tensor(noise, place=logits.place), min=1e-20)
            drawn = paddle.argmax(probs / q, axis=-1)
            tokens = paddle.scatter(tokens, _index(rand, logits), drawn, overwrite=True)

        sampled_lp = paddle.take_along_axis(raw_logprobs, tokens.unsqueeze(1), axis=1).squeeze(1)
        token_list = tokens.tolist()
        sampled_list = sampled_lp.tolist()
        return SamplerOutput(token_list, sampled_list, _logprob_dicts(raw_logprobs, sampled_lp, token_list, rows))

    @paddle.no_grad()
    def probs(self, logits: paddle.Tensor, rows: list[SamplingRow], eos_token_ids: set[int]) -> paddle.Tensor:
        """The distribution each row is sampled from, `[batch, vocab]` float32.

        Greedy rows are one-hot at their argmax. For tests and debugging; `__call__` does not use it.
        """
        logits = _as_float32(logits, rows)
        processed = self._adjust(logits, rows, eos_token_ids)
        out = F.one_hot(paddle.argmax(processed, axis=-1), processed.shape[1]).astype("float32")
        rand = _random_rows(rows)
        if rand:
            out = paddle.scatter(out, _index(rand, logits), self._filtered_probs(processed, rows, rand), overwrite=True)
        return out

    @staticmethod
    def _adjust(logits: paddle.Tensor, rows: list[SamplingRow], eos_token_ids: set[int]) -> paddle.Tensor:
        """Steps (b) and (c): min_tokens masking, then penalties."""
        return apply_penalties(apply_min_tokens(logits, rows, eos_token_ids), rows)

    @staticmethod
    def _filtered_probs(processed: paddle.Tensor, rows: list[SamplingRow], rand: list[int]) -> paddle.Tensor:
        """Step (e) up to the draw, for the rows `rand`: temperature, top-k, top-p, min-p, softmax."""
        sub = paddle.gather(processed, _index(rand, processed), axis=0)
        temps = [rows[i].params.temperature for i in rand]
        sub = sub / paddle.to_tensor(temps, dtype="float32", place=sub.place).unsqueeze(1)
        sub = apply_top_k_top_p_min_p(
            sub,
            [rows[i].params.top_k for i in rand],
            [rows[i].params.top_p for i in rand],
            [rows[i].params.min_p for i in rand],
        )
        return _softmax(sub)


# --- steps, usable on their own (the tests compare them with a numpy reference) ----------------


def apply_min_tokens(logits: paddle.Tensor, rows: list[SamplingRow], eos_token_ids: set[int]) -> paddle.Tensor:
    """Set stop tokens to -inf for rows whose output is shorter than `params.min_tokens`.

    Stop tokens are `params.stop_token_ids` plus `eos_token_ids` unless `ignore_eos` (as vLLM:
    with ignore_eos EOS does not end the sequence, so there is nothing to hold back).
    """
    vocab = logits.shape[1]
    row_ids: list[int] = []
    tok_ids: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_token_ids)
        for t in stops:
            if 0 <= t < vocab:
                row_ids.append(i)
                tok_ids.append(t)
    if not row_ids:
        return logits
    mask = _bincount_2d(logits, np.asarray(row_ids), np.asarray(tok_ids)) > 0
    return paddle.masked_fill(logits, mask, _NEG_INF)


def apply_penalties(logits: paddle.Tensor, rows: list[SamplingRow]) -> paddle.Tensor:
    """Repetition penalty over prompt + output tokens; frequency and presence over output only.

    Same formulas as vLLM: a seen token's logit is divided by `repetition_penalty` when positive,
    multiplied when negative; then `logit -= frequency * count_in_output + presence * (count > 0)`.
    """
    active = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not active:
        return logits
    vocab = logits.shape[1]
    out_rows, out_toks, prompt_rows, prompt_toks = [], [], [], []
    for i in active:
        row = rows[i]
        toks = np.asarray(row.output_token_ids, dtype=np.int64).reshape(-1)
        out_rows.append(np.full(toks.shape, i, dtype=np.int64))
        out_toks.append(toks)
        if row.params.repetition_penalty != 1.0:  # only repetition looks at the prompt
            toks = np.asarray(row.prompt_token_ids, dtype=np.int64).reshape(-1)
            prompt_rows.append(np.full(toks.shape, i, dtype=np.int64))
            prompt_toks.append(toks)
    out_counts = _bincount_2d(logits, *_cat(out_rows, out_toks, vocab))
    prompt_counts = _bincount_2d(logits, *_cat(prompt_rows, prompt_toks, vocab))

    def per_row(name: str) -> paddle.Tensor:
        values = [float(getattr(r.params, name)) for r in rows]
        return paddle.to_tensor(values, dtype="float32", place=logits.place).unsqueeze(1)

    rep = per_row("repetition_penalty")
    seen = (out_counts + prompt_counts) > 0
    logits = paddle.where(seen, paddle.where(logits > 0, logits / rep, logits * rep), logits)
    in_output = (out_counts > 0).astype("float32")
    return logits - per_row("frequency_penalty") * out_counts - per_row("presence_penalty") * in_output


def apply_top_k_top_p_min_p(
    logits: paddle.Tensor, top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float]
) -> paddle.Tensor:
    """Set filtered-out tokens to -inf; `logits` already divided by the temperature.

    top-k keeps tokens whose logit is >= the k-th largest (ties at the boundary all survive);
    top-p then keeps the smallest most-likely prefix of the top-k distribution whose mass reaches
    p; min-p drops tokens with prob < min_p * max prob. Each step only raises a per-row logit
    threshold: min-p depends only on the ratio to the top token, which top-k / top-p never remove
    and renormalising does not change, so it can be folded in as `max_logit + log(min_p)`.
    """
    vocab = logits.shape[1]
    place = logits.place
    ks = [k if 0 < k < vocab else vocab for k in top_k]  # 0 / -1 / >= vocab: keep all
    use_k = any(k < vocab for k in ks)
    use_p = any(p < 1.0 for p in top_p)
    use_min_p = any(m > 0.0 for m in min_p)
    threshold = None  # [rows, 1]: tokens with a lower logit are dropped

    if use_p and any(p < 1.0 and k == vocab for p, k in zip(top_p, ks)):
        sorted_logits = paddle.sort(logits, axis=-1, descending=True)
    elif use_k or use_p:
        # Every top-p row also has a top-k, and top-p only looks inside the top-k: a partial sort
        # of the largest k is enough (a full sort of a 150k vocab is costly on CPU).
        sorted_logits = paddle.topk(logits, max(ks), axis=-1)[0]
    if use_k:
        kth = paddle.take_along_axis(sorted_logits, _col([k - 1 for k in ks], "int64", place), axis=1)
        threshold = kth
    if use_p:
        if use_k:
            sorted_logits = paddle.masked_fill(sorted_logits, sorted_logits < kth, _NEG_INF)
        sorted_probs = _softmax(sorted_logits)
        # Mass strictly before each position; an exclusive cumsum is monotone, so the kept set is a
        # prefix and always holds the top token (mass 0 < p).
        cum = paddle.cumsum(sorted_probs, axis=-1)
        mass_before = paddle.concat([paddle.zeros_like(cum[:, :1]), cum[:, :-1]], axis=1)
        p = _col([p if p < 1.0 else math.inf for p in top_p], "float32", place)
        n_keep = (mass_before < p).astype("int64").sum(axis=1, keepdim=True)
        cutoff = paddle.take_along_axis(sorted_logits, n_keep - 1, axis=1)
        # Rows without top-p: no cutoff (their `sorted_logits` may be truncated to the top-k).
        cutoff = paddle.masked_fill(cutoff, paddle.isinf(p), _NEG_INF)
        threshold = cutoff if threshold is None else paddle.maximum(threshold, cutoff)
    if use_min_p:
        log_min_p = _col([math.log(m) if m > 0.0 else _NEG_INF for m in min_p], "float32", place)
        floor = logits.max(axis=1, keepdim=True) + log_min_p
        threshold = floor if threshold is None else paddle.maximum(threshold, floor)

    if threshold is None:
        return logits
    return paddle.masked_fill(logits, logits < threshold, _NEG_INF)


# --- helpers -----------------------------------------------------------------------------------


def _as_float32(logits: paddle.Tensor, rows: list[SamplingRow]) -> paddle.Tensor:
    if logits.ndim != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got shape {list(logits.shape)}")
    # Filtering and the race need float32 precision (and CPU Paddle has no half kernels).
    return logits if logits.dtype == paddle.float32 else logits.astype("float32")


def _softmax(x: paddle.Tensor) -> paddle.Tensor:
    # Not F.softmax: Paddle's CPU kernel clips x - max at -64, so filtered (-inf) tokens would keep
    # ~1e-28 probability. Its vectorised exp also clamps at ~-88 (exp(-inf) = 3e-39), hence the
    # explicit zeroing: filtered tokens must have probability exactly 0.
    e = paddle.exp(x - x.max(axis=-1, keepdim=True))
    e = paddle.masked_fill(e, x == _NEG_INF, 0.0)
    return e / e.sum(axis=-1, keepdim=True)


def _log_softmax(x: paddle.Tensor) -> paddle.Tensor:
    # Not F.log_softmax: Paddle's CPU kernel clips at -64 and is very slow at large vocab sizes.
    return x - paddle.logsumexp(x, axis=-1, keepdim=True)


def _plain_greedy(rows: list[SamplingRow]) -> bool:
    """Every row is greedy with nothing that changes the logits or asks for top logprobs."""
    return all(
        r.params.is_greedy
        and not r.params.has_penalties
        and r.params.logprobs is None
        and len(r.output_token_ids) >= r.params.min_tokens
        for r in rows
    )


def _random_rows(rows: list[SamplingRow]) -> list[int]:
    return [i for i, r in enumerate(rows) if not r.params.is_greedy]


def _index(ids: list[int], like: paddle.Tensor) -> paddle.Tensor:
    return paddle.to_tensor(ids, dtype="int64", place=like.place)


def _col(values: list, dtype: str, place) -> paddle.Tensor:
    return paddle.to_tensor(values, dtype=dtype, place=place).unsqueeze(1)


def _cat(row_parts: list[np.ndarray], tok_parts: list[np.ndarray], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    if not row_parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    r, t = np.concatenate(row_parts), np.concatenate(tok_parts)
    ok = (t >= 0) & (t < vocab)  # ids outside the logits (e.g. added tokens) cannot be penalised
    return r[ok], t[ok]


def _bincount_2d(like: paddle.Tensor, row_ids: np.ndarray, tok_ids: np.ndarray) -> paddle.Tensor:
    """`counts[r, t]` = occurrences of (r, t), built on the device by scatter-add, float32 like `like`."""
    counts = paddle.zeros_like(like, dtype="float32")
    if len(row_ids) == 0:
        return counts
    index = paddle.to_tensor(np.stack([row_ids, tok_ids], axis=1).astype(np.int64), place=like.place)
    return paddle.scatter_nd_add(counts, index, paddle.ones([len(row_ids)], dtype="float32"))


def _logprob_dicts(
    raw_logprobs: paddle.Tensor, sampled_lp: paddle.Tensor, tokens: list[int], rows: list[SamplingRow]
) -> list[dict[int, Logprob] | None]:
    """Per row asking for logprobs: the sampled token (rank = #tokens at least as likely) + top-k."""
    out: list[dict[int, Logprob] | None] = [None] * len(rows)
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not asking:
        return out
    idx = _index(asking, raw_logprobs)
    sub = paddle.gather(raw_logprobs, idx, axis=0)
    picked = paddle.gather(sampled_lp, idx, axis=0)
    ranks = (sub >= picked.unsqueeze(1)).astype("int64").sum(axis=1).tolist()
    picked = picked.tolist()
    k_max = min(max(rows[i].params.logprobs for i in asking), sub.shape[1])
    if k_max > 0:
        top_vals, top_ids = paddle.topk(sub, k_max, axis=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(asking):
        # Sampled token first, then the top-k (which overwrites it with its own rank if present): vLLM's order.
        d = {tokens[i]: Logprob(logprob=picked[j], rank=ranks[j])}
        for r in range(min(rows[i].params.logprobs, k_max)):
            d[top_ids[j][r]] = Logprob(logprob=top_vals[j][r], rank=r + 1)
        out[i] = d
    return out
