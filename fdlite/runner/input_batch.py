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
class ModelInputs:
    input_ids: paddle.Tensor          # [tokens] int64
    positions: paddle.Tensor          # [tokens] int64
    meta: ForwardMeta
    logits_indices: paddle.Tensor     # [sampled rows] int64: last token of each row that samples
    sample_seqs: list[Sequence]       # the rows that sample a token this step, in logits order
    rows: list[tuple[Sequence, int]]  # (sequence, tokens this step) in flat-batch order


def build_inputs(rows: list[tuple[Sequence, int]], block_size: int) -> ModelInputs:
    rows = [r for r in rows if r[1] == 1] + [r for r in rows if r[1] != 1]
    num_decodes = sum(1 for _, n in rows if n == 1)
    ids, pos, slots, q_lens, kv_lens, logits_idx, sample_seqs, prefills = [], [], [], [], [], [], [], []
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
        kv_lens.append(c + n)
        if n != 1:
            prefills.append(PrefillSpan(row=r, token_start=start, q_len=n, kv_len=c + n))
        if c + n == seq.num_tokens:  # caught up: the last position predicts the next token
            logits_idx.append(start + n - 1)
            sample_seqs.append(seq)
        start += n
    meta = ForwardMeta(
        seq_lens_this_time=paddle.to_tensor(np.asarray(q_lens, dtype=np.int32)),
        seq_lens_kv=paddle.to_tensor(np.asarray(kv_lens, dtype=np.int32)),
        block_tables=paddle.to_tensor(tables),
        slot_mapping=paddle.to_tensor(np.concatenate(slots)),
        num_decodes=num_decodes,
        prefills=prefills,
        block_size=block_size,
    )
    return ModelInputs(
        input_ids=paddle.to_tensor(np.asarray(ids, dtype=np.int64)),
        positions=paddle.to_tensor(np.concatenate(pos)),
        meta=meta,
        logits_indices=paddle.to_tensor(np.asarray(logits_idx, dtype=np.int64)),
        sample_seqs=sample_seqs,
        rows=rows,
    )
