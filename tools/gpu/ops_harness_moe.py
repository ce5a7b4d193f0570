"""The mixture-of-experts part of tools/gpu/ops_harness.py: checks of fdl_moe_route, fdl_moe_align and
fdl_moe_experts (fdlite/kernels/csrc/ops_moe*.cu) against the numpy contracts in tests/moe_ref.py, and the
MoE layer micro-benchmark. `checks(h)` and `bench_*(h)` take the harness module (its `check`, `to_gpu`, `q`,
`relerr`, `graph_time_us`, ...), so the helpers are not written twice.

    python3 tools/gpu/ops_harness.py --checks moe --no-bench          # the checks only
    python3 tools/gpu/ops_harness.py --only moe_decode,moe_prefill    # the benchmarks only
    python3 tools/gpu/ops_harness.py --checks moe_route --only moe_route  # the router: its checks and benchmark
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("moe_ref", ROOT / "tests" / "moe_ref.py")
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

# (name, hidden, expert width, experts, top_k, shared-expert width): the two full-size shapes of issue 26
SHAPES = [("Qwen3-30B-A3B", 2048, 768, 128, 8, 0), ("ERNIE-4.5-21B-A3B", 2560, 1536, 64, 6, 2 * 1536)]


def routing(kind: str, T: int, E: int, k: int, rng) -> np.ndarray:
    """ids [T, k] int32, distinct per token: uniform random; `uneven` (most tokens on experts 0..k-1, expert E - 1
    never); `one` (every token the same k experts); `idle` (random over E - 2 experts: two experts get nothing)."""
    if kind == "one":
        return np.tile(np.arange(k, dtype=np.int32), (T, 1))
    pool = E - 2 if kind == "idle" and E - 2 >= k else (E - 1 if kind == "uneven" and E - 1 >= k else E)
    ids = np.stack([rng.choice(pool, k, replace=False) for _ in range(T)]).astype(np.int32)
    if kind == "uneven":
        ids[: (3 * T) // 4] = np.arange(k, dtype=np.int32)
    return ids


def checks(h) -> None:
    G, rng, check, to_gpu, to_np, q, relerr, sync = h.G, h.rng, h.check, h.to_gpu, h.to_np, h.q, h.relerr, h.sync

    def t_route(T, E, k, dt, bias, renorm, ties=False):
        def f():
            logits = rng.integers(0, 3, (T, E)).astype(np.float32) if ties else q(rng.standard_normal((T, E)) * 2, dt)
            b = (rng.standard_normal(E) * 0.05).astype(np.float32) if bias else None
            norm_min = 1e-12 if renorm else 0.0
            ids, w = G.moe_route(to_gpu(logits, dt), k, renorm, norm_min, None if b is None else to_gpu(b, "float32"))
            sync()
            gi, gw = to_np(ids), to_np(w)
            ri, rw = ref.route(logits, k, renorm, norm_min, b)
            choose = ref.route(logits, E, False, 0.0, b)  # every expert, to read the choosing values
            cval = np.zeros((T, E), np.float64)
            np.put_along_axis(cval, choose[0].astype(np.int64), choose[1], axis=1)
            if b is not None:
                cval += b
            bad = np.flatnonzero((gi != ri).any(axis=1))
            # a swap of two experts whose choosing values differ by float32 rounding only is not an error (ties: none)
            near = [r for r in bad if not ties and np.allclose(np.sort(cval[r, gi[r]]), np.sort(cval[r, ri[r]]), atol=1e-6)]
            wrong = sorted(set(bad) - set(near))
            err = relerr(gw[[r for r in range(T) if r not in bad]], rw[[r for r in range(T) if r not in bad]]) if T > len(bad) else 0.0
            ok = not wrong and err <= 2e-6 and gi.dtype == np.int32
            return ok, err, 2e-6, f"rows with other ids: {wrong[:5]} (near-ties {len(near)})"
        return f

    for dt in h.DTYPES:
        for T, E, k in ((1, 8, 2), (17, 64, 6), (1000, 128, 8)):
            for bias, renorm in ((False, True), (True, True), (False, False)):
                check(f"moe_route {dt} T={T} E={E} k={k} bias={bias} renormalize={renorm}", t_route(T, E, k, dt, bias, renorm))
    check("moe_route float32 exact ties -> lower expert ids, T=64 E=64 k=8", t_route(64, 64, 8, "float32", False, True, True))
    check("moe_route bfloat16 exact ties (bf16 logits) T=64 E=128 k=8", t_route(64, 128, 8, "bfloat16", False, False, True))
    # E on each side of the kernel's register / shared-memory boundaries (1, 2, 4, 8 experts per lane in registers,
    # then shared memory past 256), k past 32 (choices stored in chunks of 32, renormalised after)
    for T, E, k in ((33, 7, 3), (33, 33, 8), (33, 65, 6), (33, 129, 8), (33, 256, 8), (33, 257, 8), (9, 1024, 8),
                    (9, 1024, 40), (33, 128, 40)):
        check(f"moe_route bfloat16 T={T} E={E} k={k} bias=True renormalize=True",
              t_route(T, E, k, "bfloat16", True, True))

    def route_exact_want(b, k, scores, norm_min):
        """ids and weights the kernel must give, bit for bit, from its own fp32 scores (every expert's p): the
        stable descending order of p (+ bias) in float32, NaN after every number (-inf included) in id order; the
        weights the chosen p divided by their float32 sum in choice order (floored at norm_min)."""
        choose = scores if b is None else scores + b.reshape(1, -1)
        ids = np.argsort(-choose, axis=1, kind="stable")[:, :k]  # argsort puts NaN last, in index order
        w = np.take_along_axis(scores, ids, axis=1)
        total = np.zeros(len(w), np.float32)
        for j in range(k):
            total += w[:, j]
        d = np.maximum(total, np.float32(norm_min)) if norm_min > 0 else total
        return ids.astype(np.int32), (w / d[:, None]).astype(np.float32)

    def t_route_exact(T, E, k, dt, bias, kind="normal"):
        """Bitwise: the kernel's every score (k = E, no renormalisation: the weights are the fp32 p), checked
        against the float64 softmax; then its ids and renormalised weights at k against `route_exact_want` on those
        scores. kind: normal; ties (logits in {0, 1, 2}, bias a multiple of 2^-10); nan (NaN / +inf / -inf
        entries and rows of -inf only, NaN bias entries: the ids must still be k distinct experts)."""
        def f():
            if kind == "ties":
                logits = rng.integers(0, 3, (T, E)).astype(np.float32)
                b = (rng.integers(-2, 3, E) / 1024).astype(np.float32) if bias else None
            else:
                logits = q(rng.standard_normal((T, E)) * 3, dt)
                b = (rng.standard_normal(E) * 0.05).astype(np.float32) if bias else None
            if kind == "nan":  # rows: a NaN, a +inf, -inf only, mostly -inf (ties of p = 0); -inf here and there
                r, col = rng.random(T), rng.integers(0, E, T)
                rows = np.arange(T)
                logits[rows[r < 0.1], col[r < 0.1]] = np.nan
                logits[rows[(r >= 0.1) & (r < 0.2)], col[(r >= 0.1) & (r < 0.2)]] = np.inf
                logits[(r >= 0.2) & (r < 0.3)] = -np.inf
                logits[((r >= 0.3) & (r < 0.5))[:, None] & (rng.random((T, E)) < 0.9)] = -np.inf
                logits[rng.random((T, E)) < 0.05] = -np.inf
                if b is not None:
                    b[rng.random(E) < 0.1] = np.nan
                    b[0] = -np.inf
            lg = to_gpu(logits, dt)
            bg = None if b is None else to_gpu(b, "float32")
            ids_all, p_all = G.moe_route(lg, E, False, 0.0, bg)
            ids, w = G.moe_route(lg, k, True, 1e-12, bg)
            sync()
            ids_all, p_all, ids, w = to_np(ids_all), to_np(p_all), to_np(ids), to_np(w)
            perm = np.array_equal(np.sort(ids_all, axis=1), np.tile(np.arange(E), (T, 1)))
            if not perm:
                return False, math.inf, 0, "k = E: the ids of a row are not a permutation of the experts"
            scores = np.zeros((T, E), np.float32)
            np.put_along_axis(scores, ids_all.astype(np.int64), p_all, axis=1)
            _, ref_p = ref.route(logits, E, False, 0.0, None)  # every p, in descending order of p
            ref_p = np.sort(ref_p, axis=1)
            err = relerr(np.sort(scores, axis=1), ref_p)
            want_all, _ = route_exact_want(b, E, scores, 0.0)
            want_ids, want_w = route_exact_want(b, k, scores, 1e-12)
            finite = ~np.isnan(want_w).any(axis=1)
            ok_ids = np.array_equal(ids_all, want_all) and np.array_equal(ids, want_ids)
            ok_w = np.array_equal(w[finite].view(np.uint32), want_w[finite].view(np.uint32))
            ok_nan = bool(np.isnan(w[~finite]).all())
            bad = np.flatnonzero((ids != want_ids).any(axis=1) | (ids_all != want_all).any(axis=1))
            ok = ok_ids and ok_w and ok_nan and (err <= 2e-6 or kind == "nan")
            return ok, err, 2e-6, (f"rows with other ids: {bad[:5].tolist()}; weights bitwise {ok_w}; NaN-weight rows "
                                   f"{int((~finite).sum())}")
        return f

    # the two models' routers at a prefill's T (many blocks), then each kernel variant (experts per lane 1, 2, 4, 8
    # in registers, shared memory) with k past 32 on some
    for T, E, k, dt, bias in ((8192, 128, 8, "bfloat16", False), (8192, 64, 6, "float32", True),
                              (300, 7, 3, "float16", True), (300, 33, 8, "bfloat16", True),
                              (300, 129, 8, "float32", False), (300, 256, 40, "bfloat16", True),
                              (100, 257, 8, "float32", True), (40, 1024, 33, "bfloat16", False)):
        for kind in ("normal", "ties", "nan"):
            check(f"moe_route exact vs its own scores, {kind}: {dt} T={T} E={E} k={k} bias={bias}",
                  t_route_exact(T, E, k, dt, bias, kind))

    def t_route_alone(dt, E, k, T=8192):
        """A token alone gives what it gets in a batch of T, bitwise."""
        def f():
            logits = q(rng.standard_normal((T, E)) * 2, dt)
            b = to_gpu((rng.standard_normal(E) * 0.05).astype(np.float32), "float32")
            ids, w = G.moe_route(to_gpu(logits, dt), k, True, 1e-12, b)
            ids, w = to_np(ids), to_np(w)
            rows = [0, 1, T // 2 + 3, T - 1]
            ok = True
            for r in rows:
                i1, w1 = G.moe_route(to_gpu(logits[r:r + 1], dt), k, True, 1e-12, b)
                ok &= np.array_equal(to_np(i1)[0], ids[r])
                ok &= np.array_equal(to_np(w1)[0].view(np.uint32), w[r].view(np.uint32))
            return ok, 0.0 if ok else math.inf, 0, f"rows {rows}"
        return f

    check("moe_route bfloat16: a token alone = in a batch of 8192, bitwise (E=128 k=8)",
          t_route_alone("bfloat16", 128, 8))
    check("moe_route float32: a token alone = in a batch of 8192, bitwise (E=64 k=6)", t_route_alone("float32", 64, 6))

    def t_align(T, E, k, bm, kind):
        def f():
            ids = routing(kind, T, E, k, rng)
            rows, tiles = G.moe_align(to_gpu(ids, "int32"), E, bm)
            sync()
            gr, gt = to_np(rows), to_np(tiles)
            bm_ = bm or ref.block_m(T * k, E)
            rr, rt = ref.align(ids, E, bm_)
            if gr.shape != rr.shape or gt.shape != rt.shape:
                return False, math.inf, 0, f"shapes {gr.shape} {gt.shape} vs {rr.shape} {rt.shape}"
            real = np.repeat(rt >= 0, bm_)
            ok = np.array_equal(gt, rt) and np.array_equal(gr[real], rr[real])
            return ok, 0.0 if ok else math.inf, 0, f"BM={bm_}, {int((rt >= 0).sum())} of {len(rt)} tiles real"
        return f

    for T, E, k in ((1, 8, 1), (3, 8, 2), (17, 64, 8), (256, 64, 6), (1000, 128, 8), (4096, 128, 8)):
        for bm in (0, 16, 64, 128):
            for kind in ("random", "uneven", "one", "idle"):
                check(f"moe_align T={T} E={E} k={k} block_m={bm} routing={kind}", t_align(T, E, k, bm, kind))
    for T, E, k in ((300, 1024, 8), (65536, 128, 8)):  # the most experts; 1024 chunks (32 per prefix warp)
        for bm in (16, 128):
            check(f"moe_align T={T} E={E} k={k} block_m={bm} routing=uneven", t_align(T, E, k, bm, "uneven"))

    def t_experts(T, E, k, H, I, dt, kind, bm=0, shared=False):
        def f():
            ids = routing(kind, T, E, k, rng)
            w = rng.random((T, k)).astype(np.float32)
            x = q(rng.standard_normal((T, H)), dt)
            w13 = q(rng.standard_normal((E, 2 * I, H)) / math.sqrt(H), dt)
            w2 = q(rng.standard_normal((E, H, I)) / math.sqrt(I), dt)
            sh = q(rng.standard_normal((T, H)), dt) if shared else None
            out = G.moe_experts(to_gpu(x, dt), to_gpu(ids, "int32"), to_gpu(w, "float32"), to_gpu(w13, dt),
                                to_gpu(w2, dt), bm, shared=None if sh is None else to_gpu(sh, dt))
            sync()
            got = to_np(out)
            rnd = (lambda a: a) if dt == "float32" else (lambda a: q(a, dt).astype(np.float64))
            want = ref.experts(x, ids, w, w13, w2, rnd=rnd, shared=None if sh is None else sh.astype(np.float64))
            err = relerr(got, want)
            tol = h.TOL[dt] * (1 if dt == "float32" else 2)
            return err <= tol, err, tol, f"BM={bm or auto_block_m(T * k, E, dt)}"
        return f

    def auto_block_m(n, E, dt):  # ops_moe.cu's choice for fdl_moe_experts (128 needs sm_90a code: the H100)
        return 128 if dt != "float32" and h.WGMMA else ref.block_m(n, E)

    for dt in h.DTYPES:
        for T in (1, 3, 17, 256, 1000):
            for E, k in ((8, 1), (8, 2), (64, 8)):
                kind = ("random", "uneven", "idle")[T % 3]
                check(f"moe_experts {dt} T={T} E={E} k={k} H=256 I=128 routing={kind}", t_experts(T, E, k, 256, 128, dt, kind))
        check(f"moe_experts {dt} odd tiles H=136 I=40 T=29 E=8 k=2", t_experts(29, 8, 2, 136, 40, dt, "uneven"))
        for bm in (16, 64):
            check(f"moe_experts {dt} forced block_m={bm} T=300 E=8 k=2 routing=one", t_experts(300, 8, 2, 64, 32, dt, "one", bm))
        check(f"moe_experts {dt} Qwen3-30B-A3B widths T=33 (2048/768, E=16, k=8)", t_experts(33, 16, 8, 2048, 768, dt, "random"))
        # the shared experts' output added before the one rounding: out = rnd(sum_j y + shared)
        for T, E, k, H, I, kind in ((1, 8, 2, 256, 128, "random"), (300, 64, 6, 256, 128, "idle"),
                                     (200, 8, 6, 2560, 1536, "uneven")):
            check(f"moe_experts {dt} + shared T={T} E={E} k={k} H={H} I={I} routing={kind}",
                  t_experts(T, E, k, H, I, dt, kind, shared=True))
        if dt != "float32" and h.WGMMA:  # the wgmma kernels (128-row tiles, the default here) on more shapes
            for T, E, k, H, I, kind in ((1, 8, 2, 256, 128, "random"), (29, 8, 2, 136, 40, "uneven"),
                                         (300, 8, 2, 64, 32, "one"), (1000, 64, 8, 256, 128, "idle"),
                                         (300, 16, 8, 2048, 768, "random"), (200, 8, 6, 2560, 1536, "uneven"),
                                         # several tiles per expert (the 16-byte epilogue, from T k >= 32 E, as
                                         # most cases above; the first two take the per-pair stores): padded
                                         # halves of last tiles (their MMAs skipped), one-row last tiles, odd
                                         # widths, the full-size widths
                                         (1100, 8, 2, 256, 128, "uneven"), (700, 4, 3, 136, 40, "random"),
                                         (513, 2, 1, 64, 32, "one"), (2048, 16, 8, 2048, 768, "random"),
                                         (1500, 8, 6, 2560, 1536, "idle"),
                                         # widths not multiples of 32: the 16-byte epilogue goes by groups of four
                                         # 8-column blocks, the last group of a row partly past N (2 or 3 blocks
                                         # inside), in a second N block too (280 = 256 + 24, 176 = 128 + 48)
                                         (300, 2, 2, 280, 176, "uneven"), (513, 4, 2, 88, 48, "one")):
                check(f"moe_experts {dt} wgmma block_m=128 T={T} E={E} k={k} H={H} I={I} routing={kind}",
                      t_experts(T, E, k, H, I, dt, kind, 128))

    def t_row_alone(dt, E=64, k=6, H=256, I=128, bm=0, bm_alone=None, T=300):
        """A token's output alone equals its row in a batch of T, bitwise (the wgmma kernels, the default on the
        H100: a token's sums do not depend on the other rows of its tile; the mma.sync kernels with BM 16 alone and
        64 in the batch: the same K order)."""
        def f():
            ids = routing("random", T, E, k, rng)
            w = rng.random((T, k)).astype(np.float32)
            x = q(rng.standard_normal((T, H)), dt)
            w13 = to_gpu(q(rng.standard_normal((E, 2 * I, H)) / 16, dt), dt)
            w2 = to_gpu(q(rng.standard_normal((E, H, I)) / 12, dt), dt)
            full = to_np(G.moe_experts(to_gpu(x, dt), to_gpu(ids, "int32"), to_gpu(w, "float32"), w13, w2, bm))
            rows = [0, 7, T - 1]
            alone = np.stack([to_np(G.moe_experts(to_gpu(x[r:r + 1], dt), to_gpu(ids[r:r + 1], "int32"),
                                                  to_gpu(w[r:r + 1], "float32"), w13, w2,
                                                  bm if bm_alone is None else bm_alone))[0] for r in rows])
            ok = np.array_equal(alone, full[rows])
            return ok, 0.0 if ok else relerr(alone, full[rows]), 0, f"rows {rows}"
        return f

    for dt in h.DTYPES:
        check(f"moe_experts {dt}: a token alone = in a batch of 300, bitwise", t_row_alone(dt))
        if dt != "float32" and h.WGMMA:
            check(f"moe_experts {dt}: a token alone = in a batch of 1100 (several full tiles per expert), bitwise",
                  t_row_alone(dt, E=8, k=2, T=1100))
        if dt != "float32":
            check(f"moe_experts {dt} mma.sync: a token alone (block_m 16) = in a batch of 300 (64), bitwise",
                  t_row_alone(dt, bm=64, bm_alone=16))

    def t_graph(dt, T=17, E=64, k=8, H=256, I=128, bm=0):
        """route + experts captured once, replayed on three new routings (new logits written in place): each replay
        equals the eager ops on the same inputs, bitwise; the routings differ (different experts, tiles)."""
        def f():
            x = to_gpu(q(rng.standard_normal((T, H)), dt), dt)
            lg = to_gpu(q(rng.standard_normal((T, E)), dt), dt)
            w13 = to_gpu(q(rng.standard_normal((E, 2 * I, H)) / 16, dt), dt)
            w2 = to_gpu(q(rng.standard_normal((E, H, I)) / 12, dt), dt)
            bias = to_gpu((rng.standard_normal(E) * 0.05).astype(np.float32), "float32")
            res = {}

            def body():
                ids, w = G.moe_route(lg, k, True, 1e-12, bias)
                res["ids"], res["out"] = ids, G.moe_experts(x, ids, w, w13, w2, bm)
            body()
            sync()
            g = h.CUDAGraph()
            g.capture_begin()
            body()
            g.capture_end()
            ok, seen = True, []
            for i in range(3):
                new = q(rng.standard_normal((T, E)) * (1 + i), dt)
                new[:, : 4 * i] += 5  # later routings pile onto a few experts
                G.copy_(lg, to_gpu(new, dt))
                g.replay()
                sync()
                got, gids = to_np(res["out"]), to_np(res["ids"])
                ids, w = G.moe_route(lg, k, True, 1e-12, bias)
                want = to_np(G.moe_experts(x, ids, w, w13, w2, bm))
                sync()
                ok &= bool(np.array_equal(got, want)) and bool(np.array_equal(gids, to_np(ids)))
                seen.append(np.bincount(gids.reshape(-1), minlength=E).max())
            g.reset()
            return ok, 0.0 if ok else math.inf, 0, f"largest expert per replay: {seen}"
        return f

    for dt in h.DTYPES:
        check(f"graph: moe_route + moe_experts {dt}, 3 replays with new routings = eager", t_graph(dt))
        if dt != "float32":  # many rows per expert (several M tiles each); the mma.sync kernels forced
            check(f"graph: moe_route + moe_experts {dt} T=300 E=8 k=2, 3 replays = eager", t_graph(dt, T=300, E=8, k=2))
            check(f"graph: moe_route + moe_experts {dt} mma.sync (block_m 16), 3 replays = eager", t_graph(dt, bm=16))


def _layer_case(h, name, H, I, E, k, shared, T, sets=4, block_m=0):
    """One MoE layer (gate GEMM + route + experts, + the shared-expert MLP when the model has one) at T tokens:
    GPU time per call from graph replays, cycling `sets` random router inputs so the experts touched differ."""
    G, rng, to_gpu, empty = h.G, h.rng, h.to_gpu, h.empty
    dt = "bfloat16"
    xs = [to_gpu(rng.standard_normal((T, H)) * 0.5, dt) for _ in range(sets)]
    gate = to_gpu(rng.standard_normal((E, H)) * 0.05, dt)
    w13, w2 = empty([E, 2 * I, H], dt), empty([E, H, I], dt)
    G.fill_(w13, 0.01)
    G.fill_(w2, 0.01)
    sh = None
    if shared:
        sh = (empty([2 * shared, H], dt), empty([H, shared], dt))
        G.fill_(sh[0], 0.01)
        G.fill_(sh[1], 0.01)
    i = [0]

    def fn():
        x = xs[i[0] % sets]
        ids, w = G.moe_route(G.linear(x, gate, None, True, static_w=True), k, True, 1e-12)
        G.moe_experts(x, ids, w, w13, w2, block_m)
        if sh is not None:
            G.linear(G.silu_and_mul(G.linear(x, sh[0], None, True, static_w=True)), sh[1], None, True, static_w=True)
        i[0] += 1
    us = h.graph_time_us(fn, per_graph=2 * sets, replays=5)
    # what a step must move: the touched experts' weights (counted from the routings), the shared MLP, activations
    touched = []
    for x in xs:
        ids, _ = G.moe_route(G.linear(x, gate, None, True, static_w=True), k, True, 1e-12)
        touched.append(len(np.unique(h.to_np(ids))))
    n_touched = float(np.mean(touched))
    wbytes = n_touched * 3 * H * I * 2 + (3 * H * shared * 2 if shared else 0) + E * H * 2
    abytes = T * H * 2 * 2 + T * k * (2 * I + 2 * H) * 2  # x, out; act and y written and read
    flops = 2 * T * (E * H + k * 3 * H * I + 3 * H * shared)
    roof = max((wbytes + abytes) / h.HBM, flops / PEAK_BF16)
    row = {"model": name, "T": T, "block_m": block_m or "auto", "us": round(us, 1), "tokens_per_s": round(T / us * 1e6),
           "experts_touched": round(n_touched, 1), "GB_s": round((wbytes + abytes) / us / 1e3),
           "TFLOP_s": round(flops / us / 1e6, 1), "roofline_us": round(roof * 1e6, 1),
           "frac_of_roofline": round(roof * 1e6 / us, 3)}
    h.log(f"  moe layer {name:18s} T={T:5d} block_m={row['block_m']!s:4s}: {us:9.1f} us {row['tokens_per_s']:9d} tok/s {row['GB_s']:6d} GB/s "
          f"{row['TFLOP_s']:6.1f} TFLOP/s, {n_touched:5.1f} experts; roofline {row['roofline_us']} us "
          f"({row['frac_of_roofline']:.0%})")
    return row


# (model, E, k, logits dtype, score-correction bias, norm_min): the two routers of SHAPES (ERNIE's gate in float32)
ROUTERS = [("Qwen3-30B-A3B", 128, 8, "bfloat16", False, 0.0), ("ERNIE-4.5-21B-A3B", 64, 6, "float32", True, 1e-12)]


def bench_route(h):
    """fdl_moe_route alone (renormalised, as both models route) at decode and prefill token counts: GPU time per call
    from graph replays of 52 calls, cycling over 4 logits buffers."""
    G, rng, to_gpu = h.G, h.rng, h.to_gpu
    out = []
    for name, E, k, dt, bias, norm_min in ROUTERS:
        b = to_gpu((rng.standard_normal(E) * 0.05).astype(np.float32), "float32") if bias else None
        for T in (1, 64, 1024, 8192):
            sets = 4
            lgs = [to_gpu(h.q(rng.standard_normal((T, E)) * 2, dt), dt) for _ in range(sets)]
            i = [0]

            def fn():
                G.moe_route(lgs[i[0] % sets], k, True, norm_min, b)
                i[0] += 1
            us = h.graph_time_us(fn, per_graph=52, replays=7)
            nbytes = T * E * (4 if dt == "float32" else 2)
            row = {"model": name, "E": E, "k": k, "dtype": dt, "bias": bias, "T": T, "us": round(us, 2),
                   "ns_per_token": round(us * 1e3 / T, 2), "GB_s": round(nbytes / us / 1e3)}
            out.append(row)
            h.log(f"  moe_route {name:18s} E={E:3d} k={k} {dt:8s} bias={bias!s:5s} T={T:5d}: {us:8.2f} us "
                  f"({row['ns_per_token']:8.2f} ns/token, {row['GB_s']:5d} GB/s of logits)")
    return out


PEAK_BF16 = 989e12  # H100 SXM dense bf16 (wgmma); mma.sync kernels reach a fraction of it


def bench_decode(h):
    """Decode-like token counts on the two full-size layer shapes (bf16; weights filled, routing random): the
    automatic choice (the wgmma kernels on the H100) beside the mma.sync kernels (block_m 16)."""
    return [_layer_case(h, *s, T, block_m=bm) for s in SHAPES for T in (1, 4, 16, 64, 128, 256) for bm in (16, 0)]


def bench_prefill(h):
    """Prefill token counts, the mma.sync kernels (block_m 64) beside the automatic choice (the wgmma kernels on
    the H100)."""
    return [_layer_case(h, *s, T, sets=2, block_m=bm) for s in SHAPES for T in (1024, 4096, 8192) for bm in (64, 0)]
