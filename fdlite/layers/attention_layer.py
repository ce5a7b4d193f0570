"""`Attention`: from the fused qkv projection to the attention output, over the paged KV cache.

One op for what a layer does between its qkv and o projections: split q/k/v, Qwen3's per-head q/k
RMSNorm, rotary embedding, the KV-cache write at `slot_mapping`, and paged attention over each row's
blocks. FastDeploy's GPU attention takes the fused qkv the same way (its `append_attention` applies
rope and writes the cache itself), because on GPU the steps fuse:

- CPU: Paddle ops, step by step, then `fdlite/layers/attention.py` (the C++ CPU attention op for float32, else the
  Paddle-op reference; it stays opaque to SOT because it reads per-step Python batch structure).
- GPU: two kernels: `rope_qk_norm_cache` (norm + rope + cache write, q out) and `paged_attention`
  (decode rows with split-KV, prefill and chunked rows with query tiles, all from tensors, so one
  captured graph serves any batch of its shape).
"""

from __future__ import annotations

import paddle

from fdlite.graph.graph_break import opaque_to_sot
from fdlite.kernels import cpu_attention
from fdlite.kernels import gpu as gpu_ops
from fdlite.layers.attention import paged_attention as _paged_attention
from fdlite.kernels.custom_op import CustomOp
from fdlite.kvcache.fp8_cache import Fp8Cache
from fdlite.layers.forward_meta import ForwardMeta
from fdlite.layers.rotary import RotaryEmbedding

# Attention reads per-step Python batch structure; SOT must not translate it (see graph_break.py).
paged_attention = opaque_to_sot(_paged_attention)


class Attention(CustomOp):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int, rotary: RotaryEmbedding,
                 q_norm=None, k_norm=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.layer_id = layer_id
        self.rotary = rotary
        # A tuple: the norms' weights belong to the model's attention layer (checkpoint names), not to this op.
        self._qk_norm = (q_norm, k_norm) if q_norm is not None else None
        if self._forward_method is type(self).forward_cpu:
            cpu_attention.load()  # build (first use on a machine) and log the CPU attention path at model build

    def forward_cpu(self, qkv: paddle.Tensor, positions: paddle.Tensor, meta: ForwardMeta) -> paddle.Tensor:
        q, k, v = paddle.split(qkv, [self.q_size, self.kv_size, self.kv_size], axis=-1)
        q = q.reshape([-1, self.num_heads, self.head_dim])
        k = k.reshape([-1, self.num_kv_heads, self.head_dim])
        v = v.reshape([-1, self.num_kv_heads, self.head_dim])
        if self._qk_norm is not None:
            q, k = self._qk_norm[0](q), self._qk_norm[1](k)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache = meta.caches[self.layer_id]
        return paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)

    def forward_gpu(self, qkv: paddle.Tensor, positions: paddle.Tensor, meta: ForwardMeta) -> paddle.Tensor:
        k_cache, v_cache = meta.caches[self.layer_id]
        qn, kn = self._qk_norm or (None, None)
        fp8 = isinstance(k_cache, Fp8Cache)  # kv_cache_dtype="fp8": e4m3 bits and a scale per row
        write = gpu_ops.rope_qk_norm_cache_fp8 if fp8 else gpu_ops.rope_qk_norm_cache
        q = write(qkv, positions, meta.slot_mapping, self.rotary.cos, self.rotary.sin, k_cache, v_cache, self.num_heads,
                  None if qn is None else qn.weight, None if kn is None else kn.weight, qn.eps if qn is not None else 1e-6)
        rows = meta.seq_lens_kv.shape[0]
        # Graph views carry a scratch row after the batch's rows (for the CPU path's per-token tables);
        # the kernel takes exactly one table row per row: a leading-rows slice is a view, no copy.
        tables = meta.block_tables if meta.block_tables.shape[0] == rows else meta.block_tables[:rows]
        attend = gpu_ops.paged_attention_fp8 if fp8 else gpu_ops.paged_attention
        return attend(q, k_cache, v_cache, tables, meta.seq_lens_kv, meta.cu_seqlens_q, self.scale,
                      max_q_len=meta.max_q_len, graph_tokens=meta.graph_tokens, max_kv_len=meta.max_kv_len)
