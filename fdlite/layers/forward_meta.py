"""`ForwardMeta`: how one flat token batch splits into sequences and where their KV lives.

FastDeploy's name for the same idea. The runner fills it from its persistent buffers, attention
reads it. Rows are ordered decodes first (one token each), then prefills (a prompt or a chunk of
one), so the decode rows form one dense block that batched kernels (and CUDA graphs) can take whole.

The tensors are what a fused kernel needs (`cu_seqlens_q`, `seq_lens_kv`, `block_tables`,
`slot_mapping`). `prefills` is host-side detail for the CPU reference attention's per-row loop; it
is None inside a captured graph, where attention must read tensors only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle


@dataclass
class PrefillSpan:
    row: int          # index into block_tables / seq_lens
    token_start: int  # first token of this row in the flat batch
    q_len: int        # tokens computed this step
    kv_len: int       # tokens in the KV cache after this step (cached prefix + q_len)


@dataclass
class FlatBatch:
    """One step's flat token batch on the host (FastDeploy's names); the runner copies it into `ForwardMeta`'s tensors."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64: cache slot written by each token
    token_rows: np.ndarray  # [T] int64: the row of each token
    block_tables: np.ndarray  # [rows, width] int32
    seq_lens_kv: np.ndarray  # [rows] int32: KV length of each row after this step
    cu_seqlens_q: np.ndarray  # [rows + 1] int32: row r's tokens are [cu[r], cu[r + 1])
    logits_indices: np.ndarray  # [sampled rows] int64: last token of each row that samples
    num_decodes: int  # rows [0, num_decodes) compute one token each
    prefills: list[PrefillSpan] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens_kv)

    @property
    def max_q_len(self) -> int:
        """Most tokens any row computes this step (1 when every row decodes)."""
        return max([1] * (self.num_decodes > 0) + [p.q_len for p in self.prefills] or [0])


@dataclass
class ForwardMeta:
    slot_mapping: paddle.Tensor        # [tokens] int64: cache slot written by each token
    token_rows: paddle.Tensor          # [tokens] int64: row of each token
    positions: paddle.Tensor           # [tokens] int64
    block_tables: paddle.Tensor        # [rows, width] int32
    seq_lens_kv: paddle.Tensor         # [rows] int32: KV length per row after this step
    cu_seqlens_q: paddle.Tensor        # [rows + 1] int32: row r's tokens are [cu[r], cu[r + 1])
    num_decodes: int                   # rows [0, num_decodes) are single-token decodes
    block_size: int = 64
    prefills: list[PrefillSpan] | None = field(default_factory=list)  # None: graph mode (tensors only)
    # Per-layer (k_cache, v_cache), each [num_blocks + 1, kv_heads, block_size, head_dim].
    caches: list[tuple[paddle.Tensor, paddle.Tensor]] = field(default_factory=list)
    # Bound on any row's query length (1: decode only; 0: unknown, as in a prefill graph): lets the GPU
    # attention skip its query-tile kernel when every row decodes.
    max_q_len: int = 0
    # What the GPU attention plans each row's kernel and KV split count for (0: the call's own T and table width):
    # the padded size of the CUDA graph the step runs in, or would run in (eager steps plan as their graph, so graphs
    # and eager give the same bits), and a row's longest KV (the full table width of a graph).
    graph_tokens: int = 0
    max_kv_len: int = 0
    # Cache row indices derived once per step and shared by every layer (see fdlite/layers/attention.py).
    derived: dict = field(default_factory=dict, repr=False)
