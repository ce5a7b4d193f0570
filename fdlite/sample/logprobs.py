"""Log-probabilities: a step's numbers for the rows that ask, as arrays, and the per-token dicts users read.

A row's logprobs are raw (vLLM's default `raw_logprobs`): the log-softmax of the model's logits before any
penalty, bias, mask or temperature. For a target token t (the sampled token, or the next prompt token for
`prompt_logprobs`) a row reports t's logprob, t's rank (how many tokens have a logit at least t's, so the most
likely token has rank 1) and the top-k tokens with theirs, ties to the lower token id. On the GPU one kernel
computes these (`kernels/csrc/ops_logprobs.cu`) and only the [rows, 2 + 2k] numbers reach the host; on the CPU
`compute_logprobs` does the same in numpy.

Users read a list with one dict per token (vLLM's `SampleLogprobs` / `PromptLogprobs`). Building
21 `Logprob` objects per token per step would cost the host more than the GPU's whole step at batch 256, so a
sequence keeps the step's arrays (`LogprobsList`) and a token's dict is built when it is read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fdlite.outputs import Logprob

MAX_LOGPROBS = 20  # vLLM's max_logprobs default; the GPU kernel's limit


@dataclass
class LogprobsTensors:
    """The logprob numbers of A rows (vLLM's name), on the host."""

    token_ids: np.ndarray  # [A] int64: the target token of each row
    logprobs: np.ndarray  # [A] float32: its logprob
    ranks: np.ndarray  # [A] int64: its rank
    top_ids: np.ndarray  # [A, k] int64: the k most likely tokens, best first
    top_logprobs: np.ndarray  # [A, k] float32

    def __len__(self) -> int:
        return len(self.token_ids)

    def slice(self, a: int, b: int) -> LogprobsTensors:
        """Rows [a, b) (views)."""
        return LogprobsTensors(self.token_ids[a:b], self.logprobs[a:b], self.ranks[a:b], self.top_ids[a:b],
                               self.top_logprobs[a:b])

    def entry(self, j: int, num: int, decode: Callable[[int], str] | None = None) -> dict[int, Logprob]:
        """Row j as vLLM's dict: the target token first, then the top `num` (a top token overwrites the target's
        entry with its own rank, which is the same)."""
        t = int(self.token_ids[j])
        d = {t: Logprob(float(self.logprobs[j]), int(self.ranks[j]))}
        for r, (tok, lp) in enumerate(zip(self.top_ids[j, :num].tolist(), self.top_logprobs[j, :num].tolist())):
            d[tok] = Logprob(lp, r + 1)
        if decode is not None:
            for tok, lp in d.items():
                lp.decoded_token = decode(tok)
        return d


@np.errstate(divide="ignore", invalid="ignore")  # a row of only -inf: lse -inf and NaN logprobs, no warnings
def compute_logprobs(x: np.ndarray, targets: np.ndarray, k: int) -> LogprobsTensors:
    """The numbers of `ops_logprobs.cu` in numpy: raw logits x [A, V] (float32), targets [A], top-k (k >= 0)."""
    a, vocab = x.shape
    targets = np.asarray(targets, np.int64)
    x = np.where(np.isnan(x), -np.inf, x).astype(np.float32, copy=False)
    m = x.max(axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, np.float32(0))
    # exp in float32 (each term within an ulp), summed in float64: a float64 copy of the logits cost half the call
    lse = m[:, 0].astype(np.float64) + np.log(np.exp(x - m).sum(axis=1, dtype=np.float64))
    rows = np.arange(a)
    valid = (targets >= 0) & (targets < vocab)
    xt = np.where(valid, x[rows, np.clip(targets, 0, vocab - 1)], -np.inf)
    ranks = (x >= xt[:, None]).sum(axis=1).astype(np.int64)
    k = min(k, vocab)
    top = _top_k(x, k) if k else np.zeros((a, 0), np.int64)
    top_lp = (np.take_along_axis(x, top, 1).astype(np.float64) - lse[:, None]).astype(np.float32)
    return LogprobsTensors(token_ids=targets, logprobs=(xt.astype(np.float64) - lse).astype(np.float32), ranks=ranks,
                           top_ids=top, top_logprobs=top_lp)


_BLOCK = 256  # block width of the top-k's candidate screen


def _top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Each row's k largest ids, best first, ties to the lower id. A screen replaces a full selection: the k-th
    largest of the rows' block maxima is at most the k-th largest value (the maxima are k distinct elements), so
    the values at or above it hold the answer; a row whose screen lets most of it through (-inf padding, heavy
    ties) is sorted whole."""
    a, vocab = x.shape
    pad = (-vocab) % _BLOCK
    blocks = np.pad(x, ((0, 0), (0, pad)), constant_values=-np.inf) if pad else x
    bmax = blocks.reshape(a, -1, _BLOCK).max(axis=2)
    kk = min(k, bmax.shape[1])
    tau = np.partition(bmax, bmax.shape[1] - kk, axis=1)[:, bmax.shape[1] - kk]
    top = np.empty((a, k), np.int64)
    for r in range(a):
        cand = np.flatnonzero(x[r] >= tau[r]) if kk == k else np.arange(vocab)
        if len(cand) > vocab // 4:
            cand = np.arange(vocab)
        order = np.lexsort((cand, -x[r, cand]))[:k]
        top[r] = cand[order]
    return top


def concat_logprobs(parts: list[LogprobsTensors]) -> LogprobsTensors:
    """Rows of several `LogprobsTensors` of one top-k, in order."""
    if len(parts) == 1:
        return parts[0]
    return LogprobsTensors(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                             ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs")))


def unpack(buf: np.ndarray, num_targets: int, target_of: np.ndarray, k: int) -> tuple[np.ndarray, LogprobsTensors]:
    """`fdl_logprobs`'s int32 output -> (the echoed targets, the rows' numbers)."""
    targets = buf[:num_targets].astype(np.int64)
    rec = buf[num_targets:].reshape(len(target_of), 2 + 2 * k)
    return targets, LogprobsTensors(
        token_ids=targets[target_of], logprobs=rec[:, 0].view(np.float32), ranks=rec[:, 1].astype(np.int64),
        top_ids=rec[:, 2 : 2 + k].astype(np.int64), top_logprobs=np.ascontiguousarray(rec[:, 2 + k :]).view(np.float32))


class LogprobsList(Sequence):
    """One sequence's logprobs, a list of dicts (token id -> `Logprob`) to its reader, built on access from the
    steps' arrays. Owned by the output processor while the sequence runs. `leading_none`: prompt logprobs,
    whose first entry is None (the first prompt token has no context)."""

    def __init__(self, decode: Callable[[int], str] | None = None, leading_none: bool = False):
        self._parts: list[tuple[LogprobsTensors, int, int]] = []  # (a step's arrays, row, top-k of the request)
        self._decode = decode
        self._lead = 1 if leading_none else 0

    def append(self, tensors: LogprobsTensors, row: int, num: int) -> None:
        self._parts.append((tensors, row, num))

    def extend_rows(self, tensors: LogprobsTensors, num: int) -> None:
        self._parts.extend((tensors, j, num) for j in range(len(tensors)))

    def __len__(self) -> int:
        return self._lead + len(self._parts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("logprobs index out of range")
        if i < self._lead:
            return None
        tensors, row, num = self._parts[i - self._lead]
        return tensors.entry(row, num, self._decode)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self):  # pickles (and deep-copies) as the plain list it reads as
        return list, (list(self),)
