"""numpy references of fdlite's GPU MoE ops' contracts (fdlite/kernels/csrc/ops_moe_route.cu, ops_moe.cu,
moe_align.cuh): the emulated GPU path (`gpu_emulator.py`) runs them, the CPU tests check them against
`FusedMoE`'s CPU path, and tools/gpu/ops_harness.py (which loads this file by path) compares the kernels
with them on the device. No fdlite import, so the harness can load it alone.
"""

from __future__ import annotations

import numpy as np

CHUNK = 512  # entries per count / scatter block (moe_align.cuh's kChunk)


def route(logits: np.ndarray, top_k: int, renormalize: bool, norm_min: float = 0.0, bias: np.ndarray | None = None,
          balanced: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(ids [T, k] int32, weights [T, k] float32): fp32 softmax, top-k of scores (+ bias) with equal values to the
    lower id and NaN after every number (in id order, as the kernel), weights the plain scores, renormalised in
    choice order."""
    t, e = logits.shape
    if balanced:
        ids = (np.arange(t * top_k) % e).reshape(t, top_k).astype(np.int32)
        return ids, np.full((t, top_k), 1.0 / top_k, np.float32)
    x = logits.astype(np.float32)
    p = np.exp(x - x.max(axis=1, keepdims=True))
    scores = (p / p.sum(axis=1, keepdims=True, dtype=np.float32)).astype(np.float32)
    choose = scores if bias is None else scores + np.asarray(bias, np.float32).reshape(1, e)
    ids = np.argsort(-choose, axis=1, kind="stable")[:, :top_k]  # stable: equal values keep the lower id first
    w = np.take_along_axis(scores, ids, axis=1)
    if renormalize:
        total = np.zeros((t, 1), np.float32)
        for j in range(top_k):  # in choice order, as the kernel sums
            total[:, 0] += w[:, j]
        w = w / (np.maximum(total, np.float32(norm_min)) if norm_min > 0 else total)
    return ids.astype(np.int32), w.astype(np.float32)


def block_m(n: int, num_experts: int) -> int:
    """The M tile the kernels pick for n = T k choices (ops_moe.cu's moe_block_m)."""
    return 16 if n <= 16 * num_experts else 64


def tiles_max(n: int, num_experts: int, bm: int) -> int:
    """The M-tile grid: a bound on the real tiles whatever the routing (moe_align.cuh)."""
    return (n + min(num_experts, n) * (bm - 1)) // bm


def align(ids: np.ndarray, num_experts: int, bm: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted_rows [tiles_max * bm], tile_expert [tiles_max]) int32: entries t k + j grouped by expert in entry
    order, each expert padded with -1 to a multiple of bm; -1 tiles past the last. Rows past the last real tile
    are unspecified in the kernel's output (here -2)."""
    flat = ids.reshape(-1).astype(np.int64)
    n = flat.size
    tm = tiles_max(n, num_experts, bm)
    rows = np.full(tm * bm, -2, np.int32)
    tile_expert = np.full(tm, -1, np.int32)
    r = tile = 0
    for e in range(num_experts):
        entries = np.flatnonzero(flat == e)
        if not entries.size:
            continue
        nt = -(-entries.size // bm)
        rows[r:r + nt * bm] = -1
        rows[r:r + entries.size] = entries
        tile_expert[tile:tile + nt] = e
        r, tile = r + nt * bm, tile + nt
    assert tile <= tm, "the tile bound does not hold"
    return rows, tile_expert


def experts(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, w13: np.ndarray, w2: np.ndarray,
            rnd=lambda a: a, shared: np.ndarray | None = None) -> np.ndarray:
    """out [T, H] = sum_j weights[t, j] * w2[e] (silu(w13[e, :I] x_t) * (w13[e, I:] x_t)), e = ids[t, j], with the
    experts' [E, out, in] weights, + shared [T, H] if given; `rnd` rounds to the model's dtype where the kernels do
    (after each GEMM, after silu, after each product; the sum over j plus shared in float, rounded once)."""
    t, k = ids.shape
    inter = w13.shape[1] // 2
    out = np.zeros((t, x.shape[1]), np.float64)
    for e in np.unique(ids):
        tok, j = np.nonzero(ids == e)
        gu = rnd(x[tok].astype(np.float64) @ w13[e].T.astype(np.float64))
        g, u = gu[:, :inter], gu[:, inter:]
        act = rnd(rnd(g / (1 + np.exp(-g))) * u)
        y = rnd(act @ w2[e].T.astype(np.float64))
        y = rnd(y * rnd(weights[tok, j].astype(np.float64))[:, None])
        np.add.at(out, tok, y)
    if shared is not None:
        out += shared
    return rnd(out)
