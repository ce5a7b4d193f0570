"""Paged attention over a flat batch that mixes decodes and prefills, in plain Paddle ops.

Written by hand because Paddle's fused paged-attention kernels
(`paddle.incubate.nn.functional.block_multihead_attention`) are GPU-only; this version runs on CPU
and GPU alike and is the reference the fused path must match. Every step first writes the new
tokens' K/V into the cache at `slot_mapping`, then reads each row's whole context back from the
cache through its block table, so a cached prefix or an earlier prefill chunk is just more context.

Decode rows are batched: one gather of [rows, max_blocks * block_size] slots and a masked softmax.
Prefill rows are done one at a time with a causal mask offset by the cached prefix length; a step
holds few of them (the token budget bounds their total size).
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from fdlite.ops.forward_meta import ForwardMeta


def write_kv(cache: paddle.Tensor, slots: paddle.Tensor, values: paddle.Tensor) -> None:
    paddle.scatter_(cache, slots, values.astype(cache.dtype), overwrite=True)


def _context_slots(block_row: paddle.Tensor, block_size: int) -> paddle.Tensor:
    """Block ids [..., n] -> slot ids [..., n * block_size] in position order."""
    offs = paddle.arange(block_size, dtype=block_row.dtype)
    return (block_row.unsqueeze(-1) * block_size + offs).flatten(start_axis=-2)


def _softmax_attend(q, k, v, mask, scale):
    """q [..., kvh, g, n, d], k/v [..., kvh, L, d], mask broadcastable to scores -> [..., kvh, g, n, d]."""
    scores = paddle.matmul(q.astype("float32"), k.astype("float32").unsqueeze(-3), transpose_y=True) * scale
    scores = paddle.where(mask, scores, paddle.full_like(scores, float("-inf")))
    probs = F.softmax(scores, axis=-1)
    return paddle.matmul(probs, v.astype("float32").unsqueeze(-3)).astype(q.dtype)


def decode_attention(q, k_cache, v_cache, meta: ForwardMeta, n: int, scale: float) -> paddle.Tensor:
    """q [n, h, d] for rows [0, n) -> [n, h, d]."""
    _, h, d = q.shape
    kvh = k_cache.shape[1]
    slots = _context_slots(meta.block_tables[:n], meta.block_size)  # [n, L]
    L = slots.shape[1]
    k = paddle.gather(k_cache, slots.flatten()).reshape([n, L, kvh, d]).transpose([0, 2, 1, 3])
    v = paddle.gather(v_cache, slots.flatten()).reshape([n, L, kvh, d]).transpose([0, 2, 1, 3])
    qg = q.reshape([n, kvh, h // kvh, 1, d])
    valid = paddle.arange(L, dtype="int32").unsqueeze(0) < meta.seq_lens_kv[:n].unsqueeze(1)  # [n, L]
    out = _softmax_attend(qg, k, v, valid.reshape([n, 1, 1, 1, L]), scale)
    return out.reshape([n, h, d])


def prefill_attention(q, k_cache, v_cache, meta: ForwardMeta, span, scale: float) -> paddle.Tensor:
    """q [q_len, h, d] of one row whose K/V are already in the cache -> [q_len, h, d]."""
    n, h, d = q.shape
    kvh = k_cache.shape[1]
    num_blocks = -(-span.kv_len // meta.block_size)
    slots = _context_slots(meta.block_tables[span.row, :num_blocks], meta.block_size)[: span.kv_len]
    k = paddle.gather(k_cache, slots).transpose([1, 0, 2])  # [kvh, L, d]
    v = paddle.gather(v_cache, slots).transpose([1, 0, 2])
    qg = q.transpose([1, 0, 2]).reshape([kvh, h // kvh, n, d])
    # Query i sits at absolute position (kv_len - n + i) and sees keys at positions <= that.
    q_pos = paddle.arange(span.kv_len - n, span.kv_len, dtype="int32").unsqueeze(1)
    causal = paddle.arange(span.kv_len, dtype="int32").unsqueeze(0) <= q_pos  # [n, L]
    out = _softmax_attend(qg, k, v, causal, scale)  # [kvh, g, n, d]
    return out.reshape([h, n, d]).transpose([1, 0, 2])


def paged_attention(q, k, v, k_cache, v_cache, meta: ForwardMeta, scale: float) -> paddle.Tensor:
    """q [T, h, d], k/v [T, kvh, d] for the flat batch -> attention output [T, h * d]."""
    write_kv(k_cache, meta.slot_mapping, k)
    write_kv(v_cache, meta.slot_mapping, v)
    parts = []
    if meta.num_decodes:
        parts.append(decode_attention(q[: meta.num_decodes], k_cache, v_cache, meta, meta.num_decodes, scale))
    for span in meta.prefills:
        parts.append(prefill_attention(q[span.token_start : span.token_start + span.q_len], k_cache, v_cache, meta, span, scale))
    out = parts[0] if len(parts) == 1 else paddle.concat(parts, axis=0)
    return out.reshape([out.shape[0], -1])
