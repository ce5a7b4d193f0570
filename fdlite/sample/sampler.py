"""Batch token sampler over per-row parameter arrays (`SamplingBatch`), vectorised over rows.

Order of operations follows vLLM:
  (a) raw logprobs = log_softmax(logits), only for rows that ask for logprobs;
  (b) min_tokens: eos / stop token ids masked while the output is too short (`banned`);
  (c) repetition, frequency and presence penalties, from per-slot token counts the batch keeps
      incrementally (never re-binned from token lists);
  (c') structured outputs: tokens the row's grammar does not allow set to -inf, on the constrained rows
      only (`apply_token_bitmask`); the grammar wins over a min_tokens ban that would leave nothing;
  (d) greedy rows: argmax;
  (e) other rows: temperature, top-k, min-p, then inverse-CDF sampling with top-p by rejection.

Why rejection for top-p: the nucleus is "the most likely tokens whose mass before them is below
top_p", which a sort finds in O(V log V) per row (seconds per step at a 150k vocabulary on CPU).
Instead a token t is drawn from the whole (filtered) distribution and kept if the mass of the
tokens more likely than t is below top_p; otherwise every token no more likely than t is dropped
and the row draws again. Conditioned on acceptance each draw is distributed as the nucleus, so the
result is exact, and a row needs few rounds (the first draw already lands in the nucleus with
probability top_p). The uniforms come from `fdlite/sample/random.py`: a function of (sequence seed,
position, round), so a seeded row samples the same tokens whatever shares its batch.

On CPU the logits are host memory, so the work is numpy on a zero-copy view (Paddle's CPU kernels
are several times slower at these sizes). On GPU (`sampler_gpu.py`, chosen when the sampler is built)
the draw is fdlite's CUDA kernel: same parameters, same counter-based noise, same `SamplerOutput`;
only the sampled ids (and the logprob rows asked for) come back to the host.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import paddle

from fdlite.kernels.no_grad import no_grad
from fdlite.kernels.custom_op import dispatch_forward
from fdlite.threads import shutdown_pool
from fdlite.sample.logprobs import LogprobsTensors, compute_logprobs
from fdlite.sample.random import uniforms
from fdlite.outputs import Logprob
from fdlite.sampling_params import SamplingParams

_NEG_INF = float("-inf")
_CHUNK = 1024  # inverse CDF: sums per chunk first, then a cumsum inside one chunk
_MAX_ROUNDS = 64
_THREADS = max(1, min(8, os.cpu_count() or 1))


@dataclass
class SamplingBatch:
    """Sampling parameters of the rows that sample this step, one entry per logits row."""

    temperature: np.ndarray  # float32; 0 = greedy
    top_k: np.ndarray  # int64; 0 (or >= vocab) = off
    top_p: np.ndarray  # float32; 1 = off
    min_p: np.ndarray  # float32; 0 = off
    seeds: np.ndarray  # uint64: the sequence's seed (fdlite/sample/random.py)
    positions: np.ndarray  # int64: position of the token being sampled
    num_logprobs: np.ndarray  # int64; -1 = no logprobs
    # (rows, token ids) set to -inf: stop tokens of rows still short of min_tokens.
    banned_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    banned_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # Penalties, for the rows `penalty_rows` only (None when no row has any).
    penalty_rows: np.ndarray | None = None
    repetition_penalty: np.ndarray | None = None  # [P] float32
    frequency_penalty: np.ndarray | None = None
    presence_penalty: np.ndarray | None = None
    # The rows' token tables: on the host (CPU) the rows themselves, [P, vocab]; on the GPU they live on the
    # device, one row per slot (`penalty_slots`), kept by the GPU sampler from `penalty_resets`.
    output_counts: np.ndarray | None = None  # [P, vocab] float32: occurrences in the output so far
    prompt_seen: np.ndarray | None = None  # [P, vocab] bool: occurs in the prompt
    penalty_slots: np.ndarray | None = None  # [P] int64: each penalty row's slot in the persistent batch
    # (slot, prompt token ids, output token ids) of penalty slots (re)taken since the last batch: their
    # device tables start from these. `num_slots`: rows of the device tables.
    penalty_resets: list = field(default_factory=list)
    num_slots: int = 0
    # logit_bias: (rows, token ids, biases) added to the logits (None when no row has any).
    bias_rows: np.ndarray | None = None
    bias_tokens: np.ndarray | None = None
    bias_values: np.ndarray | None = None
    # allowed_token_ids: rows that may only sample their allowed tokens, and those as a bitmask
    # [A, ceil(vocab / 32)] int32 (the grammar bitmask's layout).
    allowed_rows: np.ndarray | None = None
    allowed_bitmask: np.ndarray | None = None
    # Structured outputs, for the rows `grammar_rows` only (None when no row is constrained): the rows'
    # matchers (filled into a bitmask by the runner) and that bitmask, [G, ceil(vocab / 32)] int32.
    grammar_rows: np.ndarray | None = None
    grammars: list | None = None
    grammar_bitmask: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return len(self.temperature)

    def logprob_rows(self) -> list[int]:
        """Rows that asked for logprobs."""
        return np.nonzero(self.num_logprobs >= 0)[0].tolist()


@dataclass
class SamplerOutput:
    """Result of one sampling step: one token per row, and the logprob numbers of the rows that asked."""

    token_ids: list[int]
    # The rows that asked for logprobs (`SamplingBatch.logprob_rows`), their numbers in that order, and each
    # one's top-k; None when no row asked (and on tensor-parallel ranks > 0, which report nothing).
    logprobs_tensors: LogprobsTensors | None = None
    logprob_rows: np.ndarray | None = None
    num_logprobs: np.ndarray | None = None
    # Prompt logprobs computed this step: (sequence, its next consecutive prompt positions' numbers).
    prompt_logprobs: list | None = None
    # The sampled ids where the sampler made them (the GPU sampler's device int64 tensor), before their copy to
    # the host; None on the CPU path (`token_ids` is the same). The next step's decode rows read their input
    # token from here when it was prepared before these came back (async scheduling, `TokenPatch`).
    device_tokens: object = None

    @property
    def sampled_logprobs(self) -> list[float | None]:
        """Per row: the raw logprob of the sampled token (None where not asked)."""
        out: list[float | None] = [None] * len(self.token_ids)
        if self.logprobs_tensors is not None:
            for j, i in enumerate(self.logprob_rows.tolist()):
                out[i] = float(self.logprobs_tensors.logprobs[j])
        return out

    @property
    def logprobs(self) -> list[dict[int, Logprob] | None]:
        """Per row: the sampled token and the top-k as vLLM's dict (None where not asked)."""
        out: list[dict[int, Logprob] | None] = [None] * len(self.token_ids)
        if self.logprobs_tensors is not None:
            for j, i in enumerate(self.logprob_rows.tolist()):
                out[i] = self.logprobs_tensors.entry(j, int(self.num_logprobs[j]))
        return out


class PendingSample:
    """A sampler output whose ids are still being copied to the host (GPU, async scheduling): the step thread
    returns it at once and launches the next step; `resolve` waits for the copy. `device_tokens`: the ids on the
    device, which the next step's early-prepared inputs read."""

    def __init__(self, copy, finish, device_tokens):
        self._copy, self._finish, self.device_tokens = copy, finish, device_tokens

    def wait(self) -> SamplerOutput:
        return self._finish(self._copy.wait())


def resolve(sampled):
    """A `SamplerOutput` (or None) from what `execute` returned: a `PendingSample` waits for its copy."""
    return sampled.wait() if isinstance(sampled, PendingSample) else sampled


def stop_tokens_while_short(params: SamplingParams, num_output: int, eos_token_ids: set[int], vocab: int) -> list[int]:
    """Token ids masked for a row whose output is still shorter than `min_tokens`.

    Stop tokens are `params.stop_token_ids` plus `eos_token_ids` unless `ignore_eos` (as vLLM:
    with ignore_eos EOS does not end the sequence, so there is nothing to hold back).
    """
    if num_output >= params.min_tokens:
        return []
    stops = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(eos_token_ids))
    return sorted(t for t in stops if 0 <= t < vocab)


def token_counts(token_ids, vocab: int) -> np.ndarray:
    """Occurrences of each id in [0, vocab) (ids outside, e.g. added tokens, cannot be penalised)."""
    ids = np.asarray(token_ids, np.int64).reshape(-1)
    ids = ids[(ids >= 0) & (ids < vocab)]
    return np.bincount(ids, minlength=vocab).astype(np.float32)


class Sampler:
    """Picks the next token of every row of a batch of logits `[rows, vocab]`."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._gpu = None  # GpuSampler (sampler_gpu.py), with its device token tables, on the GPU path
        # GPU: return a `PendingSample` instead of waiting for the ids' copy (set by the engine for async scheduling).
        self.defer_host_copy = False
        self._forward = dispatch_forward(self)  # the plain function, called with self (custom_op.py: no cycle)

    @no_grad
    def __call__(self, logits: paddle.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row; see the module docstring for the order of operations."""
        return self._forward(self, logits, batch)

    def close(self) -> None:
        """Stop the draw threads and free the GPU sampler's device token tables (the engine is closing)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            shutdown_pool(pool)
        gpu, self._gpu = self._gpu, None
        if gpu is not None:
            gpu.close()

    def forward_gpu(self, logits: paddle.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if self._gpu is None:
            from fdlite.sample.sampler_gpu import GpuSampler  # noqa: PLC0415

            self._gpu = GpuSampler()
        return self._gpu(logits, batch, self.defer_host_copy)

    def logprobs_of(self, logits: paddle.Tensor, targets: np.ndarray, k: int) -> LogprobsTensors:
        """Raw logprobs of every row of `logits` at `targets` [rows], with ranks and the top-k (prompt logprobs)."""
        if self._forward is type(self).forward_gpu:
            from fdlite.sample.sampler_gpu import logprobs_of  # noqa: PLC0415

            return logprobs_of(logits, targets, k)
        return compute_logprobs(_host_logits(logits, len(targets)), targets, k)

    def forward_cpu(self, logits: paddle.Tensor, batch: SamplingBatch) -> SamplerOutput:
        x = _host_logits(logits, batch.num_rows)
        processed = adjust_logits(x, batch)
        tokens = np.empty(batch.num_rows, np.int64)
        greedy = batch.temperature <= 0.0
        if greedy.all():
            return _output(x, processed.argmax(axis=1), batch)
        if greedy.any():
            tokens[greedy] = processed[greedy].argmax(axis=1)
        rand = np.nonzero(~greedy)[0]
        if len(rand):
            tokens[rand] = self._draw_rows(processed, rand, batch)
        return _output(x, tokens, batch)

    def _draw_rows(self, processed: np.ndarray, rand: np.ndarray, batch: SamplingBatch) -> np.ndarray:
        """`_draw` over row chunks in threads (numpy releases the GIL; rows are independent, so the
        result does not depend on the split)."""
        chunks = np.array_split(rand, max(1, min(_THREADS, len(rand) // 8)))
        if len(chunks) == 1:
            sub = processed if len(rand) == len(processed) else processed[rand]
            return _draw(sub, _take(batch, rand))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="fdlite-sampler")
        parts = self._pool.map(lambda rows: _draw(processed[rows], _take(batch, rows)), chunks)
        return np.concatenate(list(parts))


# --- steps, usable on their own ------------------------------------------------------------------


def adjust_logits(x: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """Steps (b), (c) and (c') on a copy of the logits: penalties, logit_bias, allowed_token_ids, the grammar
    mask, min_tokens bans."""
    grammar = batch.grammar_bitmask is not None and len(batch.grammar_rows)
    if (not len(batch.banned_rows) and batch.penalty_rows is None and not grammar and batch.bias_rows is None
            and batch.allowed_rows is None):
        return x
    x = x.copy()
    if batch.penalty_rows is not None:
        x[batch.penalty_rows] = apply_penalties(x[batch.penalty_rows], batch)
    if batch.bias_rows is not None:
        np.add.at(x, (batch.bias_rows, batch.bias_tokens), batch.bias_values)
    if batch.allowed_rows is not None:
        apply_token_bitmask(x, batch.allowed_bitmask, batch.allowed_rows)
    if grammar:
        apply_token_bitmask(x, batch.grammar_bitmask, batch.grammar_rows)
    if len(batch.banned_rows):
        banned_rows, banned_tokens = bans_a_grammar_leaves(batch, x.shape[1])
        x[banned_rows, banned_tokens] = _NEG_INF
    return x


def bans_a_grammar_leaves(batch: SamplingBatch, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The bans (min_tokens, bad_words) without those of a constrained row whose grammar (with its
    allowed_token_ids) allows no token they leave: a complete grammar beats min_tokens. Read from the
    bitmasks on the host, so both samplers decide it the same way before banning."""
    rows, tokens = batch.banned_rows, batch.banned_tokens
    if batch.grammar_bitmask is None or batch.grammar_rows is None or not len(rows):
        return rows, tokens
    grammar_of = {r: i for i, r in enumerate(batch.grammar_rows.tolist())}
    allowed_of = {} if batch.allowed_rows is None else {r: i for i, r in enumerate(batch.allowed_rows.tolist())}
    keep = np.ones(len(rows), bool)
    for r in np.unique(rows).tolist():
        if r not in grammar_of:
            continue
        left = _unpack_bitmask(batch.grammar_bitmask[grammar_of[r] : grammar_of[r] + 1], vocab)[0]
        if r in allowed_of:
            left &= _unpack_bitmask(batch.allowed_bitmask[allowed_of[r] : allowed_of[r] + 1], vocab)[0]
        mine = rows == r
        left[tokens[mine]] = False
        if not left.any():
            keep &= ~mine
    return rows[keep], tokens[keep]


def _unpack_bitmask(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """[G, ceil(vocab / 32)] int32 -> [G, vocab] bool (bit j of word i: token 32 i + j)."""
    return np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, count=vocab,
                         bitorder="little").view(bool)


def apply_token_bitmask(x: np.ndarray, bitmask: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """Set every token whose bit is 0 in `bitmask` [G, ceil(vocab / 32)] int32 to -inf in rows `rows` of `x`
    (all rows when None), in place; bit j of word i is token 32 i + j (llguidance's and vLLM's layout)."""
    allowed = _unpack_bitmask(bitmask, x.shape[1])
    if rows is None:
        np.copyto(x, _NEG_INF, where=~allowed)
        return x
    # Row by row on views: a fancy-indexed x[rows] would copy every constrained row out and back.
    for i, r in enumerate(rows.tolist()):
        np.copyto(x[r], _NEG_INF, where=~allowed[i])
    return x


def apply_penalties(x: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """Penalties on the rows `batch.penalty_rows` (x holds those rows only).

    Same formulas as vLLM: a token seen in prompt or output has its logit divided by
    `repetition_penalty` when positive, multiplied when negative; then
    `logit -= frequency * count_in_output + presence * (count > 0)`.
    """
    counts = batch.output_counts
    rep = batch.repetition_penalty[:, None]
    seen = (counts > 0) | batch.prompt_seen
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    return (x - batch.frequency_penalty[:, None] * counts - batch.presence_penalty[:, None] * (counts > 0)).astype(np.float32)


def filtered_weights(x: np.ndarray, batch: SamplingBatch) -> tuple[np.ndarray, np.ndarray]:
    """Unnormalised probabilities after temperature, top-k and min-p: exp((x - max) / T), the top token 1;
    and each row's total weight after top-k, which top-p's nucleus is measured against (inf for rows
    without top-p, NaN where it equals the row's final total, which the caller has at hand).

    top-k keeps tokens whose logit is >= the k-th largest (ties at the boundary all survive);
    min-p drops tokens with prob < min_p * max prob, which is `weight < min_p` here. Top-p looks at
    the top-k distribution (vLLM's order), and min-p only removes tokens less likely than any a
    nucleus test can depend on, so applying min-p first changes nothing but the total.
    """
    w = x - x.max(axis=1, keepdims=True)
    if (batch.temperature != 1.0).any():
        w *= (1.0 / batch.temperature)[:, None]
    np.exp(w, out=w)
    vocab = w.shape[1]
    for i in np.nonzero((batch.top_k > 0) & (batch.top_k < vocab))[0]:
        kth = np.partition(w[i], vocab - batch.top_k[i])[vocab - batch.top_k[i]]
        w[i][w[i] < kth] = 0.0
    # Rows without top-p get an infinite mass: no nucleus test can cut them, whatever the rounding. Top-p
    # rows without min-p get NaN, read "the row's total": the inverse CDF sums every row anyway, and
    # reusing that sum saves a pass over the vocabulary.
    nucleus = batch.top_p < 1.0
    nucleus_mass = np.full(len(w), np.inf)
    nucleus_mass[nucleus] = np.nan
    before_min_p = np.nonzero(nucleus & (batch.min_p > 0.0))[0]
    if len(before_min_p):
        nucleus_mass[before_min_p] = row_totals(w[before_min_p])
    mp = np.nonzero(batch.min_p > 0.0)[0]
    if len(mp):
        w[mp] = np.where(w[mp] < batch.min_p[mp, None], 0.0, w[mp])
    return w, nucleus_mass


def _draw(x: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """Step (e): one token per row from the filtered distribution, top-p by rejection."""
    w, nucleus_mass = filtered_weights(x, batch)
    threshold = None
    n = len(w)
    tokens = np.empty(n, np.int64)
    active = np.arange(n)
    for round_ in range(_MAX_ROUNDS):
        sub = w if len(active) == n else w[active]  # a copy only for the few rows drawing again
        picked, totals = _inverse_cdf(sub, uniforms(batch.seeds[active], batch.positions[active], round_))
        tokens[active] = picked
        if threshold is None:  # round 0: every row, nothing dropped yet
            threshold = batch.top_p.astype(np.float64) * np.where(np.isnan(nucleus_mass), totals, nucleus_mass)
        nucleus = np.nonzero(batch.top_p[active] < 1.0)[0]
        if not len(nucleus):
            return tokens
        sp = sub if len(nucleus) == len(sub) else sub[nucleus]
        above = sp > sp[np.arange(len(nucleus)), picked[nucleus]][:, None]
        mass_above = (sp * above).sum(axis=1)  # not np.where(above, sp, 0): twice as fast, the same sums
        rejected = mass_above >= threshold[active[nucleus]]
        if not rejected.any():
            return tokens
        # Draw again among the tokens strictly more likely than the rejected one.
        active = active[nucleus[rejected]]
        w[active] = np.where(above[rejected], sp[rejected], 0.0)
    # Not reached in practice (each round drops the drawn token and all below it); the most likely
    # token is in every nucleus.
    tokens[active] = w[active].argmax(axis=1)
    return tokens


def _chunk_cumsum(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Chunk starts and each row's running float64 sum at the end of every vocabulary chunk."""
    starts = np.arange(0, w.shape[1], _CHUNK)
    return starts, np.cumsum(np.add.reduceat(w, starts, axis=1), axis=1, dtype=np.float64)


def row_totals(w: np.ndarray) -> np.ndarray:
    """Each row's total weight, summed exactly as the inverse CDF sums it."""
    return _chunk_cumsum(w)[1][:, -1]


def _inverse_cdf(w: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The token where each row's cumulative weight crosses u * total, and each row's total.

    Sums per chunk of the vocabulary first, then a cumulative sum inside the one chunk that holds
    the crossing, so no full-vocabulary cumsum is materialised.
    """
    n, vocab = w.shape
    starts, cum = _chunk_cumsum(w)
    total = cum[:, -1]
    target = u * total
    chunk = np.minimum((cum <= target[:, None]).sum(axis=1), len(starts) - 1)
    before = np.where(chunk > 0, cum[np.arange(n), np.maximum(chunk - 1, 0)], 0.0)
    cols = starts[chunk][:, None] + np.arange(_CHUNK)
    vals = np.where(cols < vocab, np.take_along_axis(w, np.minimum(cols, vocab - 1), axis=1), 0.0)
    inside = np.cumsum(vals, axis=1, dtype=np.float64)
    k = (inside <= (target - before)[:, None]).sum(axis=1)
    # Rounding can put the target past the chunk's last token: take its last token with weight.
    last = _CHUNK - 1 - np.argmax(vals[:, ::-1] > 0, axis=1)
    k = np.where((k >= _CHUNK) | (vals[np.arange(n), np.minimum(k, _CHUNK - 1)] <= 0), last, k)
    return starts[chunk] + k, total


# --- helpers -----------------------------------------------------------------------------------


def _host_logits(logits: paddle.Tensor, n: int) -> np.ndarray:
    if logits.ndim != 2 or logits.shape[0] != n:
        raise ValueError(f"logits must be [rows={n}, vocab], got shape {list(logits.shape)}")
    if logits.dtype != paddle.float32:
        logits = logits.astype("float32")
    return np.from_dlpack(logits) if logits.place.is_cpu_place() else logits.numpy()


def _take(batch: SamplingBatch, rows: np.ndarray) -> SamplingBatch:
    """The filtering fields of `rows` (penalties and bans are already applied)."""
    return SamplingBatch(temperature=batch.temperature[rows], top_k=batch.top_k[rows], top_p=batch.top_p[rows],
                         min_p=batch.min_p[rows], seeds=batch.seeds[rows], positions=batch.positions[rows],
                         num_logprobs=batch.num_logprobs[rows])


def _output(x: np.ndarray, tokens: np.ndarray, batch: SamplingBatch) -> SamplerOutput:
    """Tokens plus the logprobs asked for, from the raw logits `x` (all rows)."""
    asking = np.nonzero(batch.num_logprobs >= 0)[0]
    if not len(asking):
        return SamplerOutput(tokens.tolist())
    num = batch.num_logprobs[asking]
    tensors = compute_logprobs(x[asking], tokens[asking], int(num.max()))
    return SamplerOutput(tokens.tolist(), tensors, asking, num)
