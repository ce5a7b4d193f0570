"""Paged attention over a flat batch that mixes decodes and prefills, in plain Paddle ops.

On CPU with float32 (over a float32 or FP8 cache), `paged_attention` hands the attention itself to the C++ op of
`fdlite/kernels/cpu_attention.py` (it reads K/V in place through the block tables, no gather copy, one dispatch
per layer); what follows is the reference it is tested against, and the path for other dtypes, for
machines that cannot compile it, and for FDLITE_CPU_ATTENTION=reference.

Written by hand because Paddle's fused paged-attention kernels
(`paddle.incubate.nn.functional.block_multihead_attention`) are GPU-only; this version runs on CPU
and GPU alike and is the reference the fused path must match. Every step first writes the new
tokens' K/V into the cache at `slot_mapping`, then reads each row's whole context back from the
cache through its block table, so a cached prefix or an earlier prefill chunk is just more context.
The cache has FastDeploy's [blocks, kv_heads, block_size, head_dim] layout and is addressed as
flat rows of head_dim; the row indices are computed once per step and shared by all layers.

The K/V reads are numpy `take`s on zero-copy views of the cache (float32 / float16 caches): Paddle
3.3.1's CPU gather was measured 2-20x slower for these row lists (0.24 vs 0.35-4.7 ms for 41k rows of
32 floats on 2 cores), and erratic when the machine is busy.

Decode rows are batched: one gather of [rows, max_blocks * block_size] slots and a masked softmax.
Prefill rows are done one at a time with a causal mask offset by the cached prefix length; a step
holds few of them (the token budget bounds their total size). Inside a captured graph
(`meta.prefills is None`) there is no host structure to loop over: every token is its own query
row, reading its row's blocks (`token_rows`) up to its own position, so one graph serves every
split of its token count.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from fdlite.kernels import cpu_attention
from fdlite.kvcache.fp8_cache import Fp8Cache
from fdlite.layers.forward_meta import ForwardMeta


_ARANGE: dict[str, paddle.Tensor] = {}


def _arange(n: int, dtype: str) -> paddle.Tensor:
    """[0, n) as a view of a cached tensor: `paddle.arange` costs ~150 us of dispatch on CPU (four
    calls per layer per step were 0.6 ms of a batch-1 decode step); a slice costs ~10."""
    t = _ARANGE.get(dtype)
    if t is None or t.shape[0] < n:
        t = _ARANGE[dtype] = paddle.arange(max(n, 4096), dtype=dtype)
    return t[:n]


def _rows(blocks: paddle.Tensor, kvh: int, block_size: int) -> paddle.Tensor:
    """Block ids [..., nb] -> flat cache rows [..., kvh, nb * block_size]: head-major, position order.

    Row of (block b, head h, offset o) in the cache viewed as [-1, head_dim] is (b * kvh + h) * bs + o.
    """
    blocks = blocks.astype("int64")
    heads = _arange(kvh, "int64").reshape([kvh, 1, 1])
    offs = _arange(block_size, "int64")
    rows = (blocks.unsqueeze(-2).unsqueeze(-1) * kvh + heads) * block_size + offs  # [..., kvh, nb, bs]
    return rows.flatten(start_axis=-2)


def _take_rows(cache: paddle.Tensor, rows: paddle.Tensor) -> paddle.Tensor:
    """cache viewed as [-1, head_dim], rows `rows` (int64, on the host) -> [len(rows), head_dim]."""
    if isinstance(cache, Fp8Cache):
        return cache.read(rows)  # float32
    d = cache.shape[-1]
    if cache.dtype not in (paddle.float32, paddle.float16) or not cache.place.is_cpu_place():
        return paddle.gather(cache.reshape([-1, d]), rows)  # numpy has no bfloat16
    flat = np.from_dlpack(cache).reshape(-1, d)
    return paddle.from_dlpack(np.take(flat, np.from_dlpack(rows), axis=0))


def _memo(meta: ForwardMeta, key, make):
    if key not in meta.derived:
        meta.derived[key] = make()
    return meta.derived[key]


def write_kv(cache: paddle.Tensor, meta: ForwardMeta, values: paddle.Tensor) -> None:
    """values [T, kvh, d] -> the cache rows of each token's slot, every head."""
    t, kvh, d = values.shape
    bs = meta.block_size

    def make():
        slots = meta.slot_mapping.unsqueeze(1)  # [T, 1]
        heads = _arange(kvh, "int64").astype(slots.dtype)
        return ((slots // bs * kvh + heads) * bs + slots % bs).flatten()  # [T * kvh], (token, head) order

    rows = _memo(meta, ("write", kvh), make)
    if isinstance(cache, Fp8Cache):
        cache.write(rows, values.reshape([t * kvh, d]))
        return
    paddle.scatter_(cache.reshape([-1, d]), rows, values.reshape([t * kvh, d]).astype(cache.dtype), overwrite=True)


def _softmax_attend(q, k, v, mask, scale):
    """q [..., kvh, m, d], k/v [..., kvh, L, d], mask broadcastable to [..., kvh, m, L] -> [..., kvh, m, d].

    The query heads sharing a KV head are folded into `m` rather than broadcast against K/V: Paddle's
    CPU matmul takes a slow copying path for a broadcast operand that is not contiguous (measured 40x).
    """
    scores = paddle.matmul(q.astype("float32"), k.astype("float32"), transpose_y=True) * scale
    scores = paddle.where(mask, scores, paddle.full_like(scores, float("-inf")))
    probs = F.softmax(scores, axis=-1)
    return paddle.matmul(probs, v.astype("float32")).astype(q.dtype)


def decode_attention(q, k_cache, v_cache, meta: ForwardMeta, n: int, scale: float) -> paddle.Tensor:
    """q [n, h, d] for rows [0, n) -> [n, h, d]."""
    _, h, d = q.shape
    kvh = k_cache.shape[1]
    rows = _memo(meta, ("decode", kvh), lambda: _rows(meta.block_tables[:n], kvh, meta.block_size).flatten())
    L = rows.shape[0] // (n * kvh)
    k = _take_rows(k_cache, rows).reshape([n, kvh, L, d])
    v = _take_rows(v_cache, rows).reshape([n, kvh, L, d])
    qg = q.reshape([n, kvh, h // kvh, d])  # query head j reads KV head j // (h / kvh)
    valid = _arange(L, "int32").unsqueeze(0) < meta.seq_lens_kv[:n].unsqueeze(1)  # [n, L]
    out = _softmax_attend(qg, k, v, valid.reshape([n, 1, 1, L]), scale)
    return out.reshape([n, h, d])


def token_attention(q, k_cache, v_cache, meta: ForwardMeta, scale: float) -> paddle.Tensor:
    """Graph mode: q [T, h, d], each token attending to its row's positions <= its own -> [T, h, d]."""
    t, h, d = q.shape
    kvh = k_cache.shape[1]
    tables = _memo(meta, "token_tables", lambda: paddle.gather(meta.block_tables, meta.token_rows))  # [T, width]
    rows = _memo(meta, ("token", kvh), lambda: _rows(tables, kvh, meta.block_size).flatten())
    L = rows.shape[0] // (t * kvh)
    k = _take_rows(k_cache, rows).reshape([t, kvh, L, d])
    v = _take_rows(v_cache, rows).reshape([t, kvh, L, d])
    qg = q.reshape([t, kvh, h // kvh, d])
    valid = _arange(L, "int64").unsqueeze(0) <= meta.positions.unsqueeze(1)  # [T, L]
    out = _softmax_attend(qg, k, v, valid.reshape([t, 1, 1, L]), scale)
    return out.reshape([t, h, d])


def prefill_attention(q, k_cache, v_cache, meta: ForwardMeta, span, scale: float) -> paddle.Tensor:
    """q [q_len, h, d] of one row whose K/V are already in the cache -> [q_len, h, d]."""
    n, h, d = q.shape
    kvh = k_cache.shape[1]
    g = h // kvh
    num_blocks = -(-span.kv_len // meta.block_size)

    def make():
        return _rows(meta.block_tables[span.row, :num_blocks], kvh, meta.block_size)[:, : span.kv_len].flatten()

    rows = _memo(meta, ("prefill", span.row, kvh), make)
    k = _take_rows(k_cache, rows).reshape([kvh, span.kv_len, d])
    v = _take_rows(v_cache, rows).reshape([kvh, span.kv_len, d])
    qg = q.transpose([1, 0, 2]).reshape([kvh, g * n, d])  # rows ordered (group, position)
    # Query i sits at absolute position (kv_len - n + i) and sees keys at positions <= that.
    q_pos = _arange(span.kv_len, "int32")[span.kv_len - n :].unsqueeze(1)
    causal = _arange(span.kv_len, "int32").unsqueeze(0) <= q_pos  # [n, L]
    out = _softmax_attend(qg, k, v, paddle.tile(causal, [g, 1]), scale)  # [kvh, g * n, d]
    return out.reshape([h, n, d]).transpose([1, 0, 2])


def _use_cpp(q, k_cache) -> bool:
    """The C++ op serves float32 queries over float32 or FP8 caches on CPU; other dtypes (and machines where it
    cannot be built) use the reference."""
    # (`Fp8Cache.dtype` is an instance property: read on the class it is no dtype, and FP8 caches took the reference)
    return (q.dtype == paddle.float32 and (isinstance(k_cache, Fp8Cache) or k_cache.dtype == paddle.float32)
            and k_cache.place.is_cpu_place() and cpu_attention.available())


def paged_attention(q, k, v, k_cache, v_cache, meta: ForwardMeta, scale: float) -> paddle.Tensor:
    """q [T, h, d], k/v [T, kvh, d] for the flat batch -> attention output [T, h * d]."""
    write_kv(k_cache, meta, k)
    write_kv(v_cache, meta, v)
    if _memo(meta, "use_cpp", lambda: _use_cpp(q, k_cache)):  # same dtypes in every layer of a step
        if meta.prefills is None:  # graph mode: per-token rows and positions (see token_attention)
            return cpu_attention.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.token_rows,
                                                 meta.positions, scale, per_token=True)
        return cpu_attention.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                             meta.seq_lens_kv, scale, per_token=False)
    return reference_attention(q, k_cache, v_cache, meta, scale)


def reference_attention(q, k_cache, v_cache, meta: ForwardMeta, scale: float) -> paddle.Tensor:
    """Paddle ops over a cache that already holds this step's K/V: q [T, h, d] -> [T, h * d]."""
    if meta.prefills is None:
        out = token_attention(q, k_cache, v_cache, meta, scale)
        return out.reshape([out.shape[0], -1])
    parts = []
    if meta.num_decodes:
        parts.append(decode_attention(q[: meta.num_decodes], k_cache, v_cache, meta, meta.num_decodes, scale))
    for span in meta.prefills:
        parts.append(prefill_attention(q[span.token_start : span.token_start + span.q_len], k_cache, v_cache, meta, span, scale))
    out = parts[0] if len(parts) == 1 else paddle.concat(parts, axis=0)
    return out.reshape([out.shape[0], -1])
