"""numpy reference of the GPU sampler (fdl_sample): thresholds, integer masses, inverse CDF.

Same rule as fdlite/kernels/csrc/ops_sampling.cu, step for step, so tests (and a CPU sampler that
wants the GPU's draws) can reproduce a token: x = logits / temperature (float32); the kept set is
x >= max(top-k value, top-p cutoff, max x + log(min_p)) with fdlite.sample.sampler's semantics; masses
are w = rint(exp(x - max x) * 2^44) as uint64; the token is the first (in vocabulary order) whose
inclusive cumulative mass exceeds floor(u * Z), u = ops.random.uniforms(seed, position, 0, float32).
"""

from __future__ import annotations

import math

import numpy as np

from fdlite.sample.random import uniforms

SAMPLING_EPS = 1e-5
_SCALE = np.float32(2.0**44)


def weights(x: np.ndarray, mx: np.float32) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp((x - mx).astype(np.float32)).astype(np.float32)
    return np.rint(e * _SCALE).astype(np.uint64)


def _clean(row: np.ndarray) -> np.ndarray:
    r = np.asarray(row, dtype=np.float32).copy()
    r[np.isnan(r)] = -np.inf
    return r


def threshold(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.float32:
    """The kept set is x >= this (x already divided by the temperature)."""
    v = x.shape[0]
    mx = x.max()
    thr = np.float32(-np.inf)
    if 0 < top_k < v:
        thr = np.sort(x)[::-1][top_k - 1]
    if top_p < 1.0:
        kept = x >= thr
        w = np.where(kept, weights(x, mx), np.uint64(0))
        total = int(w.sum(dtype=np.uint64))
        target = max(1, math.ceil(float(np.float32(top_p)) * float(total)))
        vals = x[kept]
        wk = w[kept]
        order = np.argsort(-vals, kind="stable")
        vs, ws = vals[order], wk[order]
        # mass of x >= v for each distinct v, descending
        uniq, start = np.unique(-vs, return_index=True)
        ends = np.r_[start[1:], len(vs)]
        cum = np.cumsum(ws, dtype=np.uint64)[ends - 1]
        i = int(np.argmax(cum >= np.uint64(target))) if (cum >= np.uint64(target)).any() else len(cum) - 1
        thr = max(thr, np.float32(-uniq[i]))
    if min_p > 0.0:
        thr = max(thr, np.float32(mx + np.float32(np.log(np.float32(min_p)))))
    return np.float32(thr)


def sample_row(row, temperature: float, top_k: int, top_p: float, min_p: float, seed: int, position: int,
               detail: bool = False):
    """The token fdl_sample draws for one row (with detail: also target, cumulative masses, threshold)."""
    r = _clean(row)
    greedy = int(np.argmax(r))
    if temperature < SAMPLING_EPS or r[greedy] == -np.inf:
        return (greedy, None) if detail else greedy
    x = (r / np.float32(temperature)).astype(np.float32)
    thr = threshold(x, top_k, top_p, min_p)
    w = np.where(x >= thr, weights(x, x.max()), np.uint64(0))
    cum = np.cumsum(w, dtype=np.uint64)
    z = int(cum[-1])
    u = float(uniforms(seed, position, 0, np.float32))
    target = min(int(u * float(z)), z - 1)
    tok = int(np.searchsorted(cum, np.uint64(target), side="right"))
    if detail:
        return tok, {"target": target, "cum": cum, "z": z, "threshold": float(thr), "kept": x >= thr}
    return tok
