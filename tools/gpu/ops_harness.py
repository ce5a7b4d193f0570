#!/usr/bin/env python3
"""Device-side checks and micro-benchmarks of fdlite's GPU ops (fdlite/kernels/csrc/ops_*.cu).

Runs on the GPU machine under Paddle 2.6.2 (PyPI's only GPU wheel: host framework only, its own
kernels do nothing on sm_90), after tools/gpu/run_ops_tests.sh has staged Paddle. Every op is
compared with a float64 numpy reference (torch only times GEMMs for comparison), eagerly and inside
a Paddle CUDAGraph whose input buffers are rewritten between replays. Paddle's allocator cache is
seeded with NaN first (and the KV caches are NaN wherever nothing was written), so an op that does
nothing, a stray Paddle built-in, or a read of unwritten cache memory shows up as NaN or garbage.

    python3 tools/gpu/ops_harness.py --out DIR [--quick] [--no-bench]

Writes DIR/ops_results.json: checks (name, status, max error, tolerance, detail) and benchmarks.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
# Import fdlite.kernels.gpu without running fdlite/__init__.py (the engine, tokenizers...): stub packages.
for _name, _path in (("fdlite", ROOT / "fdlite"), ("fdlite.kernels", ROOT / "fdlite" / "kernels"),
                     ("fdlite.sample", ROOT / "fdlite" / "sample")):
    if _name not in sys.modules:
        _m = types.ModuleType(_name)
        _m.__path__ = [str(_path)]
        sys.modules[_name] = _m

ap = argparse.ArgumentParser()
ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "fdl_ops_out"))
ap.add_argument("--quick", action="store_true", help="fewer shapes, no long contexts")
ap.add_argument("--no-bench", action="store_true")
ap.add_argument("--only", default="", help="comma-separated benchmark names: skip the checks, run only these")
ap.add_argument("--checks", default="", help="comma-separated name prefixes: run only the checks whose name starts "
                "with one (e.g. moe,graph: moe); with --only, these checks run too")
ap.add_argument("--lib", default=None, help="prebuilt library (default: build into the cache)")
ARGS = ap.parse_args()
os.makedirs(ARGS.out, exist_ok=True)
RES: dict = {"checks": [], "bench": {}, "info": {}}
T0 = time.time()


def log(*a):
    print(*a, flush=True)


def save():
    with open(os.path.join(ARGS.out, "ops_results.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


def check(name, fn):
    """fn() -> (ok: bool, err: float, tol: float, detail: str)."""
    if ARGS.checks:
        if not name.startswith(tuple(p.strip() for p in ARGS.checks.split(","))):
            return True
    elif ARGS.only:
        return True
    t = time.time()
    try:
        ok, err, tol, detail = fn()
        status = "pass" if ok else "FAIL"
    except Exception as e:  # noqa: BLE001 - every failure is recorded, the run goes on
        status, err, tol, detail = "ERROR", None, None, f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"
        traceback.print_exc()
    RES["checks"].append({"name": name, "status": status, "err": err, "tol": tol, "detail": detail,
                          "s": round(time.time() - t, 2)})
    e = "-" if err is None else f"{err:.2e}"
    log(f"[{status}] {name}: err={e} tol={tol} {detail}")
    return status == "pass"


# ------------------------------------------------------------------ build + load
from fdlite.kernels import build as gbuild  # noqa: E402

t = time.time()
LIB = ARGS.lib or gbuild.build(verbose=False)
RES["info"]["build_s"] = round(time.time() - t, 1)
report = Path(LIB).parent / "ptxas_report.txt"
if report.is_file():
    import re

    spills = [ln.strip() for ln in report.read_text().splitlines()
              if re.search(r"[1-9]\d* bytes spill stores", ln)]
    RES["info"]["ptxas_spill_lines"] = spills
log(f"library {LIB} (build/cache {RES['info']['build_s']} s)")

t = time.time()
import paddle  # noqa: E402

paddle.set_device("gpu")
import fdlite.kernels.gpu as G  # noqa: E402
from fdlite.sample import random as noise  # noqa: E402
from fdlite.sample import sampling_ref  # noqa: E402

G.load(LIB)
RES["info"]["import_and_register_s"] = round(time.time() - t, 1)
from paddle.device.cuda.graphs import CUDAGraph  # noqa: E402

props = paddle.device.cuda.get_device_properties(0)
# whether the library's wgmma kernels run here (wgmma.cuh's wgmma_ready: sm_90a code built, an sm_90 GPU)
from fdlite import envs  # noqa: E402

WGMMA = "90a" in envs.FDLITE_CUDA_ARCHS and (props.major, props.minor) == (9, 0)
RES["info"]["device"] = {"name": props.name, "total_memory_GiB": round(props.total_memory / 2**30, 1),
                         "sms": props.multi_processor_count, "cc": [props.major, props.minor],
                         "paddle": paddle.__version__, "paddle_cuda": paddle.version.cuda(),
                         "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
log("device:", RES["info"]["device"])
CPU = paddle.CPUPlace()
rng = np.random.default_rng(1234)


# ------------------------------------------------------------------ host <-> device, rounding
def bf16_bits(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)


def bits_f32(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def q(a, dt):
    """Round to dtype dt and back to float32 (NaN-preserving for bf16)."""
    a = np.asarray(a, dtype=np.float32)
    if dt == "float32":
        return a.copy()
    if dt == "float16":
        return a.astype(np.float16).astype(np.float32)
    out = bits_f32(bf16_bits(a))
    out[np.isnan(a)] = np.nan
    return out


def to_gpu(a, dt):
    """numpy -> GPU tensor of dtype dt by host-to-device copy only (no Paddle kernel)."""
    if dt in ("int32", "int64", "uint8"):
        return paddle.to_tensor(np.ascontiguousarray(a, dtype=dt), place=paddle.CUDAPlace(0))
    a = np.asarray(a, dtype=np.float32)
    if dt == "float32":
        return paddle.to_tensor(np.ascontiguousarray(a), place=paddle.CUDAPlace(0))
    if dt == "float16":
        return paddle.to_tensor(a.astype(np.float16), place=paddle.CUDAPlace(0))
    t = paddle.to_tensor(bf16_bits(a), place=paddle.CUDAPlace(0))
    assert t.dtype == paddle.bfloat16, t.dtype
    return t


def host(a, dt):
    """numpy -> CPU tensor of dtype dt (for copy_ from the host)."""
    if dt == "bfloat16":
        return paddle.to_tensor(bf16_bits(a), place=CPU)
    return paddle.to_tensor(np.ascontiguousarray(a, dtype=dt), place=CPU)


def to_np(t):
    a = t.numpy()
    if t.dtype == paddle.bfloat16:
        return bits_f32(a.view(np.uint16)) if a.dtype != np.float32 else a
    if a.dtype in (np.int32, np.int64):
        return a
    return a.astype(np.float32)


def empty(shape, dt):
    return paddle.empty(shape, dtype=dt)


def sync():
    paddle.device.synchronize()


def relerr(got, ref):
    """max |got - ref| / max |ref|; NaN anywhere in got -> inf."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        return math.inf
    if not np.all(np.isfinite(got[np.isfinite(ref)])) or np.isnan(got).sum() != np.isnan(ref).sum():
        return math.inf
    m = np.isfinite(ref)
    if not m.any():
        return 0.0
    return float(np.max(np.abs(got[m] - ref[m])) / max(np.max(np.abs(ref[m])), 1e-30))


TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}  # one-to-two ulps of the output dtype
DTYPES = ["float32", "bfloat16", "float16"]


def poison(gib: float = 2.0):
    """Fill Paddle's allocator cache with NaN (chunks of many sizes), then free it: a kernel that
    does not write its output leaves NaN behind."""
    held = []
    for mb in (1, 3, 17, 64, 256):
        n = int(mb * 2**20 / 4)
        for _ in range(max(1, int(gib * 1024 / 5 / mb))):
            x = empty([n], "float32")
            G.fill_(x, float("nan"))
            held.append(x)
    sync()
    del held


# ------------------------------------------------------------------ timing
class Ev:
    def __init__(self):
        self.h = G.capi().fdl_event_create()

    def record(self):
        G.capi().fdl_event_record(self.h, paddle.device.current_stream().stream_base.cuda_stream)

    def ms_to(self, end):
        return G.capi().fdl_event_elapsed_ms(self.h, end.h)


def graph_time_us(fn, per_graph: int = 20, replays: int = 10):
    """GPU time per call of fn: a graph of per_graph calls, replayed `replays` times (median)."""
    fn()
    sync()
    g = CUDAGraph()
    g.capture_begin()
    for _ in range(per_graph):
        fn()
    g.capture_end()
    g.replay()
    sync()
    times = []
    for _ in range(replays):
        e0, e1 = Ev(), Ev()
        e0.record()
        g.replay()
        e1.record()
        times.append(e0.ms_to(e1) * 1e3 / per_graph)
    g.reset()
    return float(np.median(times))


def eager_us(fn, n=200):
    for _ in range(5):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n * 1e6


# ================================================================== (a) fill / cast / copy / gather
log("\n=== (a) fill, cast, copy, gather")
poison()


def t_fill(dt, n):
    def f():
        x = empty([n], dt)
        val = 3 if dt in ("int32", "int64") else -1.5
        G.fill_(x, val)
        big = None
        if dt == "int64":
            big = empty([n], dt)
            G.fill_(big, 2**40 + 7)
        sync()
        ok = np.all(to_np(x) == val) and (big is None or np.all(to_np(big) == 2**40 + 7))
        return bool(ok), 0.0 if ok else math.inf, 0, f"n={n}"
    return f


for dt in ("float32", "float16", "bfloat16", "int32", "int64"):
    for n in (1, 1000003):
        check(f"fill_ {dt} n={n}", t_fill(dt, n))


def t_cast(src_dt, dst_dt, n):
    def f():
        if src_dt in ("int32", "int64"):
            a = rng.integers(-1000, 1000, n).astype(src_dt)
        else:
            a = q(rng.standard_normal(n).astype(np.float32) * 100, src_dt)
        s = to_gpu(a, src_dt)
        d = empty([n], dst_dt)
        G.cast_(d, s)
        sync()
        got = to_np(d)
        if dst_dt in ("int32", "int64"):
            ref = np.trunc(np.asarray(a, dtype=np.float64)).astype(dst_dt) if src_dt not in ("int32", "int64") \
                else a.astype(dst_dt)
            ok = np.array_equal(got, ref)
            return ok, 0.0 if ok else math.inf, 0, ""
        ref = q(np.asarray(a, dtype=np.float32), dst_dt)
        ok = np.array_equal(got, ref)
        return ok, 0.0 if ok else relerr(got, ref), 0, ""
    return f


for s_dt in ("float32", "float16", "bfloat16", "int32", "int64"):
    for d_dt in ("float32", "float16", "bfloat16", "int32", "int64"):
        check(f"cast_ {s_dt}->{d_dt} n=100003", t_cast(s_dt, d_dt, 100003))


def t_copy(dt, how):
    def f():
        rows, cols = 10, 1001
        a = rng.standard_normal((rows, cols)).astype(np.float32) if dt not in ("int32", "int64") else \
            rng.integers(-2**31, 2**31 - 1, (rows, cols)).astype(dt)
        a = q(a, dt) if dt not in ("int32", "int64") else a
        buf = to_gpu(np.full((rows, cols), 7, np.float32) if dt not in ("int32", "int64") else np.full((rows, cols), 7, dt), dt)
        part = a[3:7]
        if how == "fdl_copy_ gpu->gpu row slice":
            G.copy_(buf[3:7], to_gpu(part, dt))
        elif how == "fdl_copy_ pageable host->gpu row slice":
            G.copy_(buf[3:7], host(part, dt))
        elif how == "Tensor.copy_ host->gpu row slice":
            v = buf[3:7]
            v.copy_(host(part, dt), False)
        sync()
        ref = np.full((rows, cols), 7, a.dtype if dt in ("int32", "int64") else np.float32)
        ref[3:7] = part
        got = to_np(buf)
        ok = np.array_equal(got, ref)
        return ok, 0.0 if ok else math.inf, 0, "rows 3:7 replaced, the rest untouched" if ok else \
            f"rows equal per row: {[bool(np.array_equal(got[i], ref[i])) for i in range(rows)]}"
    return f


for dt in ("float32", "bfloat16", "int64", "int32"):
    for how in ("fdl_copy_ gpu->gpu row slice", "fdl_copy_ pageable host->gpu row slice", "Tensor.copy_ host->gpu row slice"):
        check(f"{how} {dt}", t_copy(dt, how))


def t_gather(dt, idx_dt, rows, cols, m, offset, use_out):
    def f():
        src_np = q(rng.standard_normal((rows, cols)), dt) if dt not in ("int32", "int64") else \
            rng.integers(-100, 100, (rows, cols)).astype(dt)
        idx = rng.integers(offset - 3, offset + rows + 3, m)  # some outside the shard -> zeros
        src = to_gpu(src_np, dt)
        ix = to_gpu(idx, idx_dt)
        if use_out:
            out = empty([m, cols], dt)
            G.gather_rows(src, ix, offset, out=out)
        else:
            out = G.gather_rows(src, ix, offset)
        sync()
        ref = np.zeros((m, cols), dtype=np.float32 if dt not in ("int32", "int64") else dt)
        inside = (idx - offset >= 0) & (idx - offset < rows)
        ref[inside] = src_np[idx[inside] - offset]
        got = to_np(out)
        ok = np.array_equal(got, ref)
        return ok, 0.0 if ok else math.inf, 0, f"{int((~inside).sum())} of {m} ids outside the shard"
    return f


for dt, cols in (("bfloat16", 1024), ("float32", 1024), ("float16", 3), ("bfloat16", 7), ("int64", 5)):
    for idx_dt in ("int64", "int32"):
        check(f"gather_rows {dt} [50,{cols}] idx {idx_dt} offset 100", t_gather(dt, idx_dt, 50, cols, 37, 100, False))
check("gather_rows_ (out=) bfloat16 Qwen3 embedding [151936,1024] T=300",
      t_gather("bfloat16", "int64", 151936, 1024, 300, 0, True))
save()

# ================================================================== (b) norms, activation
log("\n=== (b) RMSNorm, fused add + RMSNorm, SiLU-and-mul")
poison()


def rms_ref(x, w, eps, dt):
    x64 = x.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return q(q(x64 * inv, dt).astype(np.float64) * w.astype(np.float64), dt)


def t_rms(dt, shape, fused):
    def f():
        eps = 1e-6
        x = q(rng.standard_normal(shape) * 2, dt)
        r = q(rng.standard_normal(shape), dt)
        w = q(1 + 0.2 * rng.standard_normal(shape[-1]), dt)
        xg, wg = to_gpu(x, dt), to_gpu(w, dt)
        if fused:
            rg = to_gpu(r, dt)
            G.fused_add_rms_norm_(xg, rg, wg, eps)
            sync()
            res_ref = q(x.astype(np.float64) + r, dt)
            e1 = relerr(to_np(rg), res_ref)
            e2 = relerr(to_np(xg), rms_ref(res_ref, w, eps, dt))
            err = max(e1, e2)
            return err <= TOL[dt], err, TOL[dt], f"residual {e1:.1e}, normed {e2:.1e}"
        y = G.rms_norm(xg, wg, eps)
        sync()
        err = relerr(to_np(y), rms_ref(x, w, eps, dt))
        return err <= TOL[dt], err, TOL[dt], ""
    return f


def t_silu(dt, t, inter):
    def f():
        x = q(rng.standard_normal((t, 2 * inter)) * 3, dt)
        y = G.silu_and_mul(to_gpu(x, dt))
        sync()
        g64, u64 = x[:, :inter].astype(np.float64), x[:, inter:].astype(np.float64)
        ref = q(q(g64 / (1 + np.exp(-g64)), dt).astype(np.float64) * u64, dt)
        err = relerr(to_np(y), ref)
        return err <= TOL[dt], err, TOL[dt], f"shape {list(y.shape)}"
    return f


for dt in DTYPES:
    for shape in ((1, 1024), (37, 1024), (5, 4096), (3, 1000), (2, 3, 8192)):
        check(f"rms_norm {dt} {shape}", t_rms(dt, shape, False))
        check(f"fused_add_rms_norm_ {dt} {shape}", t_rms(dt, shape, True))
    for t_, inter in ((1, 3072), (37, 3072), (5, 1001)):
        check(f"silu_and_mul {dt} [{t_},{2 * inter}]", t_silu(dt, t_, inter))
save()

# ================================================================== (c) linear
log("\n=== (c) linear (cuBLASLt; the GEMV for [out, in] weights at M <= 4)")
poison()


def t_linear(dt, m, k, n, bias, trans_w, out_fp32=False, static_w=False):
    def f():
        x = q(rng.standard_normal((m, k)), dt)
        w = q(rng.standard_normal((n, k) if trans_w else (k, n)) * 0.05, dt)
        b = q(rng.standard_normal(n) * 0.1, dt) if bias else None
        xg, wg = to_gpu(x, dt), to_gpu(w, dt)
        bg = to_gpu(b, dt) if bias else None
        if out_fp32:
            out = empty([m, n], "float32")
            y = G.linear(xg, wg, bg, trans_w, out=out, static_w=static_w)
        else:
            y = G.linear(xg, wg, bg, trans_w, static_w=static_w)
        sync()
        ref = x.astype(np.float64) @ (w.T if trans_w else w).astype(np.float64)
        if bias:
            ref = ref + b
        ref = ref if out_fp32 else q(ref, dt)
        err = relerr(to_np(y), ref)
        tol = 1e-5 if (dt == "float32" or out_fp32) and dt == "float32" else (2e-3 if out_fp32 else TOL[dt])
        if out_fp32 and dt != "float32":
            tol = 2e-3
        return err <= tol, err, tol, f"y {list(y.shape)} {y.dtype}"
    return f


QWEN = dict(hidden=1024, heads=16, kv_heads=8, head_dim=128, inter=3072, vocab=151936)
MS = (1, 7, 64, 256) if not ARGS.quick else (1, 64)
for dt in ("bfloat16", "float32", "float16"):
    for m in MS:
        check(f"linear {dt} qkv M={m} [1024->4096]", t_linear(dt, m, 1024, 4096, False, False))
        if dt != "float16":
            check(f"linear {dt} qkv+bias M={m} [1024->4096]", t_linear(dt, m, 1024, 4096, True, False))
            check(f"linear {dt} down M={m} [3072->1024]", t_linear(dt, m, 3072, 1024, False, False))
    check(f"linear {dt} odd M=5 [1000->1003] +bias", t_linear(dt, 5, 1000, 1003, True, False))
for dt in ("bfloat16", "float32", "float16"):  # [out, in] weights at M <= 4: the decode GEMV
    for m in (1, 2, 3, 4):
        check(f"linear {dt} gemv qkv+bias M={m} [1024->4096] trans_w", t_linear(dt, m, 1024, 4096, True, True))
        check(f"linear {dt} gemv down M={m} [3072->1024] trans_w static_w", t_linear(dt, m, 3072, 1024, False, True,
                                                                                      static_w=True))
    check(f"linear {dt} gemv odd M=2 [1000->1003] +bias trans_w", t_linear(dt, 2, 1000, 1003, True, True))
    check(f"linear {dt} K not 16-byte rows M=1 [1003->77] trans_w (cuBLASLt)", t_linear(dt, 1, 1003, 77, False, True))
check("linear bfloat16 gemv M=1 [1024->151936] tied head float32 out static_w",
      t_linear("bfloat16", 1, 1024, 151936, False, True, out_fp32=True, static_w=True))
check("linear bfloat16 tied LM head (trans_w) M=3 [1024->151936] float32 out",
      t_linear("bfloat16", 3, 1024, 151936, False, True, out_fp32=True))
check("linear float32 tied LM head (trans_w) M=2 [1024->151936]", t_linear("float32", 2, 1024, 151936, False, True))
save()

# ================================================================== (d) rope + q/k norm + cache write
log("\n=== (d) rotary + q/k norm + KV-cache write")
poison()


def rope_tables(d, max_pos, theta=1e6):
    inv = (1.0 / (np.float32(theta) ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))).astype(np.float32)
    fr = np.arange(max_pos, dtype=np.float32)[:, None] * inv[None, :]
    emb = np.concatenate([fr, fr], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def rope_ref(x, pos, cos, sin):
    half = x.shape[-1] // 2
    c, s = cos[pos][:, None, :].astype(np.float64), sin[pos][:, None, :].astype(np.float64)
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * c + rot * s


def head_norm_ref(x, w, eps, dt):
    x64 = x.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return q(q(x64 * inv, dt).astype(np.float64) * w, dt).astype(np.float64)


def cache_row(slot, j, kvh, bs):
    return (slot // bs * kvh + j) * bs + slot % bs


def t_rope(dt, T, h, kvh, d, bs, num_blocks, qk_norm, table_dt, clamp=False):
    """clamp: positions below 0 and past the table too (the op clamps them to [0, max_pos))."""
    def f():
        eps = 1e-6
        max_pos = 4096
        cos, sin = rope_tables(d, max_pos)
        cos_t, sin_t = q(cos, table_dt), q(sin, table_dt)
        qkv = q(rng.standard_normal((T, (h + 2 * kvh) * d)) * 2, dt)
        pos = rng.integers(-5, max_pos + 100, T) if clamp else rng.integers(0, max_pos, T)
        slots = rng.choice(num_blocks * bs, T, replace=False).astype(np.int64)
        slots[::5] = -1  # write nothing
        qw = q(1 + 0.2 * rng.standard_normal(d), dt)
        kw = q(1 + 0.2 * rng.standard_normal(d), dt)
        kc = to_gpu(np.full((num_blocks + 1, kvh, bs, d), np.nan, np.float32), dt)
        vc = to_gpu(np.full((num_blocks + 1, kvh, bs, d), np.nan, np.float32), dt)
        qo = G.rope_qk_norm_cache(to_gpu(qkv, dt), to_gpu(pos, "int64"), to_gpu(slots, "int64"), to_gpu(cos_t, table_dt),
                                  to_gpu(sin_t, table_dt), kc, vc, h, to_gpu(qw, dt) if qk_norm else None,
                                  to_gpu(kw, dt) if qk_norm else None, eps)
        sync()
        x = qkv.reshape(T, h + 2 * kvh, d).astype(np.float64)
        qx, kx, vx = x[:, :h], x[:, h:h + kvh], x[:, h + kvh:]
        if qk_norm:
            qx, kx = head_norm_ref(qx, qw, eps, dt), head_norm_ref(kx, kw, eps, dt)
        pos_c = np.clip(pos, 0, max_pos - 1)
        q_ref = q(rope_ref(qx, pos_c, cos_t, sin_t), dt)
        k_ref = q(rope_ref(kx, pos_c, cos_t, sin_t), dt)
        e_q = relerr(to_np(qo), q_ref)
        kcn = to_np(kc).reshape(-1, d)
        vcn = to_np(vc).reshape(-1, d)
        written = np.zeros(kcn.shape[0], bool)
        gk, rk, gv, rv = [], [], [], []
        for t_ in range(T):
            if slots[t_] < 0:
                continue
            for j in range(kvh):
                r = cache_row(int(slots[t_]), j, kvh, bs)
                written[r] = True
                gk.append(kcn[r]); rk.append(k_ref[t_, j]); gv.append(vcn[r]); rv.append(q(vx[t_, j], dt))
        e_k, e_v = relerr(np.array(gk), np.array(rk)), relerr(np.array(gv), np.array(rv))
        untouched = bool(np.all(np.isnan(kcn[~written])) and np.all(np.isnan(vcn[~written])))
        err = max(e_q, e_k, e_v)
        tol = TOL[dt] * 2
        return err <= tol and untouched, err, tol, f"q {e_q:.1e} k {e_k:.1e} v {e_v:.1e}; other slots untouched: {untouched}"
    return f


for dt in DTYPES:
    check(f"rope_qk_norm_cache {dt} Qwen3 (16/8 heads, d128, bs64) qk_norm, fp32 table",
          t_rope(dt, 37, 16, 8, 128, 64, 12, True, "float32"))
    check(f"rope_qk_norm_cache {dt} no qk_norm, {dt} table, bs16", t_rope(dt, 29, 16, 8, 128, 16, 40, False, dt))
check("rope_qk_norm_cache bfloat16 d64 14/2 heads (Qwen2.5-0.5B-like)", t_rope("bfloat16", 23, 14, 2, 64, 64, 5, False, "float32"))
check("rope_qk_norm_cache float32 d256 8/4 heads", t_rope("float32", 9, 8, 4, 256, 32, 4, True, "float32"))
for dt in ("bfloat16", "float32"):  # a warp takes 4 heads of a token (18 heads: 4 + 4 + 4 + 4 + 2)
    check(f"rope_qk_norm_cache {dt} 600 tokens (wide: 4 heads a warp) 16/8 heads d128 qk_norm",
          t_rope(dt, 600, 16, 8, 128, 64, 12, True, "float32"))
    check(f"rope_qk_norm_cache {dt} 600 tokens (wide: 4 heads a warp) 14/2 heads d64, {dt} table",
          t_rope(dt, 600, 14, 2, 64, 16, 40, False, dt))
check("rope_qk_norm_cache bfloat16 d80 8/2 heads (pairs of elements, lanes past d/2 idle)",
      t_rope("bfloat16", 21, 8, 2, 80, 16, 12, True, "float32"))
check("rope_qk_norm_cache float16 d98 4/2 heads (d/2 odd: one element per load), fp16 table",
      t_rope("float16", 13, 4, 2, 98, 16, 8, True, "float16"))
# From 128 tokens (FP8 caches: 256), where d/2 is a multiple of 8: rope_cache_wide_kernel (8 lanes a head, 16-byte
# accesses); other head_dims keep rope_cache_kernel (4 heads a warp from 512 tokens). Padded tokens (every 5th slot
# -1) and, with clamp, positions below 0 and past the table.
for dt in DTYPES:
    check(f"rope_qk_norm_cache {dt} 2048 tokens (wide) Qwen3-30B-A3B 32/4 heads d128 bs64 qk_norm, fp32 table, "
          "positions clamped", t_rope(dt, 2048, 32, 4, 128, 64, 40, True, "float32", clamp=True))
check("rope_qk_norm_cache bfloat16 1000 tokens (wide) 14/2 heads d64 (18 heads: a group of 2) qk_norm, bfloat16 table,"
      " positions clamped", t_rope("bfloat16", 1000, 14, 2, 64, 16, 70, True, "bfloat16", clamp=True))
check("rope_qk_norm_cache float16 700 tokens (wide) 5/1 heads d128 (7 heads) no qk_norm, float16 table",
      t_rope("float16", 700, 5, 1, 128, 16, 50, False, "float16", clamp=True))
check("rope_qk_norm_cache bfloat16 600 tokens (wide) 8/4 heads d256 (2 chunks a lane) qk_norm, fp32 table",
      t_rope("bfloat16", 600, 8, 4, 256, 32, 20, True, "float32", clamp=True))
check("rope_qk_norm_cache float16 600 tokens (wide) 8/2 heads d80 (lanes past d/2 idle) qk_norm, fp32 table",
      t_rope("float16", 600, 8, 2, 80, 16, 40, True, "float32"))
check("rope_qk_norm_cache bfloat16 600 tokens d72 8/2 heads (d/2 not whole chunks: 4 heads a warp) qk_norm",
      t_rope("bfloat16", 600, 8, 2, 72, 16, 40, True, "float32", clamp=True))
check("rope_qk_norm_cache float16 600 tokens d98 4/2 heads (d/2 odd: 4 heads a warp, one element per load)",
      t_rope("float16", 600, 4, 2, 98, 16, 40, True, "float16"))


def t_rope_bits(dt, T, h, kvh, d, bs, num_blocks, qk_norm, table_dt, chunk=100):
    """The wide kernel (one call on T >= 512 tokens) against the decode path (the same tokens in calls of `chunk` <
    128 tokens, where model-dtype caches take one head a warp): q and both caches must be equal bit for bit (the same
    float32 arithmetic in the same order, the q/k norm's sum of squares included)."""
    def f():
        max_pos = 4096
        cos, sin = rope_tables(d, max_pos)
        tabs = (to_gpu(q(cos, table_dt), table_dt), to_gpu(q(sin, table_dt), table_dt))
        qkv = q(rng.standard_normal((T, (h + 2 * kvh) * d)) * 2, dt)
        pos = rng.integers(-5, max_pos + 100, T)
        slots = rng.choice(num_blocks * bs, T, replace=False).astype(np.int64)
        slots[::5] = -1
        qw = to_gpu(q(1 + 0.2 * rng.standard_normal(d), dt), dt) if qk_norm else None
        kw = to_gpu(q(1 + 0.2 * rng.standard_normal(d), dt), dt) if qk_norm else None
        shape = (num_blocks + 1, kvh, bs, d)
        caches = [to_gpu(np.full(shape, np.nan, np.float32), dt) for _ in range(4)]

        def run(lo, hi, kc, vc):
            return G.rope_qk_norm_cache(to_gpu(qkv[lo:hi], dt), to_gpu(pos[lo:hi], "int64"),
                                        to_gpu(slots[lo:hi], "int64"), *tabs, kc, vc, h, qw, kw, 1e-6)
        q_wide = to_np(run(0, T, caches[0], caches[1]))
        q_head = np.concatenate([to_np(run(lo, min(T, lo + chunk), caches[2], caches[3])) for lo in range(0, T, chunk)])
        sync()
        same = [np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in
                ((q_wide, q_head), (to_np(caches[0]), to_np(caches[2])), (to_np(caches[1]), to_np(caches[3])))]
        n_diff = int(np.sum(q_wide.view(np.uint32) != q_head.view(np.uint32)))
        finite = bool(np.all(np.isfinite(q_wide)))
        ok = all(same) and finite
        return ok, float(n_diff), 0, (f"q / k cache / v cache equal: {same}; q elements differing {n_diff} of "
                                      f"{q_wide.size}; q finite: {finite}")
    return f


for dt in DTYPES:
    check(f"rope_qk_norm_cache {dt} wide path == decode path bit for bit: 8192 tokens Qwen3-30B-A3B 32/4 heads d128 "
          "qk_norm, fp32 table", t_rope_bits(dt, 8192, 32, 4, 128, 64, 130, True, "float32"))
check("rope_qk_norm_cache bfloat16 wide path == decode path bit for bit: 1024 tokens 14/2 heads d64 qk_norm, "
      "bfloat16 table", t_rope_bits("bfloat16", 1024, 14, 2, 64, 16, 70, True, "bfloat16"))
check("rope_qk_norm_cache float32 wide path == decode path bit for bit: 600 tokens 8/4 heads d256 qk_norm",
      t_rope_bits("float32", 600, 8, 4, 256, 32, 20, True, "float32"))
check("rope_qk_norm_cache float16 wide path == decode path bit for bit: 600 tokens 6/2 heads d80 qk_norm, float16 "
      "table", t_rope_bits("float16", 600, 6, 2, 80, 16, 40, True, "float16"))


# ---- FP8 (e4m3) caches: numpy codec, round to nearest even, saturating (what the kernels' cvt does)
def e4m3_decode(b):
    b = np.asarray(b, np.uint8).astype(np.int64)
    e, m = (b >> 3) & 15, b & 7
    v = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    v = np.where((e == 15) & (m == 7), np.nan, v)
    return np.where(b >> 7, -v, v)


_E4M3_POS = e4m3_decode(np.arange(127))  # codes 0..126: 0 .. 448 ascending


def e4m3_encode(x):
    x = np.asarray(x, np.float64)
    a = np.minimum(np.abs(x), 448.0)
    i = np.clip(np.searchsorted(_E4M3_POS, a), 1, 126)
    lo, hi = _E4M3_POS[i - 1], _E4M3_POS[i]
    pick_hi = (a - lo > hi - a) | ((a - lo == hi - a) & (i % 2 == 0))  # ties to the even code
    code = np.where(a <= 0, 0, np.where(pick_hi, i, i - 1)).astype(np.uint8)
    return np.where(x < 0, code | 0x80, code).astype(np.uint8)


def fp8_quantize(v):
    """v [..., d] float32 -> (bits, scale [...]) as fdlite/kvcache/fp8_cache.py: scale = amax / 448 per vector."""
    v = np.asarray(v, np.float32)
    amax = np.abs(v).max(-1)
    scale = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    return e4m3_encode((v / scale[..., None]).astype(np.float32)), scale


def t_rope_fp8(dt, T, h, kvh, d, bs, num_blocks, qk_norm):
    """The FP8 cache write against the model-dtype one on the same inputs: its vectors quantized on the host."""
    def f():
        cos, sin = rope_tables(d, 4096)
        args = (to_gpu(q(rng.standard_normal((T, (h + 2 * kvh) * d)) * 2, dt), dt),
                to_gpu(rng.integers(0, 4096, T), "int64"))
        slots = rng.choice(num_blocks * bs, T, replace=False).astype(np.int64)
        slots[::5] = -1
        tabs = (to_gpu(cos, "float32"), to_gpu(sin, "float32"))
        qw = to_gpu(q(1 + 0.2 * rng.standard_normal(d), dt), dt) if qk_norm else None
        kw = to_gpu(q(1 + 0.2 * rng.standard_normal(d), dt), dt) if qk_norm else None
        shape = (num_blocks + 1, kvh, bs, d)
        kc, vc = to_gpu(np.full(shape, np.nan, np.float32), dt), to_gpu(np.full(shape, np.nan, np.float32), dt)
        q_ref = G.rope_qk_norm_cache(*args, to_gpu(slots, "int64"), *tabs, kc, vc, h, qw, kw, 1e-6)
        k8 = types.SimpleNamespace(data=to_gpu(np.full(shape, 0x7F, np.uint8), "uint8"),
                                   scale=to_gpu(np.full(shape[:3], -1.0, np.float32), "float32"))
        v8 = types.SimpleNamespace(data=to_gpu(np.full(shape, 0x7F, np.uint8), "uint8"),
                                   scale=to_gpu(np.full(shape[:3], -1.0, np.float32), "float32"))
        q8 = G.rope_qk_norm_cache_fp8(*args, to_gpu(slots, "int64"), *tabs, k8, v8, h, qw, kw, 1e-6)
        sync()
        e_q = relerr(to_np(q8), to_np(q_ref))
        rows = sorted({cache_row(int(sl), j, kvh, bs) for sl in slots if sl >= 0 for j in range(kvh)})
        bad, untouched = 0, True
        for c16, c8 in ((kc, k8), (vc, v8)):
            want_bits, want_scale = fp8_quantize(to_np(c16).reshape(-1, d)[rows])
            got_bits = c8.data.numpy().reshape(-1, d)
            got_scale = c8.scale.numpy().reshape(-1)
            bad += int(np.sum(e4m3_decode(got_bits[rows]) != e4m3_decode(want_bits)))
            bad += int(np.sum(got_scale[rows] != want_scale))
            others = np.ones(len(got_scale), bool)
            others[rows] = False
            untouched &= bool(np.all(got_bits[others] == 0x7F) and np.all(got_scale[others] == -1.0))
        ok = e_q == 0 and bad == 0 and untouched
        return ok, float(bad), 0, f"q vs model-dtype path {e_q:.1e}; {len(rows)} rows x 2, values/scales differing: {bad}; others untouched: {untouched}"
    return f


for dt in ("bfloat16", "float16"):
    check(f"rope_qk_norm_cache_fp8 {dt} Qwen3 (16/8, d128, bs64) qk_norm", t_rope_fp8(dt, 37, 16, 8, 128, 64, 12, True))
    check(f"rope_qk_norm_cache_fp8 {dt} d64 14/2 heads bs16", t_rope_fp8(dt, 29, 14, 2, 64, 16, 40, False))
    check(f"rope_qk_norm_cache_fp8 {dt} 600 tokens (wide, 18 heads: a group of 2) 14/2 heads d64 bs16",
          t_rope_fp8(dt, 600, 14, 2, 64, 16, 40, False))
    # from 256 tokens FP8 caches take the wide kernel too (below, rope_cache_kernel): its e4m3 bits and scales against
    # the model-dtype path's values quantized on the host, q bit for bit
    check(f"rope_qk_norm_cache_fp8 {dt} 600 tokens (wide) 32/4 heads d128 bs64 qk_norm",
          t_rope_fp8(dt, 600, 32, 4, 128, 64, 12, True))
    check(f"rope_qk_norm_cache_fp8 {dt} 300 tokens (wide) 16/8 heads d128 bs16 no qk_norm",
          t_rope_fp8(dt, 300, 16, 8, 128, 16, 40, False))
save()

# ================================================================== (e) paged attention
log("\n=== (e) paged attention")
poison()


class Batch:
    """A flat varlen batch over a paged cache filled with NaN except where rows' KV was written."""

    def __init__(self, rows, h, kvh, d, bs, dt, extra_blocks=3, scratch_rows=(), num_blocks=None, max_blocks=None):
        # rows: list of (q_len, kv_len); scratch_rows: padded rows (1, 1) that read the scratch block
        self.rows, self.h, self.kvh, self.d, self.bs, self.dt = rows, h, kvh, d, bs, dt
        nb_row = [max(1, -(-kv // bs)) for _, kv in rows]
        self.num_blocks = num_blocks or sum(nb_row) + extra_blocks
        self.max_blocks = max_blocks or max(nb_row) + 1
        assert self.num_blocks >= sum(nb_row) and self.max_blocks >= max(nb_row)
        perm = rng.permutation(self.num_blocks)  # scattered blocks, shared by no two rows
        self.bt = np.full((len(rows), self.max_blocks), -1, np.int32)
        k = np.full((self.num_blocks + 1, kvh, bs, d), np.nan, np.float32)
        v = np.full((self.num_blocks + 1, kvh, bs, d), np.nan, np.float32)
        self.K, self.V = [], []  # per row: [kv_len, kvh, d] (rounded)
        scratch = (q(rng.standard_normal((1, kvh, d)), dt), q(rng.standard_normal((1, kvh, d)), dt))
        o = 0
        for r, (ql, kv) in enumerate(rows):
            blocks = perm[o:o + nb_row[r]]
            o += nb_row[r]
            if r in scratch_rows:  # every padded row reads the scratch block's first slot
                blocks = np.array([self.num_blocks])
                kr, vr = scratch
            else:
                kr = q(rng.standard_normal((kv, kvh, d)), dt)
                vr = q(rng.standard_normal((kv, kvh, d)), dt)
            self.bt[r, :len(blocks)] = blocks
            for p in range(kv):
                k[blocks[p // bs], :, p % bs] = kr[p]
                v[blocks[p // bs], :, p % bs] = vr[p]
            self.K.append(kr)
            self.V.append(vr)
        self.k_np, self.v_np = k, v
        self.cu = np.concatenate([[0], np.cumsum([ql for ql, _ in rows])]).astype(np.int32)
        self.T = int(self.cu[-1])
        self.q = q(rng.standard_normal((self.T, h, d)), dt)
        self.kc, self.vc = to_gpu(k, dt), to_gpu(v, dt)
        self.seq = np.array([kv for _, kv in rows], np.int32)

    def ref(self, scale):
        g = self.h // self.kvh
        out = np.zeros((self.T, self.h, self.d))
        for r, (ql, kv) in enumerate(self.rows):
            if ql == 0 or kv == 0:  # nothing to attend to: zeros
                continue
            t0 = self.cu[r]
            pos = kv - ql + np.arange(ql)
            for j in range(self.kvh):
                kk = self.K[r][:, j].astype(np.float64)  # [kv, d]
                vv = self.V[r][:, j].astype(np.float64)
                qh = self.q[t0:t0 + ql, j * g:(j + 1) * g].astype(np.float64)  # [ql, g, d]
                s = np.einsum("qgd,kd->qgk", qh, kk) * scale
                mask = np.arange(kv)[None, None, :] <= pos[:, None, None]
                s = np.where(mask, s, -np.inf)
                mx = s.max(-1, keepdims=True)
                mx = np.where(np.isfinite(mx), mx, 0)
                p = np.exp(s - mx)
                den = p.sum(-1, keepdims=True)
                o = np.einsum("qgk,kd->qgd", p, vv) / np.where(den > 0, den, 1)
                out[t0:t0 + ql, j * g:(j + 1) * g] = o
        return out.reshape(self.T, -1)

    def inputs(self):
        return (to_gpu(self.q, self.dt), self.kc, self.vc, to_gpu(self.bt, "int32"), to_gpu(self.seq, "int32"),
                to_gpu(self.cu, "int32"))


def t_attn(rows, h=16, kvh=8, d=128, bs=64, dt="bfloat16", splits=0, max_q_len=0, **kw):
    def f():
        b = Batch(rows, h, kvh, d, bs, dt, **kw)
        scale = d ** -0.5
        out = G.paged_attention(*b.inputs(), scale, max_q_len, splits)
        sync()
        ref = b.ref(scale)
        ref = q(ref, dt) if dt != "float32" else ref
        err = relerr(to_np(out), ref)
        tol = {"float32": 1e-5, "bfloat16": 1.6e-2, "float16": 2e-3}[dt]
        return err <= tol, err, tol, f"T={b.T} rows={len(rows)} blocks={b.num_blocks}"
    return f


decode_rows = [(1, 1), (1, 63), (1, 64), (1, 65), (1, 200), (1, 1000)]
mixed_rows = [(1, 130), (1, 7), (3, 70),          # decodes (one speculative-style 3-token row)
              (37, 37), (50, 150),                # prompt; chunk after a 100-token cached prefix (crosses blocks)
              (64, 64 * 3 + 5), (5, 128),         # chunked prefill; 5-token chunk at a block boundary
              (1, 0)]                             # padded row: reads nothing, outputs zeros
for dt in DTYPES:
    check(f"paged_attention decode {dt} Qwen3 (16/8, d128, bs64)", t_attn(decode_rows, dt=dt))
    check(f"paged_attention mixed decode+prefill {dt}", t_attn(mixed_rows, dt=dt))
for s in (2, 5, 16):
    check(f"paged_attention decode splits={s} bf16", t_attn(decode_rows, splits=s))


def t_attn_repeat(n=40, splits=5):
    """The split merge is done by the last block of each (token, KV head), counted in a device counter that
    the kernel itself resets: n calls in a row (eager, then inside one graph) must all match the reference."""
    def f():
        b = Batch(decode_rows, 16, 8, 128, 64, "bfloat16")
        scale = 128 ** -0.5
        ins = b.inputs()
        ref = q(b.ref(scale), "bfloat16")
        outs = [G.paged_attention(*ins, scale, 1, splits) for _ in range(n)]
        sync()
        errs = [relerr(to_np(o), ref) for o in outs]
        g = CUDAGraph()
        g.capture_begin()
        gouts = [G.paged_attention(*ins, scale, 1, splits) for _ in range(4)]
        g.capture_end()
        for _ in range(3):
            g.replay()
        sync()
        errs += [relerr(to_np(o), ref) for o in gouts]
        g.reset()
        err = max(errs)
        return err <= 1.6e-2, err, 1.6e-2, f"{n} eager calls + 3 replays of 4 captured calls, splits={splits}"
    return f


check("paged_attention decode, calls in a row share the self-resetting split counters", t_attn_repeat())


def with_options(f, **options):
    """f run with the ops library's switches `options` (gpu.set_options: attn_mma 0 CUDA cores / 1 mma.sync / 2 wgmma
    for prefill attention, decode_mma False for the CUDA-core decode kernel), the defaults restored after."""
    def g():
        G.set_options(**options)
        try:
            return f()
        finally:
            G.set_options()
    return g


# The decode kernels on more shapes: the tensor-core one (attention_decode_mma.cuh, the default for bf16 / fp16 at
# head_dim 64 / 128 over model-dtype and FP8 caches; GQA groups 1-16, head_dim 64 / 128, splits automatic and forced,
# block sizes 64, 16 and 12: not a multiple of 8, a warp's 8 keys of a chunk from several blocks), and the CUDA-core
# one it replaced (FDLITE_DECODE_MMA=0), which fp32 and head_dim 256 keep
DECODE_SHAPES = ((16, 8, 128, 64), (32, 8, 128, 64), (32, 4, 128, 16), (14, 2, 64, 16), (16, 1, 128, 64), (4, 4, 64, 64),
                 (16, 8, 128, 12))


def decode_kernel_checks(label, attend, cuda_core_rows):
    """Both decode kernels through `attend` (t_attn, or t_attn_fp8 for FP8 caches), the checks named from `label`: the
    tensor-core one on DECODE_SHAPES, the CUDA-core one at 16 / 8 and 32 / 4 heads on cuda_core_rows (the worse of
    splits automatic and 3), bf16 and fp16."""
    for dt in ("bfloat16", "float16"):
        for h, kvh, d, bs in DECODE_SHAPES:
            for s in (0, 3):
                check(f"{label} tensor-core decode {dt} {h}/{kvh} heads d{d} bs{bs} splits={s or 'auto'}",
                      attend(decode_rows + [(1, 0)], h=h, kvh=kvh, d=d, bs=bs, dt=dt, splits=s))
        for h, kvh in ((16, 8), (32, 4)):
            check(f"{label} CUDA-core decode {dt} {h}/{kvh} heads splits=auto / 3",
                  with_options(lambda h=h, kvh=kvh, dt=dt: min(
                      (attend(cuda_core_rows, h=h, kvh=kvh, dt=dt, splits=s)() for s in (0, 3)),
                      key=lambda res: res[0]), decode_mma=False))


decode_kernel_checks("paged_attention", t_attn, decode_rows + [(1, 0)])
for dt in ("bfloat16", "float16"):
    check(f"paged_attention tensor-core decode {dt} mixed decode+prefill 32/4 heads", t_attn(mixed_rows, h=32, kvh=4, dt=dt))
check("paged_attention mixed, splits=4, max_q_len=64 bf16", t_attn(mixed_rows, splits=4, max_q_len=64))


def t_attn_tail(rows, tail, max_q_len=0, h=16, kvh=8, d=128, dt="bfloat16", splits=0):
    """`tail` tokens past the last row (a captured size's padding: q has T + tail rows, cu ends at T): their outputs
    are zeros, written into NaN-seeded memory, the rows' outputs as usual; max_q_len 1-4 sets the per-token grid's
    slots per row (a row's tokens past it would be missed: every row here respects it)."""
    def f():
        b = Batch(rows, h, kvh, d, 64, dt)
        scale = d ** -0.5
        ins = list(b.inputs())
        ins[0] = to_gpu(np.concatenate([b.q, q(rng.standard_normal((tail, h, d)), dt)]), dt)
        out = to_np(G.paged_attention(*ins, scale, max_q_len, splits))
        sync()
        ref = np.concatenate([q(b.ref(scale), dt), np.zeros((tail, h * d))])
        err = relerr(out, ref)
        tail_zero = bool(np.all(out[b.T:] == 0))
        return err <= 1.6e-2 and tail_zero, err, 1.6e-2, f"T={b.T}+{tail} tail zeros={tail_zero} max_q_len={max_q_len}"
    return f


check("paged_attention padding tokens past the rows: zeros (decode rows, max_q_len=1)",
      t_attn_tail([(1, 40), (1, 300), (1, 1)], 5, max_q_len=1))
check("paged_attention padding tokens past the rows: zeros (2- and 3-token rows, max_q_len=3, splits=3)",
      t_attn_tail([(3, 70), (2, 9), (1, 130), (3, 3)], 9, max_q_len=3, splits=3))
check("paged_attention padding tokens past the rows: zeros (mixed rows, every slot of a 4-token row used)",
      t_attn_tail([(4, 200), (4, 4), (50, 150), (1, 7)], 300, h=32, kvh=4))
check("paged_attention padding tokens past the rows: zeros (prefill rows only)",
      t_attn_tail([(100, 100), (37, 300)], 64))
check("paged_attention decode-only graph attrs (max_q_len=1) + scratch-block padded rows",
      t_attn([(1, 100), (1, 1), (1, 1)], max_q_len=1, scratch_rows=(1, 2)))
# Steps with prefill rows take the per-token kernels' compact grid: one-token rows only (rows of 2-4 tokens go to the
# tile kernel), the leading ones split by a count the blocks derive from how many there are, later ones unsplit
long_decodes = [(1, c) for c in (1500, 900, 2040, 64, 65, 1, 300, 1999, 1024, 700)]
check("paged_attention compact grid: 10 long decode rows split + prefill rows + 50 empty rows + padding tokens "
      "(a mixed graph's layout), 32/4 heads",
      t_attn_tail(long_decodes + [(300, 500), (129, 129)] + [(0, 0)] * 50, 5, h=32, kvh=4))
check("paged_attention compact grid: one-token rows after a prefill row (unsplit) and a 4-token row",
      t_attn([(1, 2000), (50, 150), (1, 900), (1, 5), (4, 4), (1, 1), (2, 300)]))
check("paged_attention compact grid: 150 leading decode rows (no split) + a prefill row",
      t_attn([(1, 300 + 7 * i) for i in range(150)] + [(200, 200)]))
check("paged_attention compact grid, CUDA-core decode kernel: long decode rows split + prefill, 32/4 heads",
      with_options(t_attn(long_decodes + [(300, 500)], h=32, kvh=4), decode_mma=False))
for sk in (64, 0):  # the length rule cutting long rows finer (64 keys: up to 4 splits a row), and off
    check(f"paged_attention decode-only step, split_keys={sk}: long and short rows (max_q_len=1), 32/4 heads",
          with_options(t_attn(long_decodes + [(1, 0), (1, 3000)], h=32, kvh=4, max_q_len=1), decode_split_keys=sk))
    check(f"paged_attention decode-only step, split_keys={sk}, CUDA-core kernel: long and short rows",
          with_options(t_attn(long_decodes, max_q_len=1), decode_split_keys=sk, decode_mma=False))
check("paged_attention compact grid, forced splits=7: long decode rows + prefill + empty rows",
      t_attn(long_decodes + [(300, 500)] + [(0, 0)] * 9, h=32, kvh=4, splits=7))
# The tensor-core decode kernel forms a warp's 8 rows of a chunk from one block-table entry when the block size is a
# multiple of 8, from one per key otherwise (12); the CUDA-core one a chunk's 32 rows from one entry when it is a
# multiple of 32 (ChunkBlock), from one per key otherwise (ChunkRows): all, at block edges, splits and row ends
edge_decodes = long_decodes + [(1, 31), (1, 33), (1, 95), (1, 129)]
for bs_ in (12, 16, 32, 48, 64, 128):
    check(f"paged_attention decode-only step, block size {bs_}: rows across block edges, split and not (max_q_len=1)",
          t_attn(edge_decodes, bs=bs_, max_q_len=1))
    check(f"paged_attention decode-only step, block size {bs_}, CUDA-core kernel",
          with_options(t_attn(edge_decodes, bs=bs_, max_q_len=1), decode_mma=False))
check("paged_attention bs16 d64 14/2 heads (g=7) mixed bf16", t_attn(mixed_rows, h=14, kvh=2, d=64, bs=16))
check("paged_attention d256 8/1 heads (g=8) mixed fp32", t_attn(mixed_rows[:5], h=8, kvh=1, d=256, bs=32, dt="float32"))
check("paged_attention MHA (g=1) d128 decode+prefill fp16", t_attn([(1, 90), (20, 80)], h=4, kvh=4, dt="float16"))
check("paged_attention g=16 (16/1 heads) decode splits=3", t_attn(decode_rows[:4], h=16, kvh=1, splits=3))
if not ARGS.quick:
    check("paged_attention long decode 4096 + prefill 1000 after 3000 cached, bf16",
          t_attn([(1, 4096), (1, 2500), (1000, 4000)]))

# The tensor-core tile kernels (bf16 / fp16 at head_dim 64 / 128): odd lengths, every block and chunk edge
# (16 / 32 / 64 keys, 128-row tiles), cached prefixes, GQA ratios 1-8 (and 3: tiles of 42 tokens); the default
# (wgmma on the H100) in full, mma.sync (FDLITE_ATTN_MMA=1) on a subset.
mma_rows = [(5, 5), (17, 17), (63, 64), (64, 64), (65, 65), (127, 127), (129, 300), (200, 1000), (1, 40), (6, 6)]


for dt in ("bfloat16", "float16"):
    for d, bs in ((64, 16), (128, 64)):
        for h, kvh in ((8, 8), (16, 8), (12, 4), (16, 4), (32, 4)):
            check(f"paged_attention tensor-core tiles {dt} d{d} bs{bs} {h}/{kvh} heads (g={h // kvh})",
                  t_attn(mma_rows, h=h, kvh=kvh, d=d, bs=bs, dt=dt))
            if (h, kvh) in ((16, 8), (12, 4)):
                check(f"paged_attention mma.sync tiles {dt} d{d} bs{bs} {h}/{kvh} heads (g={h // kvh})",
                      with_options(t_attn(mma_rows, h=h, kvh=kvh, d=d, bs=bs, dt=dt), attn_mma=1))


def fp8_caches(b):
    """The Batch's K / V quantized per (slot, KV head) on the host as FP8 caches (`Fp8Cache`'s data and scale); the
    Batch's per-row K / V become the dequantized contents (value x scale), which its reference reads. Unwritten slots
    hold NaN bits (0x7F) and NaN scales: a kernel that reads one fails."""
    caches = []
    for arr, per_row in ((b.k_np, b.K), (b.v_np, b.V)):
        bits, scale = fp8_quantize(np.nan_to_num(arr, nan=0.0))
        written = ~np.isnan(arr).any(-1)
        bits[~written] = 0x7F
        scale[~written] = np.nan
        caches.append(types.SimpleNamespace(data=to_gpu(bits, "uint8"), scale=to_gpu(scale, "float32")))
        deq = (e4m3_decode(bits) * scale[..., None]).astype(np.float32)
        for r, (_, kv) in enumerate(b.rows):
            p = np.arange(kv)
            per_row[r] = deq[b.bt[r, p // b.bs], :, p % b.bs]
    return caches


def t_attn_fp8(rows, h=16, kvh=8, d=128, bs=64, dt="bfloat16", splits=0, max_q_len=0, v_mag=1.0):
    """Attention over FP8 caches (`fp8_caches`); the reference reads them back as value x scale. v_mag scales V
    before it is quantized (its scales with it: amax / 448)."""
    def f():
        b = Batch(rows, h, kvh, d, bs, dt)
        b.v_np = (b.v_np * np.float32(v_mag)).astype(np.float32)
        caches = fp8_caches(b)
        scale_ = d ** -0.5
        ins = b.inputs()
        out = G.paged_attention_fp8(ins[0], caches[0], caches[1], *ins[3:], scale_, max_q_len, splits)
        sync()
        ref = q(b.ref(scale_), dt)
        err = relerr(to_np(out), ref)
        tol = {"bfloat16": 1.6e-2, "float16": 4e-3}[dt]
        return err <= tol, err, tol, f"T={b.T} rows={len(rows)}"
    return f


for dt in ("bfloat16", "float16"):
    check(f"paged_attention_fp8 decode {dt} (16/8, d128, bs64)", t_attn_fp8(decode_rows, dt=dt))
    check(f"paged_attention_fp8 mixed decode+prefill {dt}", t_attn_fp8(mixed_rows, dt=dt))
    check(f"paged_attention_fp8 tensor-core tiles {dt} d64 bs16 12/4 heads", t_attn_fp8(mma_rows, h=12, kvh=4, d=64, bs=16, dt=dt))
    check(f"paged_attention_fp8 tensor-core tiles {dt} d128 bs64 32/4 heads", t_attn_fp8(mma_rows, h=32, kvh=4, dt=dt))
    # the tiles above run on wgmma (the default on the H100); the mma.sync kernel keeps FP8 for FDLITE_ATTN_MMA=1
    for d_, bs_, h_, kvh_ in ((64, 16, 12, 4), (128, 64, 32, 4)):
        check(f"paged_attention_fp8 tensor-core tiles {dt} d{d_} bs{bs_} {h_}/{kvh_} heads, mma.sync kernel",
              with_options(t_attn_fp8(mma_rows, h=h_, kvh=kvh_, d=d_, bs=bs_, dt=dt), attn_mma=1))
check("paged_attention_fp8 tensor-core tiles bf16 d128 bs12 16/8 heads (a table entry per key)",
      t_attn_fp8(mma_rows, bs=12))
check("paged_attention_fp8 decode splits=5 bf16", t_attn_fp8(decode_rows, splits=5))
for bs_ in (12, 16, 48, 64):  # a warp's 8 keys from one block-table entry (16, 48, 64) or one per key (12)
    check(f"paged_attention_fp8 decode-only step, block size {bs_}: rows across block edges, split and not",
          t_attn_fp8(edge_decodes, bs=bs_, max_q_len=1))
# The decode kernels over FP8 caches (the tensor-core one widens e4m3 into fragment registers, fp16 MMAs)
decode_kernel_checks("paged_attention_fp8", t_attn_fp8, decode_rows)
check("paged_attention_fp8 decode-only step, block size 12, CUDA-core kernel",
      with_options(t_attn_fp8(edge_decodes, bs=12, max_q_len=1), decode_mma=False))
check("paged_attention_fp8 mixed splits=3 max_q_len=64 bf16", t_attn_fp8(mixed_rows, splits=3, max_q_len=64))
# Small V (scales ~1e-5 - 1e-4), long rows, both decode kernels, bf16 / fp16 queries: P x V scale alone falls below
# fp16's normal range (the tensor-core kernel forms P x (scale x 2^8)). The error gained is in docs/benchmarks.md
# ("Small V over FP8 caches"): the form before passed these too (the tolerance is relative to the largest output),
# so they guard the path, not the gain.
for dt in ("bfloat16", "float16"):
    for vm in (0.05, 0.005):
        check(f"paged_attention_fp8 tensor-core decode {dt} small V (x{vm}) long rows",
              t_attn_fp8(long_decodes, dt=dt, max_q_len=1, v_mag=vm))
        check(f"paged_attention_fp8 CUDA-core decode {dt} small V (x{vm}) long rows",
              with_options(t_attn_fp8(long_decodes, dt=dt, max_q_len=1, v_mag=vm), decode_mma=False))
check("paged_attention_fp8 compact grid: long decode rows split + prefill + empty rows, 32/4 heads",
      t_attn_fp8(long_decodes + [(300, 500)] + [(0, 0)] * 20, h=32, kvh=4))


def t_attn_row_invariance(dt="bfloat16", d=128, h=16, kvh=8):
    """A prefill row's output is bit-identical alone and inside a batch (other rows before it shift its
    tokens across tile boundaries; the rows around it have other lengths)."""
    def f():
        rows = [(1, 50), (37, 37), (300, 700), (1, 9), (9, 100), (130, 130)]
        b = Batch(rows, h, kvh, d, 64, dt)
        scale = d ** -0.5
        ins = b.inputs()
        full = to_np(G.paged_attention(*ins, scale, 0, 0))
        worst = 0.0
        for r, (ql, kv) in enumerate(rows):
            if ql <= 4:
                continue
            t0 = int(b.cu[r])
            alone = G.paged_attention(to_gpu(b.q[t0:t0 + ql], dt), b.kc, b.vc, to_gpu(b.bt[r:r + 1], "int32"),
                                      to_gpu(b.seq[r:r + 1], "int32"), to_gpu(np.array([0, ql], np.int32), "int32"),
                                      scale, 0, 0)
            diff = np.abs(to_np(alone) - full[t0:t0 + ql])
            worst = max(worst, float(np.nanmax(diff)) if diff.size else 0.0)
        return worst == 0.0, worst, 0.0, f"{sum(ql > 4 for ql, _ in rows)} prefill rows alone vs in a batch of {len(rows)}"
    return f


for dt in ("bfloat16", "float16"):
    check(f"paged_attention tensor-core tiles: a prefill row alone = in a batch, bitwise ({dt})",
          t_attn_row_invariance(dt))
check("paged_attention tensor-core tiles: a prefill row alone = in a batch, bitwise (d64, g=4)",
      t_attn_row_invariance(d=64, h=16, kvh=4))
check("paged_attention mma.sync tiles: a prefill row alone = in a batch, bitwise (bfloat16)",
      with_options(t_attn_row_invariance("bfloat16"), attn_mma=1))


def t_attn_graph_eq(rows, size, decode, max_rows=8, max_blocks=64, h=4, kvh=2, d=128, bs=16, dt="bfloat16",
                    fp8=False):
    """Graphs = eager, bitwise: one step in the engine's eager layout (its rows, block tables as wide as its longest
    row, T unpadded) and in the layout of the graph it replays in (ForwardBuffers.write_padded / graph_views: a decode
    graph pads rows to `size`, each a token reading the scratch block; a mixed graph pads rows to max_rows, empty, and
    tokens to `size`; tables max_blocks wide, scratch-filled), both with the attrs the engine passes for that graph
    (graph_attention: max_q_len 1 / 0, graph_tokens = size; max_kv_len = max_blocks x bs). The real tokens' outputs
    must be the same bits (and match the reference). Defaults: the e2e graphs_equal_eager case's model (4/2 heads,
    d128) and engine (block_size 16, max_model_len 1024, max_num_seqs 8). The detail also counts the tokens that differ
    when the eager call passes what it passed before (its own max_q_len, neither graph_tokens nor max_kv_len)."""
    def f():
        b = Batch(rows, h, kvh, d, bs, dt, max_blocks=max_blocks)
        sb, B, T = b.num_blocks, len(rows), b.T  # the scratch block (NaN in Batch): finite, as the engine's
        for arr in (b.k_np, b.v_np):
            arr[sb] = q(rng.standard_normal(arr[sb].shape), dt)
        assert size >= T and (not decode or (size >= B and all(ql == 1 for ql, _ in rows)))
        if fp8:
            kc, vc = fp8_caches(b)
            attend = G.paged_attention_fp8
        else:
            kc, vc = to_gpu(b.k_np, dt), to_gpu(b.v_np, dt)
            attend = G.paged_attention
        nb = [max(1, -(-kv // bs)) for _, kv in rows]
        pad = size - B if decode else max_rows - B
        bt_g = np.full((B + pad, max_blocks), sb, np.int32)
        for r in range(B):
            bt_g[r, :nb[r]] = b.bt[r, :nb[r]]
        if decode:  # padded rows: one token each at position 0, KV length 1
            seq_g = np.concatenate([b.seq, np.ones(pad, np.int32)])
            cu_g = np.concatenate([b.cu, T + 1 + np.arange(pad)]).astype(np.int32)
        else:  # padded rows hold no tokens; padded tokens belong to no row
            seq_g = np.concatenate([b.seq, np.zeros(pad, np.int32)])
            cu_g = np.concatenate([b.cu, np.full(pad, T)]).astype(np.int32)
        q_g = np.concatenate([b.q, q(rng.standard_normal((size - T, h, d)), dt)])
        scale = d ** -0.5

        def run(qa, bt, seq, cu, max_q_len, graph_tokens, max_kv_len):
            out = attend(to_gpu(qa, dt), kc, vc, to_gpu(bt, "int32"), to_gpu(seq, "int32"), to_gpu(cu, "int32"), scale,
                         max_q_len, 0, graph_tokens, max_kv_len)
            return np.ascontiguousarray(to_np(out)[:T], np.float32)

        plan = (1 if decode else 0, size, max_blocks * bs)
        eager = run(b.q, b.bt[:, :max(nb)], b.seq, b.cu, *plan)
        graph = run(q_g, bt_g, seq_g, cu_g, *plan)
        before = run(b.q, b.bt[:, :max(nb)], b.seq, b.cu, max(ql for ql, _ in rows), 0, 0)
        sync()
        same = np.array_equal(eager.view(np.uint32), graph.view(np.uint32))
        err = relerr(eager, q(b.ref(scale), dt))
        tol = 1.6e-2
        differed = int((before.view(np.uint32) != graph.view(np.uint32)).any(axis=1).sum())
        return same and err <= tol, err, tol, (f"T={T} rows={B} -> graph {size} ({'decode' if decode else 'mixed'}, "
                                               f"{B + pad} rows, tables {max_blocks}); bitwise equal={same}; tokens "
                                               f"differing with the former eager attrs: {differed}")
    return f


# A decode step of 3 rows replays the decode graph of 4; mixed steps: decodes beside a prompt's last 2-token chunk
# (eagerly its own max_q_len 2 had sent every row to the per-token kernel), beside prompts and chunks, and a decode
# step planned as a mixed graph (cudagraph_only_prefill, or more rows than the largest decode graph)
graph_eq_decode = [(1, 300), (1, 47), (1, 129)]
graph_eq_short_chunk = [(1, 700), (1, 90), (1, 5), (2, 2)]
graph_eq_mixed = [(1, 1000), (1, 33), (1, 260), (37, 37), (50, 150), (3, 3)]
for fp8 in (False, True):
    cache = "FP8 cache" if fp8 else "bf16 cache"
    check(f"paged_attention graphs = eager, bitwise: decode 3 rows in the graph of 4, {cache}",
          t_attn_graph_eq(graph_eq_decode, 4, True, fp8=fp8))
    check(f"paged_attention graphs = eager, bitwise: decode 7 rows in the graph of 8, 16/8 heads bs64, {cache}",
          t_attn_graph_eq([(1, 64 * k + 9) for k in range(7)], 8, True, max_rows=256, max_blocks=32, h=16, kvh=8,
                          bs=64, fp8=fp8))
    check(f"paged_attention graphs = eager, bitwise: decodes + a 2-token last chunk in the mixed graph of 16, {cache}",
          t_attn_graph_eq(graph_eq_short_chunk, 16, False, fp8=fp8))
    check(f"paged_attention graphs = eager, bitwise: decodes + prompts + chunks in the mixed graph of 128, {cache}",
          t_attn_graph_eq(graph_eq_mixed, 128, False, max_rows=64, fp8=fp8))
    check(f"paged_attention graphs = eager, bitwise: a decode step in the mixed graph of 16, {cache}",
          t_attn_graph_eq(graph_eq_decode, 16, False, fp8=fp8))
check("paged_attention graphs = eager, bitwise: decode 3 rows in the graph of 4, CUDA-core decode kernel",
      with_options(t_attn_graph_eq(graph_eq_decode, 4, True), decode_mma=False))
save()

# ================================================================== (f) logits, argmax, sampling
log("\n=== (f) LM-head logits, argmax, sampling")
poison()


SAMPLE_CHUNK = 8192  # ops_sampling.cu's kChunk: the vocabulary entries a chunk block reads (edge cases below)


def t_argmax(S, V):
    def f():
        x = rng.standard_normal((S, V)).astype(np.float32)
        x[3, 100] = x[3, min(5000, V - 1)] = 50.0  # ties: first index wins
        x[4, :] = -np.inf
        x[5, 7] = np.nan
        x[5, 9] = 60.0
        x[6, V - 1] = x[6, V // 2] = 70.0  # ties in different chunks
        x[7, min(SAMPLE_CHUNK - 1, V - 2)] = x[7, min(SAMPLE_CHUNK, V - 1)] = 80.0  # either side of the first chunk edge
        got = to_np(G.argmax(to_gpu(x, "float32")))
        ref = np.argmax(np.where(np.isnan(x), -np.inf, x), axis=1)
        ok = np.array_equal(got, ref)
        return ok, 0.0 if ok else math.inf, 0, f"S={S} V={V} ties/-inf/NaN rows included"
    return f


check("argmax [33,151936] float32", t_argmax(33, 151936))
check("argmax [9,24581] float32 (V % 4 != 0: single-float loads; a short last chunk)", t_argmax(9, 3 * SAMPLE_CHUNK + 5))
check("argmax [9,1000] float32 (one chunk, mostly past the row's end)", t_argmax(9, 1000))


def t_uniform():
    n = 4096
    seeds = rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64)
    pos = rng.integers(0, 1 << 40, n)
    ok = True
    for rnd in (0, 1, 7):
        got = to_np(G.uniform(to_gpu(seeds, "int64"), to_gpu(pos, "int64"), rnd))
        ok &= np.array_equal(got, noise.uniforms(seeds, pos, rnd, np.float32))
    return bool(ok), 0.0 if ok else math.inf, 0, "bit-exact vs fdlite.sample.random.uniforms(float32) for rounds 0, 1, 7"


check("uniform (counter-based noise) GPU == numpy", t_uniform)


def t_sample(S, V, peaky=3.0, plain=False):
    """plain: no top-k / top-p (the rows drawn from chunk masses), greedy and min-p rows among them."""
    def f():
        x = (rng.standard_normal((S, V)) * peaky).astype(np.float32)
        temp = rng.choice([0.0, 0.5, 0.7, 1.0, 1.3], S).astype(np.float32)
        topk = rng.choice([0] if plain else [0, 1, 5, 50, 1000], S).astype(np.int32)
        topp = rng.choice([1.0] if plain else [1.0, 0.9, 0.5, 0.99], S).astype(np.float32)
        minp = rng.choice([0.0, 0.0, 0.05, 0.2], S).astype(np.float32)
        seeds = rng.integers(0, 2**63 - 1, S, dtype=np.int64)
        pos = rng.integers(0, 5000, S)
        got = to_np(G.sample(to_gpu(x, "float32"), to_gpu(temp, "float32"), to_gpu(topk, "int32"),
                             to_gpu(topp, "float32"), to_gpu(minp, "float32"), to_gpu(seeds, "int64"),
                             to_gpu(pos, "int64")))
        exact = boundary = bad = 0
        for s in range(S):
            tok, det = sampling_ref.sample_row(x[s], temp[s], topk[s], topp[s], minp[s], seeds[s], pos[s], detail=True)
            if got[s] == tok:
                exact += 1
            elif det is not None and det["kept"][got[s]]:
                # a neighbour of the reference draw (expf last-bit differences move the boundary)
                c = det["cum"].astype(np.float64)
                near = abs(c[min(tok, got[s])] - det["target"]) <= 1e-6 * det["z"]
                boundary += int(near)
                bad += int(not near)
            else:
                bad += 1
        ok = bad == 0 and exact >= 0.99 * S
        return ok, bad / S, 0, f"{exact}/{S} identical to sampling_ref, {boundary} at a boundary, {bad} wrong"
    return f


check("sample [256,151936] mixed greedy/temperature/top-k/top-p/min-p vs numpy reference", t_sample(256, 151936))
check("sample [64,1000] flat logits (many ties)", t_sample(64, 1000, peaky=0.01))
check("sample [256,151936] temperature / min-p rows only (chunk masses) vs numpy reference",
      t_sample(256, 151936, plain=True))
check("sample [64,24581] temperature / min-p rows only, V % 4 != 0 (single-float loads)",
      t_sample(64, 3 * SAMPLE_CHUNK + 5, peaky=0.3, plain=True))


# ------------------------------------------------------------------ logits processors (ops_logits.cu)
def t_penalties(R, S, V):
    """Bit-exact against the CPU sampler's own numpy code (fdlite.sample.sampler.apply_penalties)."""
    def f():
        from fdlite.sample.sampler import SamplingBatch, apply_penalties

        x = (rng.standard_normal((R, V)) * 3).astype(np.float32)
        rows = np.sort(rng.choice(R, size=max(1, R // 2), replace=False)).astype(np.int64)
        slots = rng.choice(S, size=len(rows), replace=False).astype(np.int64)
        counts = np.zeros((S, V), np.float32)
        prompt = np.zeros((S, V), np.uint8)
        for s in range(S):
            np.add.at(counts[s], rng.integers(0, V, 40), 1.0)
            prompt[s, rng.integers(0, V, 300)] = 1
        P = len(rows)
        rep = rng.choice([1.0, 1.05, 1.3, 2.0, 0.8], P).astype(np.float32)
        freq = rng.choice([0.0, 0.5, -0.7, 2.0], P).astype(np.float32)
        pres = rng.choice([0.0, 1.5, -1.0], P).astype(np.float32)
        want = x.copy()
        b = SamplingBatch(temperature=np.zeros(R, np.float32), top_k=np.zeros(R, np.int64), top_p=np.ones(R, np.float32),
                          min_p=np.zeros(R, np.float32), seeds=np.zeros(R, np.uint64), positions=np.zeros(R, np.int64),
                          num_logprobs=np.full(R, -1, np.int64), penalty_rows=rows, repetition_penalty=rep,
                          frequency_penalty=freq, presence_penalty=pres, output_counts=counts[slots],
                          prompt_seen=prompt[slots].astype(bool))
        want[rows] = apply_penalties(x[rows], b)
        g = to_gpu(x, "float32")
        G.apply_penalties_(g, to_gpu(rows, "int64"), to_gpu(slots, "int64"), to_gpu(counts, "float32"),
                           to_gpu(prompt, "uint8"), to_gpu(rep, "float32"), to_gpu(freq, "float32"), to_gpu(pres, "float32"))
        got = to_np(g)
        diff = int(np.sum(got.view(np.uint32) != want.view(np.uint32)))
        return diff == 0, float(diff), 0, f"R={R} P={P} S={S} V={V}: {diff} elements differ in any bit"
    return f


def t_scatter():
    V, N = 151936, 9
    base = rng.standard_normal((N, V)).astype(np.float32)
    rows = rng.integers(0, N, 500).astype(np.int64)
    cols = rng.integers(0, V, 500).astype(np.int64)
    cols[:50] = cols[50:100]  # repeated positions must add up
    rows[:50] = rows[50:100]
    vals = rng.standard_normal(500).astype(np.float32)
    g = to_gpu(base, "float32")
    G.scatter_(g, to_gpu(rows, "int64"), to_gpu(cols, "int64"), to_gpu(vals, "float32"), add=True)
    want = base.astype(np.float64)
    np.add.at(want, (rows, cols), vals.astype(np.float64))
    err_add = float(np.max(np.abs(to_np(g) - want)))
    u = to_gpu(np.zeros((N, V), np.uint8), "uint8")
    G.scatter_(u, to_gpu(rows, "int64"), to_gpu(cols, "int64"), to_gpu(np.ones(500, np.float32), "float32"))
    mark = np.zeros((N, V), np.uint8)
    mark[rows, cols] = 1
    s = to_gpu(base, "float32")
    G.scatter_(s, to_gpu(rows[50:], "int64"), to_gpu(cols[50:], "int64"), to_gpu(np.full(450, -np.inf, np.float32), "float32"))
    banned = base.copy()
    banned[rows[50:], cols[50:]] = -np.inf
    ok = err_add < 1e-5 and np.array_equal(to_np(u), mark) and np.array_equal(to_np(s), banned)
    return ok, err_add, 1e-5, "float32 add with repeats, uint8 set, -inf set"


def t_bitmask(C, V):
    def f():
        from fdlite.sample.sampler import apply_token_bitmask

        R = C + 3
        x = rng.standard_normal((R, V)).astype(np.float32)
        rows = np.sort(rng.choice(R, size=C, replace=False)).astype(np.int64)
        W = (V + 31) // 32
        mask = rng.integers(-2**31, 2**31 - 1, (C, W), dtype=np.int64).astype(np.int32)
        mask[0] = 0
        mask[0, W - 1] = np.array([1 << ((V - 1) % 32)], np.uint32).view(np.int32)[0]  # only the last token allowed
        want = apply_token_bitmask(x.copy(), mask, rows)
        g = to_gpu(x, "float32")
        G.apply_bitmask_(g, to_gpu(rows, "int64"), to_gpu(mask, "int32"))
        got = to_np(g)
        ok = np.array_equal(np.isneginf(got), np.isneginf(want)) and np.array_equal(got[np.isfinite(got)], want[np.isfinite(want)])
        return ok, 0.0 if ok else math.inf, 0, f"C={C} of R={R} rows, V={V}"
    return f


def t_logprobs(N, V, k, ties=False):
    """Against fdlite.sample.logprobs.compute_logprobs (float64 log-sum-exp): values within 2e-5, ranks and top-k
    ids equal (ties to the lower id); a row's record is the same alone and in the batch; time per call."""
    def f():
        from fdlite.sample.logprobs import compute_logprobs, unpack

        x = (rng.standard_normal((N, V)) * 4).astype(np.float32)
        if ties:
            x[0, [3 % V, 70 % V, 900 % V, V - 1]] = 30.0  # a tie at the top
            x[1, :] = 0.0  # every token tied
        rows = np.arange(N, dtype=np.int64)[::-1].copy()  # rows out of order
        targets = rng.integers(0, V, N).astype(np.int64)
        targets[0] = 900 % V
        of = np.arange(N, dtype=np.int64)
        g = to_gpu(x, "float32")
        out = G.logprobs(g, to_gpu(rows, "int64"), to_gpu(targets, "int64"), to_gpu(of, "int64"), k)
        echoed, got = unpack(to_np(out), N, of, k)
        want = compute_logprobs(x[rows], targets, k)
        err = max(float(np.max(np.abs(got.logprobs - want.logprobs))),
                  float(np.max(np.abs(got.top_logprobs - want.top_logprobs))) if k else 0.0)
        same = (np.array_equal(echoed, targets) and np.array_equal(got.ranks, want.ranks)
                and np.array_equal(got.top_ids, want.top_ids))
        one = unpack(to_np(G.logprobs(g, to_gpu(rows[2:3], "int64"), to_gpu(targets, "int64"),
                                      to_gpu(of[2:3], "int64"), k)), N, of[2:3], k)[1]
        alone = np.array_equal(one.logprobs.view(np.int32), got.logprobs[2:3].view(np.int32)) and np.array_equal(
            one.top_ids, got.top_ids[2:3])
        args = (g, to_gpu(rows, "int64"), to_gpu(targets, "int64"), to_gpu(of, "int64"), k)
        us = graph_time_us(lambda: G.logprobs(*args)) if N >= 64 else 0.0
        return (same and alone and err < 2e-5, err, 2e-5,
                f"N={N} V={V} k={k}: ranks/ids equal={same}, row alone bit-equal={alone}, {us:.1f} us per call")
    return f


check("logprobs [256,151936] k=20 vs the CPU reference", t_logprobs(256, 151936, 20))
check("logprobs [64,151936] k=5", t_logprobs(64, 151936, 5))
check("logprobs [7,1001] k=0 and k=1, ties", t_logprobs(7, 1001, 0, ties=True))
check("logprobs [7,1001] k=1, ties", t_logprobs(7, 1001, 1, ties=True))
check("logprobs [9,50] k=20 (ties, vocabulary near k)", t_logprobs(9, 50, 20, ties=True))
check("apply_penalties_ [64,151936] == the CPU sampler's numpy, bit for bit", t_penalties(64, 32, 151936))
check("apply_penalties_ [5,1001] odd vocabulary", t_penalties(5, 5, 1001))
check("scatter_ (add with repeats, uint8 marks, -inf bans)", t_scatter)
check("apply_bitmask_ [32,151936] == the CPU sampler's numpy", t_bitmask(32, 151936))
check("apply_bitmask_ [3,1001] odd vocabulary", t_bitmask(3, 1001))


def t_sample_dist():
    V, S = 50, 20000
    row = (rng.standard_normal(V) * 2).astype(np.float32)
    x = np.tile(row, (S, 1))
    temp, k, p, mp = 0.8, 20, 0.9, 0.02
    got = to_np(G.sample(to_gpu(x, "float32"), to_gpu(np.full(S, temp, np.float32), "float32"),
                         to_gpu(np.full(S, k, np.int32), "int32"), to_gpu(np.full(S, p, np.float32), "float32"),
                         to_gpu(np.full(S, mp, np.float32), "float32"), to_gpu(np.full(S, 42, np.int64), "int64"),
                         to_gpu(np.arange(S, dtype=np.int64), "int64")))
    xs = row / np.float32(temp)
    thr = sampling_ref.threshold(xs, k, p, mp)
    kept = xs >= thr
    pr = np.where(kept, np.exp(xs.astype(np.float64) - xs.max()), 0)
    pr /= pr.sum()
    freq = np.bincount(got, minlength=V) / S
    tv = 0.5 * np.abs(freq - pr).sum()
    outside = int((~kept[got]).sum())
    ok = tv < 0.02 and outside == 0
    return ok, tv, 0.02, f"total variation over {S} draws (positions 0..{S - 1}); {int(kept.sum())} kept; {outside} outside"


check("sample distribution (one row, 20000 positions) matches the filtered softmax", t_sample_dist)


def t_lm_head():
    T, H, V = 40, 1024, 151936
    hid = q(rng.standard_normal((T, H)), "bfloat16")
    emb = q(rng.standard_normal((V, H)) * 0.02, "bfloat16")
    rows = np.array([3, 17, 39], np.int64)
    out = G.lm_head_logits(to_gpu(hid, "bfloat16"), to_gpu(rows, "int64"), to_gpu(emb, "bfloat16"), trans_w=True)
    sync()
    ref = hid[rows].astype(np.float64) @ emb.T.astype(np.float64)
    err = relerr(to_np(out), ref)
    return err <= 2e-3, err, 2e-3, f"{out.dtype} {list(out.shape)}"


check("lm_head_logits (gather 3 of 40 rows + tied head, float32 out)", t_lm_head)
save()

# ================================================================== graphs: a whole decoder layer + sampling
log("\n=== CUDA graph: one Qwen3-shaped decoder layer + LM head + sampling, inputs rewritten between replays")


def t_graph_layer2(dt, B=8, out_in=False):
    """Eager vs graph on identical inputs: every step's inputs are drawn first, then fed to both.
    out_in: weights stored [out, in] as fdlite's GPU Linear holds them (with B <= 4: the decode GEMV,
    launched with PDL and reading its weights before the previous kernel ends)."""
    def f():
        H, h, kvh, d, I, V = 1024, 16, 8, 128, 3072, 4096
        bs, nb, max_blocks, live = 16, 64, 8, max(1, B - 2)
        pad = B - live
        lin = (lambda x, w: G.linear(x, w, trans_w=True, static_w=True)) if out_in else (lambda x, w: G.linear(x, w))
        t_ = (lambda s_: s_[::-1]) if out_in else (lambda s_: s_)
        eps, scale = 1e-6, d ** -0.5
        W = {n: to_gpu(q(rng.standard_normal(s) * sc + mu, dt), dt) for n, s, sc, mu in (
            ("emb", (V, H), 0.5, 0), ("ln1", (H,), 0.1, 1), ("qkv", t_((H, (h + 2 * kvh) * d)), 0.03, 0),
            ("qn", (d,), 0.1, 1), ("kn", (d,), 0.1, 1), ("o", t_((h * d, H)), 0.03, 0), ("ln2", (H,), 0.1, 1),
            ("gu", t_((H, 2 * I)), 0.03, 0), ("down", t_((I, H)), 0.03, 0), ("lnf", (H,), 0.1, 1))}
        cos, sin = rope_tables(d, 512)
        cos_g, sin_g = to_gpu(cos, "float32"), to_gpu(sin, "float32")
        hist_k = q(rng.standard_normal((nb + 1, kvh, bs, d)), dt)
        hist_v = q(rng.standard_normal((nb + 1, kvh, bs, d)), dt)
        kc0, vc0 = to_gpu(hist_k, dt), to_gpu(hist_v, dt)
        kc, vc = to_gpu(hist_k, dt), to_gpu(hist_v, dt)
        bufs = {"ids": empty([B], "int64"), "pos": empty([B], "int64"), "slots": empty([B], "int64"),
                "bt": empty([B, max_blocks], "int32"), "seq": empty([B], "int32"), "cu": empty([B + 1], "int32"),
                "rows": empty([B], "int64"), "temp": empty([B], "float32"), "tk": empty([B], "int32"),
                "tp": empty([B], "float32"), "mp": empty([B], "float32"), "seeds": empty([B], "int64")}
        blk = rng.permutation(nb)[: live * max_blocks].reshape(live, max_blocks).astype(np.int32)
        kv0 = rng.integers(3, 100, live)
        steps = []
        for step in range(4):
            kvl = kv0 + step
            bt_n = np.full((B, max_blocks), nb, np.int32)
            bt_n[:live] = blk
            steps.append(dict(
                ids=rng.integers(0, V, B).astype(np.int64),
                pos=np.concatenate([kvl - 1, [0] * pad]).astype(np.int64),
                slots=np.concatenate([blk[np.arange(live), (kvl - 1) // bs].astype(np.int64) * bs + (kvl - 1) % bs,
                                      [-1] * pad]).astype(np.int64),
                bt=bt_n, seq=np.concatenate([kvl, [0] * pad]).astype(np.int32), cu=np.arange(B + 1, dtype=np.int32),
                rows=rng.permutation(B).astype(np.int64), temp=rng.choice([0.0, 0.8], B).astype(np.float32),
                tk=np.full(B, 50, np.int32), tp=np.full(B, 0.9, np.float32), mp=np.zeros(B, np.float32),
                seeds=rng.integers(0, 2**62, B).astype(np.int64)))

        def write(vals):
            for n, tns in bufs.items():
                G.copy_(tns, host(vals[n], str(tns.dtype).replace("paddle.", "")))

        def forward():
            b = bufs
            x = G.embedding(b["ids"], W["emb"])
            res = empty([B, H], dt)
            G.copy_(res, x)
            hsn = G.rms_norm(x, W["ln1"], eps)
            qq = G.rope_qk_norm_cache(lin(hsn, W["qkv"]), b["pos"], b["slots"], cos_g, sin_g, kc, vc, h,
                                      W["qn"], W["kn"], eps)
            att = G.paged_attention(qq, kc, vc, b["bt"], b["seq"], b["cu"], scale, 1, 0)
            o = lin(att, W["o"])
            G.fused_add_rms_norm_(o, res, W["ln2"], eps)
            mlp = lin(G.silu_and_mul(lin(o, W["gu"])), W["down"])
            G.fused_add_rms_norm_(mlp, res, W["lnf"], eps)
            logits = G.lm_head_logits(mlp, b["rows"], W["emb"], trans_w=True, static_w=out_in)
            return logits, G.argmax(logits), G.sample(logits, b["temp"], b["tk"], b["tp"], b["mp"], b["seeds"], b["pos"])

        eager = []
        for vals in steps:
            write(vals)
            outs = forward()
            sync()
            eager.append([to_np(o) for o in outs])
        G.copy_(kc, kc0)
        G.copy_(vc, vc0)
        write(steps[0])
        sync()
        poison(1.0)
        g = CUDAGraph()
        g.capture_begin()
        outs = forward()
        g.capture_end()
        G.copy_(kc, kc0)  # capture ran nothing; reset anyway
        G.copy_(vc, vc0)
        errs, tok_same = [], True
        for i, vals in enumerate(steps):
            write(vals)
            g.replay()
            sync()
            got = [to_np(o) for o in outs]
            errs.append(relerr(got[0], eager[i][0]))
            tok_same &= bool(np.array_equal(got[1], eager[i][1]) and np.array_equal(got[2], eager[i][2]))
        finite = all(np.isfinite(e[0]).all() for e in eager)
        g.reset()
        err = max(errs)
        ok = err <= 1e-6 and tok_same and finite
        return ok, err, 1e-6, (f"{len(steps)} replays vs eager on the same inputs: logits max rel diff {err:.1e}, "
                               f"argmax+sample tokens identical: {tok_same}; eager logits finite: {finite}")
    return f


for dt in ("bfloat16", "float32"):
    check(f"graph: decoder layer + LM head + argmax/sample, {dt}, 4 replays with new inputs", t_graph_layer2(dt))
    for B in (1, 3):
        check(f"graph: decoder layer, [out, in] weights (GEMV + PDL), batch {B}, {dt}, 4 replays with new inputs",
              t_graph_layer2(dt, B, out_in=True))


def t_graph_prefill_attention():
    """One capture of a mixed batch (T = 31 tokens, 4 rows); replays with other contents of the same
    shapes: new queries, and a different split of the 31 tokens over the rows (other q_len, kv_len,
    block tables), as the runner's persistent buffers would hold them."""
    layouts = [[(1, 50), (20, 120), (1, 0), (9, 9)], [(10, 10), (1, 200), (19, 60), (1, 1)],
               [(28, 300), (1, 33), (1, 64), (1, 65)]]
    batches = [Batch(r, 16, 8, 128, 64, "bfloat16", num_blocks=16, max_blocks=6) for r in layouts]
    first = batches[0]
    qg, kc, vc, btg, seqg, cug = first.inputs()
    scale = 128 ** -0.5
    G.paged_attention(qg, kc, vc, btg, seqg, cug, scale, 0, 0)
    sync()
    g = CUDAGraph()
    g.capture_begin()
    out = G.paged_attention(qg, kc, vc, btg, seqg, cug, scale, 0, 0)
    g.capture_end()
    errs = []
    for b in batches[1:] + batches[:1]:
        for dst, src in ((qg, to_gpu(b.q, "bfloat16")), (kc, b.kc), (vc, b.vc), (btg, to_gpu(b.bt, "int32")),
                         (seqg, to_gpu(b.seq, "int32")), (cug, to_gpu(b.cu, "int32"))):
            G.copy_(dst, src)
        g.replay()
        sync()
        errs.append(relerr(to_np(out), q(b.ref(scale), "bfloat16")))
    g.reset()
    err = max(errs)
    return err <= 1.6e-2, err, 1.6e-2, f"3 row layouts of 31 tokens through one graph: errors {[f'{e:.1e}' for e in errs]}"


def t_graph_basic():
    n = 1 << 16
    x = empty([n], "float32")
    y = empty([n], "bfloat16")
    z = empty([n], "int64")
    src = paddle.to_tensor(np.zeros(n, np.int64)).pin_memory() if hasattr(paddle.Tensor, "pin_memory") else None
    g = CUDAGraph()
    G.fill_(x, 1.0)
    sync()
    g.capture_begin()
    G.fill_(x, 2.5)
    G.cast_(y, x)
    if src is not None:
        G.copy_(z, src)
    g.capture_end()
    ok = True
    for i in range(3):
        G.fill_(x, 0.0)
        G.fill_(y, 0.0)
        if src is not None:
            src.copy_(paddle.to_tensor(np.full(n, i + 7, np.int64), place=CPU), True)
        g.replay()
        sync()
        ok &= bool(np.all(to_np(x) == 2.5) and np.all(to_np(y) == 2.5))
        if src is not None:
            ok &= bool(np.all(to_np(z) == i + 7))
    g.reset()
    return ok, 0.0 if ok else math.inf, 0, f"fill_/cast_{' + copy_ from pinned host' if src is not None else ''} replayed 3x"


check("graph: fill_, cast_, copy_ from pinned host memory", t_graph_basic)

# ================================================================== mixture of experts (ops_moe*.cu)
log("\n=== mixture of experts: route, align, grouped expert GEMMs")
import ops_harness_moe  # noqa: E402 - tools/gpu/ is this script's folder

ops_harness_moe.checks(sys.modules[__name__])
save()
n_fail = sum(c["status"] != "pass" for c in RES["checks"])
log(f"\nCHECKS: {len(RES['checks'])} run, {n_fail} not passing ({time.time() - T0:.0f} s)")

# ================================================================== benchmarks
if not ARGS.no_bench:
    log("\n=== benchmarks (GPU time per call from graph replays, median)")
    B_ = RES["bench"]
    HBM = 3.0e12

    def bench_attn_decode(batches=(1, 16, 64, 128, 256), splits_list=(0,), fp8=False, heads=(16, 8),
                          ctxs=(512, 2048, 4096), kernels=(None,), split_keys=(None,)):
        """Decode attention GB/s against the KV bytes read; splits_list: num_splits values (0 = automatic); fp8: over
        FP8 caches (e4m3 bytes + a float32 scale per row: head_dim + 4 bytes a vector); heads: (query, KV) heads
        (Qwen3-0.6B's by default); kernels: FDLITE_DECODE_MMA values to time side by side (None: the default);
        split_keys: FDLITE_DECODE_SPLIT_KEYS values (None: the default). A ctx
        of "mixed" gives the rows lengths drawn from 100-2,048 (the nano-vllm protocol's prompts plus outputs), the
        bytes summed over them."""
        out = []
        (h, kvh), d, bs = heads, 128, 64
        for ctx in ctxs:
            for B in batches:
                if ctx == "mixed":
                    lens = np.random.default_rng(B).integers(100, 2049, B).astype(np.int32)
                else:
                    lens = np.full(B, ctx, np.int32)
                nbrs = [-(-int(L) // bs) for L in lens]
                ws = int(lens.sum()) * kvh * (d + 4 if fp8 else d * 2) * 2
                sets = max(1, min(8, math.ceil(256e6 / ws)))  # rotate past the 50 MB L2
                per_set = sum(nbrs)
                nb = sets * per_set
                if fp8:  # 0x30 = 0.5 in e4m3, scales 0.02 / 0.04
                    kc, vc = (types.SimpleNamespace(data=empty([nb + 1, kvh, bs, d], "uint8"),
                                                    scale=empty([nb + 1, kvh, bs], "float32")) for _ in range(2))
                    for c_, v_ in ((kc, 0.02), (vc, 0.04)):
                        G.fill_(c_.data, 0x30)
                        G.fill_(c_.scale, v_)
                else:
                    kc = empty([nb + 1, kvh, bs, d], "bfloat16")
                    vc = empty([nb + 1, kvh, bs, d], "bfloat16")
                    G.fill_(kc, 0.01)
                    G.fill_(vc, 0.02)
                attend = G.paged_attention_fp8 if fp8 else G.paged_attention
                perm = rng.permutation(nb).astype(np.int32)
                width = max(max(nbrs), 4096 // bs)  # the engine's tables are max_model_len wide (the split choice sees it)
                bts = []
                for i in range(sets):
                    tab = np.zeros((B, width), np.int32)
                    o = i * per_set
                    for r, n_ in enumerate(nbrs):
                        tab[r, :n_] = perm[o:o + n_]
                        o += n_
                    bts.append(to_gpu(tab, "int32"))
                seq = to_gpu(lens, "int32")
                cu = to_gpu(np.arange(B + 1, dtype=np.int32), "int32")
                qg = to_gpu(rng.standard_normal((B, h, d)), "bfloat16")
                for splits in splits_list:
                    for kern in kernels:
                        for sk in split_keys:
                            i = [0]

                            def fn():
                                attend(qg, kc, vc, bts[i[0] % sets], seq, cu, d ** -0.5, 1, splits)
                                i[0] += 1
                            if kern is not None or sk is not None:
                                G.set_options(decode_mma=kern, decode_split_keys=sk)
                            try:
                                us = graph_time_us(fn, per_graph=8 * sets if sets < 4 else sets * 2, replays=5)
                            finally:
                                G.set_options()
                            gbs = ws / (us * 1e-6) / 1e9
                            row = {"heads": [h, kvh], "batch": B, "ctx": ctx, "num_splits": splits,
                                   "decode_mma": "default" if kern is None else int(kern),
                                   "split_keys": "default" if sk is None else sk, "us": round(us, 2),
                                   "kv_MB": round(ws / 1e6, 2), "GB_s": round(gbs), "roofline_us": round(ws / HBM * 1e6, 2),
                                   "frac_of_3TBs": round(gbs * 1e9 / HBM, 3)}
                            out.append(row)
                            log(f"  decode attn{' fp8' if fp8 else ''} {h}/{kvh} heads B={B:4d} ctx={ctx!s:>5} "
                                f"splits={splits or 'auto'} decode_mma={row['decode_mma']} split_keys={row['split_keys']}: "
                                f"{us:9.2f} us  {gbs:7.0f} GB/s  ({row['frac_of_3TBs']:.0%} of 3.0 TB/s)")
                del kc, vc
        return out

    def bench_attn_prefill():
        """Causal prefill attention, the three tile kernels side by side (FDLITE_ATTN_MMA=2 wgmma, 1 mma.sync, 0 CUDA
        cores), in TFLOP/s of the causal FLOPs (4 h d per (query, visible key) pair); batches of 1k-2k prompts also
        over FP8 caches (the two tensor-core kernels)."""
        out = []
        cases = [("Qwen3-0.6B layer", 16, 8, 128, [(2048, 2048)]),
                 ("Qwen3-0.6B layer", 16, 8, 128, [(2048, 2048)] * 8),
                 ("Llama-3.1-8B layer", 32, 8, 128, [(2048, 2048)] * 4),
                 ("Qwen3-0.6B layer", 16, 8, 128, [(512, 512)] * 4),
                 ("Qwen3-0.6B layer", 16, 8, 128, [(512, 2048)] * 4),
                 ("Qwen3-0.6B layer, 1k prompts", 16, 8, 128, [(1024, 1024)] * 8),
                 ("d64 (16/16 heads)", 16, 16, 64, [(2048, 2048)] * 4)]
        try:
            for name, h, kvh, d, rows in cases:
                b = Batch(rows, h, kvh, d, 64, "bfloat16", extra_blocks=0)
                ins = b.inputs()
                flops = sum(4 * h * d * sum(min(kv, kv - ql + i + 1) for i in range(ql)) for ql, kv in rows)
                row = {"case": name, "h": h, "kvh": kvh, "d": d, "rows": [list(r) for r in rows]}
                for mode, key in ((2, "wgmma"), (1, "mma_sync"), (0, "cuda_cores")):
                    G.set_options(attn_mma=mode)
                    us = graph_time_us(lambda: G.paged_attention(*ins, d ** -0.5, 0, 0), per_graph=5, replays=5)
                    row[key] = {"us": round(us, 1), "TFLOP_s": round(flops / us / 1e6, 1)}
                keys = ["wgmma", "mma_sync", "cuda_cores"]
                if len(rows) > 1 and rows[0][0] >= 1024:  # the same over FP8 caches (tensor-core kernels only)
                    kc8, vc8 = fp8_caches(b)
                    for mode, key in ((2, "fp8_wgmma"), (1, "fp8_mma_sync")):
                        G.set_options(attn_mma=mode)
                        us = graph_time_us(lambda: G.paged_attention_fp8(ins[0], kc8, vc8, *ins[3:], d ** -0.5, 0, 0),
                                           per_graph=5, replays=5)
                        row[key] = {"us": round(us, 1), "TFLOP_s": round(flops / us / 1e6, 1)}
                        keys.append(key)
                    del kc8, vc8
                out.append(row)
                log(f"  prefill attn {name} {rows[0]}x{len(rows)}: " + "; ".join(
                    f"{k} {row[k]['us']:9.1f} us {row[k]['TFLOP_s']:6.1f} TFLOP/s" for k in keys))
                del b, ins
        finally:
            G.set_options()
        return out

    def bench_gemm():
        out = []
        shapes = [("qkv", 1024, 4096, False), ("o_proj", 2048, 1024, False), ("gate_up", 1024, 6144, False),
                  ("down", 3072, 1024, False), ("lm_head_tied", 1024, 151936, True),
                  # fdlite's GPU layout: [out, in], the GEMV at M <= 4 (static_w: PDL launch)
                  ("qkv_out_in", 1024, 4096, True), ("o_proj_out_in", 2048, 1024, True),
                  ("gate_up_out_in", 1024, 6144, True), ("down_out_in", 3072, 1024, True)]
        try:
            import torch
            has_torch = torch.cuda.is_available()
        except Exception:  # noqa: BLE001
            has_torch = False
        for name, K, N, tw in shapes:
            wbytes = K * N * 2
            sets = max(1, min(8, math.ceil(256e6 / wbytes)))
            ws = [to_gpu(q(rng.standard_normal((N, K) if tw else (K, N)) * 0.02, "bfloat16"), "bfloat16") for _ in range(sets)]
            for M in (1, 16, 64, 256, 2048):
                xg = to_gpu(q(rng.standard_normal((M, K)), "bfloat16"), "bfloat16")
                i = [0]
                lm = name.startswith("lm_head")
                outbuf = empty([M, N], "float32") if lm else None

                def fn():
                    G.linear(xg, ws[i[0] % sets], None, tw, out=outbuf, static_w=True)
                    i[0] += 1
                us = graph_time_us(fn, per_graph=max(sets * 2, 8), replays=5)
                byt = wbytes + M * K * 2 + M * N * (4 if lm else 2)
                row = {"gemm": name, "M": M, "K": K, "N": N, "us": round(us, 2), "TB_s": round(byt / us / 1e6, 2),
                       "TFLOP_s": round(2 * M * K * N / us / 1e6, 1), "roofline_us": round(byt / HBM * 1e6, 2)}
                if has_torch:
                    tw_ = [torch.randn((N, K) if tw else (K, N), dtype=torch.bfloat16, device="cuda") for _ in range(sets)]
                    tx = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
                    j = [0]

                    def tfn():
                        w = tw_[j[0] % sets]
                        torch.matmul(tx, w.t() if tw else w)
                        j[0] += 1
                    tfn()
                    torch.cuda.synchronize()
                    tg = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(tg):
                        for _ in range(max(sets * 2, 8)):
                            tfn()
                    tg.replay()
                    torch.cuda.synchronize()
                    ts = []
                    for _ in range(5):
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        tg.replay()
                        e1.record()
                        torch.cuda.synchronize()
                        ts.append(e0.elapsed_time(e1) * 1e3 / max(sets * 2, 8))
                    row["torch_us"] = round(float(np.median(ts)), 2)
                    del tg, tw_
                out.append(row)
                log(f"  linear {name:12s} M={M:5d}: {us:8.2f} us {row['TB_s']:5.2f} TB/s {row['TFLOP_s']:6.1f} TFLOP/s"
                    f" (roofline {row['roofline_us']} us; torch {row.get('torch_us', '-')} us)")
        return out

    def bench_small():
        # the elementwise ops at Qwen3-0.6B's sizes (rope + q/k norm + cache write: bench_rope)
        out = []
        for T in (1, 256, 2048, 8192):
            x = to_gpu(rng.standard_normal((T, 1024)), "bfloat16")
            r = to_gpu(rng.standard_normal((T, 1024)), "bfloat16")
            w = to_gpu(np.ones(1024), "bfloat16")
            gu = to_gpu(rng.standard_normal((T, 6144)), "bfloat16")
            ids = to_gpu(rng.integers(0, 151936, T), "int64")
            emb = empty([151936, 1024], "bfloat16")
            for name, fn, byt in (
                ("rms_norm", lambda: G.rms_norm(x, w, 1e-6), T * 1024 * 4),
                ("fused_add_rms_norm_", lambda: G.fused_add_rms_norm_(x, r, w, 1e-6), T * 1024 * 8),
                ("silu_and_mul", lambda: G.silu_and_mul(gu), T * 6144 * 3),
                ("embedding", lambda: G.embedding(ids, emb), T * 1024 * 4),
            ):
                us = graph_time_us(fn, per_graph=50, replays=5)
                row = {"op": name, "T": T, "us": round(us, 2), "GB_s": round(byt / us / 1e3)}
                out.append(row)
                log(f"  {name:24s} T={T:5d}: {us:7.2f} us {row['GB_s']:6d} GB/s")
        return out

    def bench_rope():
        # rope + q/k norm + cache write at decode and prefill sizes (head_dim 128, block size 64): Qwen3-0.6B's heads
        # (16 / 8) into a bf16 and an FP8 cache (e4m3 bytes and a scale per cache row), Qwen3-30B-A3B's (32 / 4) into
        # a bf16 one; bytes: qkv read, q and the cache rows written (the cos / sin rows not counted)
        out = []
        for T in (1, 16, 64, 128, 256, 511, 2048, 8192):
            slots_n = max(64 * 64, T)
            pos = to_gpu(rng.integers(0, 4096, T), "int64")
            sl = to_gpu(rng.permutation(slots_n)[:T].astype(np.int64), "int64")
            cs = to_gpu(np.ones((4096, 128)), "float32")
            qn = to_gpu(np.ones(128), "bfloat16")
            cases = []
            for h, kvh in ((16, 8), (32, 4)):
                qkv = to_gpu(rng.standard_normal((T, (h + 2 * kvh) * 128)), "bfloat16")
                shape = [slots_n // 64 + 1, kvh, 64, 128]
                kc, vc = empty(shape, "bfloat16"), empty(shape, "bfloat16")
                tag = "" if h == 16 else f" {h}/{kvh}"
                cases.append((f"rope_qk_norm_cache{tag}",
                               lambda qkv=qkv, kc=kc, vc=vc, h=h: G.rope_qk_norm_cache(qkv, pos, sl, cs, cs, kc, vc, h,
                                                                                      qn, qn, 1e-6),
                               T * 2 * ((h + 2 * kvh) * 128 + h * 128 + 2 * kvh * 128)))
                if h == 16:
                    k8, v8 = (types.SimpleNamespace(data=empty(shape, "uint8"), scale=empty(shape[:3], "float32"))
                              for _ in range(2))
                    cases.append(("rope_qk_norm_cache_fp8",
                                  lambda qkv=qkv, k8=k8, v8=v8: G.rope_qk_norm_cache_fp8(qkv, pos, sl, cs, cs, k8, v8, 16,
                                                                                         qn, qn, 1e-6),
                                  T * (2 * 4096 + 2 * 16 * 128 + 2 * 8 * (128 + 4))))
            for name, fn, byt in cases:
                us = graph_time_us(fn, per_graph=50, replays=5)
                row = {"op": name, "T": T, "us": round(us, 2), "GB_s": round(byt / us / 1e3)}
                out.append(row)
                log(f"  {name:24s} T={T:5d}: {us:7.2f} us {row['GB_s']:6d} GB/s")
        return out

    def bench_sampling():
        out = []
        V = 151936
        for S in (1, 64, 128, 256):
            x = to_gpu(rng.standard_normal((S, V)) * 3, "float32")
            args = [to_gpu(np.full(S, 0.8, np.float32), "float32"), to_gpu(np.full(S, 50, np.int32), "int32"),
                    to_gpu(np.full(S, 0.9, np.float32), "float32"), to_gpu(np.full(S, 0.0, np.float32), "float32"),
                    to_gpu(np.arange(S, dtype=np.int64), "int64"), to_gpu(np.arange(S, dtype=np.int64), "int64")]
            nok = [args[0], to_gpu(np.zeros(S, np.int32), "int32"), args[2], args[3], args[4], args[5]]
            plain = [args[0], nok[1], to_gpu(np.ones(S, np.float32), "float32"), args[3], args[4], args[5]]
            for name, fn in (("argmax", lambda: G.argmax(x)),
                             ("sample temperature=0.8 only", lambda: G.sample(x, *plain)),
                             ("sample top_k=50 top_p=0.9", lambda: G.sample(x, *args)),
                             ("sample top_p=0.9 only", lambda: G.sample(x, *nok))):
                us = graph_time_us(fn, per_graph=10, replays=5)
                out.append({"op": name, "S": S, "V": V, "us": round(us, 1)})
                log(f"  {name:26s} S={S:4d}: {us:8.1f} us")
        return out

    def bench_host():
        x = to_gpu(rng.standard_normal((1, 1024)), "bfloat16")
        w = to_gpu(np.ones(1024), "bfloat16")
        r = to_gpu(rng.standard_normal((1, 1024)), "bfloat16")
        return {"rms_norm eager wall us/call": round(eager_us(lambda: G.rms_norm(x, w, 1e-6)), 1),
                "fused_add_rms_norm_ eager wall us/call": round(eager_us(lambda: G.fused_add_rms_norm_(x, r, w, 1e-6)), 1),
                "rms_norm graph replay us/call": round(graph_time_us(lambda: G.rms_norm(x, w, 1e-6), 200, 5), 2)}

    def bench_attn_mixed():
        """The op in a mixed step as its graph runs it (rows padded to max_num_seqs = 256 with empty rows, max_q_len 0):
        a few long decode rows beside 8k prefill tokens (the MoE prefill-heavy job's steps), and a churn job's step
        (200 decode rows + one prompt); each also without its decode rows, so the difference is what they cost."""
        out = []
        dec10 = [(1, 1100 + 94 * i) for i in range(10)]
        cases = [("Qwen3-30B-A3B layer, 10 decodes + 8k prefill", 32, 4, dec10, [(2045, 2045)] * 4),
                 ("Llama-3.1-8B layer, 10 decodes + 8k prefill", 32, 8, dec10, [(2045, 2045)] * 4),
                 ("Qwen3-0.6B layer, churn: 200 decodes + a prompt", 16, 8, [(1, 300 + 5 * i) for i in range(200)],
                  [(600, 600)])]
        for name, h, kvh, dec, pre in cases:
            row = {"case": name, "h": h, "kvh": kvh}
            for key, rows in (("with_decodes", dec + pre), ("prefill_only", pre)):
                b = Batch(rows + [(0, 0)] * (256 - len(rows)), h, kvh, 128, 64, "bfloat16", extra_blocks=0,
                          max_blocks=2048 // 64)
                ins = b.inputs()
                us = graph_time_us(lambda: G.paged_attention(*ins, 128 ** -0.5, 0, 0), per_graph=5, replays=5)
                row[key] = {"us": round(us, 1), "T": b.T}
                del b, ins
            row["decode_rows_us"] = round(row["with_decodes"]["us"] - row["prefill_only"]["us"], 1)
            out.append(row)
            log(f"  mixed-step attn {name}: {row['with_decodes']['us']:9.1f} us, without the decode rows "
                f"{row['prefill_only']['us']:9.1f} us: the decode rows {row['decode_rows_us']:7.1f} us")
        return out

    benches = (("attention_decode", bench_attn_decode), ("attention_prefill", bench_attn_prefill),
               ("attention_mixed", bench_attn_mixed),
               ("attention_decode_splits", lambda: bench_attn_decode((64, 128, 192, 256), (0, 1, 2, 3, 4, 5, 6, 8))),
               # small batches, where the automatic count fills the GPU with splits (32 at batch 1)
               ("attention_decode_splits_small", lambda: bench_attn_decode((1, 4, 16), (0, 1, 2, 4, 8, 16, 32))
                + bench_attn_decode((1, 4, 16), (0, 4, 8, 16, 32), fp8=True)),
               ("attention_decode_fp8", lambda: bench_attn_decode(fp8=True)),
               # rows of protocol-like lengths (100-2,048 keys): what the decode graphs of the protocol meet
               ("attention_decode_mixed", lambda: bench_attn_decode((64, 128, 256), ctxs=("mixed",))),
               ("attention_decode_fp8_mixed", lambda: bench_attn_decode((64, 128, 256), ctxs=("mixed",), fp8=True)),
               # the length rule's target (FDLITE_DECODE_SPLIT_KEYS; 0 = every row the shapes' split count)
               ("attention_decode_split_keys", lambda: bench_attn_decode((1, 64, 128, 256), ctxs=(512, 2048, "mixed"),
                                                                         split_keys=(0, 256, 512, 1024))),
               # the same over FP8 caches, where a split holds twice the option's keys (the same bytes as a bf16
               # cache's): 0 / 512 / 1,024 / 2,048 keys
               ("attention_decode_fp8_split_keys",
                lambda: bench_attn_decode((1, 64, 128, 256), ctxs=(512, 2048, "mixed"), split_keys=(0, 256, 512, 1024),
                                          fp8=True)),
               # GQA groups of 2, 4 and 8 query heads per KV head (Qwen3-0.6B, Llama-3.1-8B, Qwen3-30B-A3B layers):
               # the CUDA-core per-token kernel's work per KV byte grows with the group; the tensor-core one
               # (the default) beside it
               ("attention_decode_gqa", lambda: sum((bench_attn_decode((1, 64, 128, 256), heads=hd, ctxs=(512, 2048),
                                                                       kernels=(False, True))
                                                     for hd in ((16, 8), (32, 8), (32, 4))), [])),
               ("gemm", bench_gemm), ("elementwise", bench_small), ("rope", bench_rope), ("sampling", bench_sampling),
               ("host_overhead", bench_host),
               ("moe_route", lambda: ops_harness_moe.bench_route(sys.modules[__name__])),
               ("moe_decode", lambda: ops_harness_moe.bench_decode(sys.modules[__name__])),
               ("moe_prefill", lambda: ops_harness_moe.bench_prefill(sys.modules[__name__])))
    for name, fn in benches:
        if (ARGS.only and name not in ARGS.only.split(",")) or (
                not ARGS.only and name in ("attention_decode_splits", "attention_decode_splits_small",
                                           "attention_decode_split_keys",
                                 "attention_decode_fp8_split_keys")):
            continue
        try:
            B_[name] = fn()
        except Exception as e:  # noqa: BLE001
            B_[name] = f"ERROR {type(e).__name__}: {e}"
            traceback.print_exc()
        save()
        paddle.device.cuda.empty_cache()

RES["info"]["total_s"] = round(time.time() - T0, 1)
save()
log("\nSUMMARY")
for c in RES["checks"]:
    if c["status"] != "pass":
        log(f"  {c['status']}: {c['name']}: {c['detail']}")
log(f"{len(RES['checks'])} checks, {n_fail} not passing; total {RES['info']['total_s']} s")
