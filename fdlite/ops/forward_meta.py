"""`ForwardMeta`: how one flat token batch splits into sequences and where their KV lives.

FastDeploy's name for the same idea. The runner fills it, attention reads it. Rows are ordered
decodes first (one token each), then prefills (a prompt or a chunk of one), so the decode rows form
one dense block that batched kernels (and CUDA graphs) can take whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import paddle


@dataclass
class PrefillSpan:
    row: int          # index into block_tables / seq_lens
    token_start: int  # first token of this row in the flat batch
    q_len: int        # tokens computed this step
    kv_len: int       # tokens in the KV cache after this step (cached prefix + q_len)


@dataclass
class ForwardMeta:
    seq_lens_this_time: paddle.Tensor  # [batch] int32: query tokens per row
    seq_lens_kv: paddle.Tensor         # [batch] int32: KV length per row after this step
    block_tables: paddle.Tensor        # [batch, max_blocks] int64
    slot_mapping: paddle.Tensor        # [tokens] int64: cache slot written by each token
    num_decodes: int                   # rows [0, num_decodes) are single-token decodes
    prefills: list[PrefillSpan] = field(default_factory=list)
    block_size: int = 64
    # Per-layer (k_cache, v_cache), each [num_blocks + 1, kv_heads, block_size, head_dim]; set by the runner.
    caches: list[tuple[paddle.Tensor, paddle.Tensor]] = field(default_factory=list)
    # Cache row indices derived once per step and shared by every layer (see ops/attention.py).
    derived: dict = field(default_factory=dict, repr=False)
