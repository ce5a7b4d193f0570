"""The GPU path on a CPU: fdlite's GPU op wrappers (`fdlite.kernels.gpu`) replaced by numpy/Paddle-CPU
versions of their contracts, and the platform switched to "gpu".

What this tests is the wiring of the GPU path (which op the seam picks, the arguments the models pass,
the in-place contracts of the fused norm and the cache write, graph-mode views, the GPU sampler's host
round trips), not the kernels: those are checked on the device (tools/gpu/ops_harness.py). Every
emulated op writes its outputs from an independent reference, so a wrong argument shows as a wrong
token. Each call is recorded by name, so a test can assert that the CPU implementations did not run.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import paddle

import moe_ref
from fdlite.kernels import gpu as gpu_ops
from fdlite.kernels import platform
from fdlite.sample import sampling_ref

CALLS: Counter = Counter()
# What each paged_attention call's launch plan (each row's kernel and KV split count) read, in call order
# (`attention_plan_inputs`): a test compares an eager engine's with a graph engine's.
ATTENTION_PLANS: list[tuple] = []


def _np(t) -> np.ndarray:
    return np.array(t.numpy(), dtype=np.float64) if t.dtype in (paddle.float32, paddle.float64) else t.numpy()


def _assign(dst, value: np.ndarray) -> None:
    paddle.assign(paddle.to_tensor(np.ascontiguousarray(value).astype(dst.numpy().dtype)), output=dst)


def fill_(x, value):
    CALLS["fill_"] += 1
    _assign(x, np.full(x.shape, value))


def copy_(dst, src):
    CALLS["copy_"] += 1
    _assign(dst, src.numpy().reshape(dst.shape))


def copy_from_host(dst, values):
    CALLS["copy_from_host"] += 1
    assert values.size == int(np.prod(dst.shape)) and values.dtype == dst.numpy().dtype
    _assign(dst, values.reshape(dst.shape))


def add_(dst, src):
    CALLS["add_"] += 1
    _assign(dst, dst.numpy().astype(np.float32) + src.numpy().astype(np.float32))


def upload(values, dtype):
    CALLS["upload"] += 1
    return paddle.to_tensor(np.ascontiguousarray(values, dtype=dtype))


def copy_from_host_many(dst_ptrs, src_ptrs, nbytes):
    """Raw copies, as the kernel-side call does: the emulated GPU tensors are host memory."""
    import ctypes

    CALLS["copy_from_host_many"] += 1
    CALLS["copy_from_host_many_copies"] += len(dst_ptrs)
    for d, s_, n in zip(dst_ptrs, src_ptrs, nbytes):
        ctypes.memmove(d, s_, n)


def gather_rows(src, index, offset=0, out=None):
    CALLS["gather_rows"] += 1
    s, idx = src.numpy(), index.numpy().astype(np.int64) - offset
    held = (idx >= 0) & (idx < len(s))
    res = np.where(held[:, None], s[np.clip(idx, 0, len(s) - 1)].reshape(len(idx), -1), 0).reshape(len(idx), *s.shape[1:])
    t = paddle.to_tensor(res.astype(s.dtype))
    if out is not None:
        _assign(out, res)
        return out
    return t


def embedding(ids, weight, vocab_start=0, out=None):
    CALLS["embedding"] += 1
    return gather_rows(weight, ids, vocab_start, out)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rms_norm(x, weight, eps):
    CALLS["rms_norm"] += 1
    return paddle.to_tensor(_rms(_np(x), _np(weight), eps).astype(np.float32))


def fused_add_rms_norm_(x, residual, weight, eps):
    CALLS["fused_add_rms_norm_"] += 1
    r = _np(x) + _np(residual)
    _assign(residual, r)
    _assign(x, _rms(r, _np(weight), eps))


def silu_and_mul(x):
    CALLS["silu_and_mul"] += 1
    a = _np(x)
    g, u = np.split(a, 2, axis=-1)
    return paddle.to_tensor((g / (1 + np.exp(-g)) * u).astype(np.float32))


def linear(x, weight, bias=None, trans_w=False, out=None, static_w=False):
    CALLS["linear"] += 1
    w = _np(weight)
    y = _np(x) @ (w.T if trans_w else w)
    if bias is not None:
        y = y + _np(bias)
    if out is not None:
        _assign(out, y)
        return out
    return paddle.to_tensor(y.astype(np.float32))


def rope_qk_norm_cache(qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, num_heads, q_norm_weight=None,
                       k_norm_weight=None, eps=1e-6):
    CALLS["rope_qk_norm_cache"] += 1
    kvh, bs, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    a = _np(qkv).reshape(qkv.shape[0], num_heads + 2 * kvh, d)
    q, k, v = a[:, :num_heads], a[:, num_heads:num_heads + kvh], a[:, num_heads + kvh:]
    if q_norm_weight is not None:
        q, k = _rms(q, _np(q_norm_weight), eps), _rms(k, _np(k_norm_weight), eps)
    pos = positions.numpy()
    c, s = _np(cos)[pos][:, None, :], _np(sin)[pos][:, None, :]

    def rot(x):
        x1, x2 = np.split(x, 2, axis=-1)
        return x * c + np.concatenate([-x2, x1], -1) * s

    q, k = rot(q), rot(k)
    kc, vc = np.from_dlpack(k_cache), np.from_dlpack(v_cache)  # the caches, written in place
    for t, slot in enumerate(slot_mapping.numpy().tolist()):
        if slot >= 0:
            kc[slot // bs, :, slot % bs] = k[t]
            vc[slot // bs, :, slot % bs] = v[t]
    return paddle.to_tensor(q.astype(np.float32))


def rope_qk_norm_cache_fp8(qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, num_heads, q_norm_weight=None,
                           k_norm_weight=None, eps=1e-6):
    """The kernel's contract on FP8 caches: k / v written through `Fp8Cache.write` (the CPU path's quantization)."""
    CALLS["rope_qk_norm_cache_fp8"] += 1
    _, kvh, bs, d = k_cache.shape
    plain = [np.zeros([k_cache.shape[0], kvh, bs, d], np.float32) for _ in range(2)]
    kt, vt = paddle.to_tensor(plain[0]), paddle.to_tensor(plain[1])
    q = rope_qk_norm_cache(qkv, positions, slot_mapping, cos, sin, kt, vt, num_heads, q_norm_weight, k_norm_weight, eps)
    CALLS["rope_qk_norm_cache"] -= 1
    slots = slot_mapping.numpy()
    keep = np.flatnonzero(slots >= 0)
    if len(keep):
        s_ = slots[keep]
        rows = ((s_ // bs)[:, None] * kvh + np.arange(kvh)[None, :]) * bs + (s_ % bs)[:, None]  # [n, kvh]
        flat = paddle.to_tensor(rows.reshape(-1).astype(np.int64))
        for cache, src in ((k_cache, kt), (v_cache, vt)):
            cache.write(flat, paddle.to_tensor(src.numpy().reshape(-1, d)[rows.reshape(-1)]))
    return q


def paged_attention_fp8(q, k_cache, v_cache, block_tables, seq_lens_kv, cu_seqlens_q, scale, max_q_len=0,
                        num_splits=0, graph_tokens=0, max_kv_len=0):
    """The kernel's contract on FP8 caches: every row read back as value x scale (`Fp8Cache.read`)."""
    CALLS["paged_attention_fp8"] += 1
    n = int(np.prod(k_cache.shape[:3]))
    rows = paddle.to_tensor(np.arange(n, dtype=np.int64))
    kt = k_cache.read(rows).reshape(k_cache.shape)
    vt = v_cache.read(rows).reshape(v_cache.shape)
    out = paged_attention(q, kt, vt, block_tables, seq_lens_kv, cu_seqlens_q, scale, max_q_len, num_splits,
                          graph_tokens, max_kv_len)
    CALLS["paged_attention"] -= 1
    return out


def attention_plan_inputs(t, b, width, block_size, max_q_len, num_splits, graph_tokens, max_kv_len) -> tuple:
    """What the kernel's launch plan reads (ops_attention.cu, attention_impl): graph_tokens, when given, in place of
    the call's T and B, and max_kv_len in place of its table width; equal inputs, equal plans."""
    assert graph_tokens == 0 or graph_tokens >= t, "graph_tokens must be a padded size"
    shape = (graph_tokens,) if graph_tokens else (t, b)
    return max_q_len, num_splits, shape, max_kv_len or width * block_size


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens_kv, cu_seqlens_q, scale, max_q_len=0, num_splits=0,
                    graph_tokens=0, max_kv_len=0):
    CALLS["paged_attention"] += 1
    assert block_tables.shape[0] == seq_lens_kv.shape[0] and cu_seqlens_q.shape[0] == seq_lens_kv.shape[0] + 1
    ATTENTION_PLANS.append(attention_plan_inputs(q.shape[0], block_tables.shape[0], block_tables.shape[1],
                                                 k_cache.shape[2], max_q_len, num_splits, graph_tokens, max_kv_len))
    qa, kc, vc = _np(q), _np(k_cache), _np(v_cache)
    t, h, d = qa.shape
    kvh, bs = kc.shape[1], kc.shape[2]
    bt, seq, cu = block_tables.numpy(), seq_lens_kv.numpy(), cu_seqlens_q.numpy()
    out = np.zeros((t, h, d))
    for r in range(len(seq)):
        n, kv = int(cu[r + 1] - cu[r]), int(seq[r])
        if n == 0 or kv == 0:
            continue
        assert max_q_len == 0 or n <= max_q_len, "max_q_len promised a bound the batch breaks"
        p = np.arange(kv)
        keys = kc[bt[r, p // bs], :, p % bs]  # [kv, kvh, d]
        vals = vc[bt[r, p // bs], :, p % bs]
        for i in range(n):
            tok, qpos = cu[r] + i, kv - n + i
            for head in range(h):
                sc = keys[: qpos + 1, head // (h // kvh)] @ qa[tok, head] * scale
                w = np.exp(sc - sc.max())
                out[tok, head] = w @ vals[: qpos + 1, head // (h // kvh)] / w.sum()
    return paddle.to_tensor(out.reshape(t, h * d).astype(np.float32))


def lm_head_logits(hidden, rows, weight, trans_w=False, out=None, static_w=False):
    CALLS["lm_head_logits"] += 1
    return linear(gather_rows(hidden, rows), weight, None, trans_w)


def argmax(logits):
    CALLS["argmax"] += 1
    return paddle.to_tensor(logits.numpy().argmax(axis=1).astype(np.int64))


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions):
    CALLS["sample"] += 1
    x = logits.numpy()
    ids = [sampling_ref.sample_row(x[i], float(temperature[i]), int(top_k[i]), float(top_p[i]), float(min_p[i]),
                                   int(seeds[i]), int(positions[i])) for i in range(len(x))]
    return paddle.to_tensor(np.asarray(ids, np.int64))


def apply_penalties_(logits, rows, slots, counts, prompt, rep, freq, pres):
    """ops_logits.cu's rule in float32, row by row."""
    CALLS["apply_penalties_"] += 1
    x = logits.numpy().copy()
    c, seen_prompt = counts.numpy(), prompt.numpy().astype(bool)
    for p, (r, s) in enumerate(zip(rows.numpy().tolist(), slots.numpy().tolist())):
        n = c[s]
        r_, f, q = (np.float32(t.numpy()[p]) for t in (rep, freq, pres))
        v = np.where((n > 0) | seen_prompt[s], np.where(x[r] > 0, x[r] / r_, x[r] * r_), x[r]).astype(np.float32)
        x[r] = (v - f * n).astype(np.float32) - q * (n > 0).astype(np.float32)
    _assign(logits, x)


def scatter_(dst, rows, cols, values, add=False):
    CALLS["scatter_"] += 1
    x = dst.numpy().copy()
    r, c, v = rows.numpy(), cols.numpy(), values.numpy()
    if add:
        np.add.at(x, (r, c), v.astype(x.dtype))
    else:
        x[r, c] = v
    _assign(dst, x)


def apply_bitmask_(logits, rows, mask):
    CALLS["apply_bitmask_"] += 1
    x = logits.numpy().copy()
    m = mask.numpy()
    for i, r in enumerate(rows.numpy().tolist()):
        bits = np.array([(int(m[i, v // 32]) >> (v % 32)) & 1 for v in range(x.shape[1])], bool)
        x[r, ~bits] = -np.inf
    _assign(logits, x)


def logprobs(logits, rows, targets, target_of, k):
    """ops_logprobs.cu's contract, through the CPU reference (fdlite.sample.logprobs.compute_logprobs)."""
    CALLS["logprobs"] += 1
    from fdlite.sample.logprobs import compute_logprobs  # noqa: PLC0415

    x, r, t, of = logits.numpy(), rows.numpy(), targets.numpy(), target_of.numpy()
    assert 0 <= k <= 20 and len(r) and len(of) == len(r)
    res = compute_logprobs(x[r], t[of], k)
    rec = np.empty((len(r), 2 + 2 * k), np.int32)
    rec[:, 0] = res.logprobs.view(np.int32)
    rec[:, 1] = res.ranks
    rec[:, 2 : 2 + k] = res.top_ids
    rec[:, 2 + k :] = res.top_logprobs.view(np.int32)
    return paddle.to_tensor(np.concatenate([t.astype(np.int32), rec.reshape(-1)]))


def moe_route(logits, top_k, renormalize, norm_min=0.0, correction_bias=None, balanced=False):
    CALLS["moe_route"] += 1
    bias = None if correction_bias is None else _np(correction_bias).reshape(-1)
    ids, w = moe_ref.route(_np(logits), top_k, renormalize, norm_min, bias, balanced)
    return paddle.to_tensor(ids), paddle.to_tensor(w)


def moe_align(ids, num_experts, block_m=0):
    CALLS["moe_align"] += 1
    n = int(np.prod(ids.shape))
    rows, tiles = moe_ref.align(ids.numpy(), num_experts, block_m or moe_ref.block_m(n, num_experts))
    return paddle.to_tensor(rows), paddle.to_tensor(tiles)


def moe_experts(x, ids, weights, w13, w2, block_m=0, shared=None):
    """The contract of ops_moe.cu: [E, out, in] expert weights (the GPU layout), int32 ids, float32 weights; shared
    (x's shape and dtype) added before the rounding."""
    CALLS["moe_experts"] += 1
    assert ids.dtype == paddle.int32 and weights.dtype == paddle.float32
    assert w13.shape[0] == w2.shape[0] and w13.shape[2] == x.shape[1] == w2.shape[1] and w13.shape[1] == 2 * w2.shape[2]
    if shared is not None:
        CALLS["moe_experts_shared"] += 1
        assert shared.shape == x.shape and shared.dtype == x.dtype
    out = moe_ref.experts(_np(x), ids.numpy(), weights.numpy(), _np(w13), _np(w2),
                          shared=None if shared is None else _np(shared))
    return paddle.to_tensor(out.astype(np.float32))


def to_host(x):
    CALLS["to_host"] += 1
    return x.numpy()


class _Copied:
    def __init__(self, values):
        self._values = values

    def wait(self):
        return self._values


class PinnedCopies:
    """`gpu.PinnedCopies`' contract: the copy is taken at `start` (through `to_host`, so it is counted), the values
    come from `wait()`."""

    def __init__(self, depth=3):
        pass

    def start(self, x):
        return _Copied(gpu_ops.to_host(x))

    def close(self):
        pass


OPS = ("fill_", "copy_", "add_", "copy_from_host", "upload", "copy_from_host_many", "gather_rows", "embedding", "rms_norm", "fused_add_rms_norm_", "silu_and_mul", "linear",
       "rope_qk_norm_cache", "rope_qk_norm_cache_fp8", "paged_attention", "paged_attention_fp8", "lm_head_logits", "argmax", "sample", "apply_penalties_", "scatter_",
       "apply_bitmask_", "logprobs", "moe_route", "moe_align", "moe_experts", "to_host", "PinnedCopies")


def install(monkeypatch) -> Counter:
    """Switch this process to the emulated GPU path (undone by monkeypatch); returns the call counter."""
    CALLS.clear()
    ATTENTION_PLANS.clear()
    for name in OPS:
        monkeypatch.setattr(gpu_ops, name, globals()[name])
    monkeypatch.setattr(gpu_ops, "load", lambda path=None: "emulated")
    monkeypatch.setitem(platform._current, "device", "gpu")
    return CALLS


def install_engine(monkeypatch) -> Counter:
    """`install`, and an engine built next runs on the "gpu" (no CUDA memory statistics here)."""
    from fdlite.runner import model_runner  # noqa: PLC0415

    calls = install(monkeypatch)

    def select_device(requested):
        platform._current["device"] = "gpu"
        return "gpu"

    monkeypatch.setattr(model_runner, "select_device", select_device)
    monkeypatch.setattr(model_runner, "device_memory", lambda: None)
    monkeypatch.setattr(model_runner, "reset_peak_memory", lambda: None)
    return calls
