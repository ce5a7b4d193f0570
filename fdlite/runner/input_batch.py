"""Turn a scheduled batch into the flat model inputs (FastDeploy's names) and a `ForwardMeta`.

Rows are reordered decodes first, then prefills, so decode rows form one dense block. All arrays
are built with numpy on the host and copied to the device once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

from fdlite.ops.forward_meta import ForwardMeta, PrefillSpan
from fdlite.runner.sequence import Sequence


@dataclass
class HostBatch:
    """The flat batch on the host (token order = logits order); the CUDA-graph runner copies it into its buffers."""

    input_ids: np.ndarray      # [T] int64
    positions: np.ndarray      # [T] int64
    slot_mapping: np.ndarray   # [T] int64
    token_rows: np.ndarray     # [T] int64: the row (sequence) of each token
    block_tables: np.ndarray   # [rows, max_blocks] int64
    num_decodes: int           # rows [0, num_decodes) are single-token decodes

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_rows(self) -> int:
        return self.block_tables.shape[0]


@dataclass
class ModelInputs:
    input_ids: paddle.Tensor          # [tokens] int64
    positions: paddle.Tensor          # [tokens] int64
    meta: ForwardMeta
    logits_indices: paddle.Tensor     # [sampled rows] int64: last token of each row that samples
    sample_seqs: list[Sequence]       # the rows that sample a token this step, in logits order
    rows: list[tuple[Sequence, int]]  # (sequence, tokens this step) in flat-batch order
    host: HostBatch


def build_inputs(rows: list[tuple[Sequence, int]], block_size: int) -> ModelInputs:
    rows = [r for r in rows if r[1] == 1] + [r for r in rows if r[1] != 1]
    num_decodes = sum(1 for _, n in rows if n == 1)
    ids, pos, slots, q_lens, kv_lens, logits_idx, sample_seqs, prefills = [], [], [], [], [], [], [], []
    token_rows = []
    max_blocks = max(len(seq.block_table) for seq, _ in rows)
    tables = np.zeros((len(rows), max_blocks), dtype=np.int64)
    start = 0
    for r, (seq, n) in enumerate(rows):
        c = seq.num_computed_tokens
        ids.extend(seq.token_ids(c, c + n))
        p = np.arange(c, c + n, dtype=np.int64)
        pos.append(p)
        table = np.asarray(seq.block_table, dtype=np.int64)
        tables[r, : len(table)] = table
        slots.append(table[p // block_size] * block_size + p % block_size)
        q_lens.append(n)
        token_rows.append(np.full(n, r, dtype=np.int64))
        kv_lens.append(c + n)
        if n != 1:
            prefills.append(PrefillSpan(row=r, token_start=start, q_len=n, kv_len=c + n))
        if c + n == seq.num_tokens:  # caught up: the last position predicts the next token
            logits_idx.append(start + n - 1)
            sample_seqs.append(seq)
        start += n
    host = HostBatch(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=np.concatenate(pos),
        slot_mapping=np.concatenate(slots),
        token_rows=np.concatenate(token_rows),
        block_tables=tables,
        num_decodes=num_decodes,
    )
    meta = ForwardMeta(
        seq_lens_this_time=paddle.to_tensor(np.asarray(q_lens, dtype=np.int32)),
        seq_lens_kv=paddle.to_tensor(np.asarray(kv_lens, dtype=np.int32)),
        block_tables=paddle.to_tensor(tables),
        slot_mapping=paddle.to_tensor(host.slot_mapping),
        num_decodes=num_decodes,
        prefills=prefills,
        block_size=block_size,
    )
    return ModelInputs(
        input_ids=paddle.to_tensor(host.input_ids),
        positions=paddle.to_tensor(host.positions),
        meta=meta,
        logits_indices=paddle.to_tensor(np.asarray(logits_idx, dtype=np.int64)),
        sample_seqs=sample_seqs,
        rows=rows,
        host=host,
    )
