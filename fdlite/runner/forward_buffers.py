"""The forward's input tensors: allocated once at the largest step, written in place every step.

Eager steps, CUDA-graph capture and replay all read these same tensors (views of their first
rows), so their addresses never change: the invariant a captured graph relies on, with no second
set of graph buffers to keep in step. On CPU the host writes straight into Paddle's memory through
zero-copy numpy views; on a GPU each used prefix is copied from the host once per step.

Graph mode (`pad_to`): shapes are fixed by the captured size, padded tokens write the scratch slot
and read the scratch row of block tables (the row after the last real one), and attention reads
tensors only (`ForwardMeta.prefills` is None).
"""

from __future__ import annotations

import numpy as np
import paddle

from fdlite.ops import device_tensors
from fdlite.ops.forward_meta import FlatBatch, ForwardMeta


class _Buffer:
    """One persistent tensor and, on CPU, a numpy view of its memory."""

    def __init__(self, size: int, dtype: str, fill: int = 0):
        self.tensor = device_tensors.full([size], fill, dtype)
        self.host = np.from_dlpack(self.tensor) if self.tensor.place.is_cpu_place() else None
        # CPU views by (length, shape): a slice costs ~10 us of Paddle dispatch, and a decode batch keeps
        # its size for many steps. Views share the buffer's memory, so a cached one sees every later write.
        self._views: dict[tuple, paddle.Tensor] = {}

    def write(self, values: np.ndarray, start: int = 0) -> None:
        if not len(values):
            return
        if self.host is not None:
            self.host[start : start + len(values)] = values
        else:
            device_tensors.write_from_host(self.tensor[start : start + len(values)], values)

    def view(self, n: int, shape: list[int] | None = None) -> paddle.Tensor:
        if self.host is None:  # GPU: not cached (that a slice is a view there is checked on CPU only)
            v = self.tensor[:n]
            return v.reshape(shape) if shape is not None else v
        key = (n, tuple(shape) if shape is not None else None)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= 64:
                self._views.clear()
            v = self.tensor[:n]
            v = self._views[key] = v.reshape(shape) if shape is not None else v
        return v


class ForwardBuffers:
    def __init__(self, max_tokens: int, max_rows: int, max_blocks: int, block_size: int):
        self.max_tokens, self.max_rows, self.max_blocks, self.block_size = max_tokens, max_rows, max_blocks, block_size
        self.input_ids = _Buffer(max_tokens, "int64")
        self.positions = _Buffer(max_tokens, "int64")
        self.slot_mapping = _Buffer(max_tokens, "int64")
        self.token_rows = _Buffer(max_tokens, "int64")
        # Row-major block tables; graph mode uses rows of max_blocks with one scratch row at the end.
        self.block_tables = _Buffer((max_rows + 1) * max_blocks, "int32")
        self.seq_lens_kv = _Buffer(max_rows, "int32")
        self.cu_seqlens_q = _Buffer(max_rows + 1, "int32")
        self.logits_indices = _Buffer(max_rows, "int64")
        self.scratch_block: int | None = None

    def tensors(self) -> dict[str, paddle.Tensor]:
        """Every persistent tensor by name (their addresses must never change)."""
        return {k: v.tensor for k, v in vars(self).items() if isinstance(v, _Buffer)}

    def set_scratch_block(self, block: int) -> None:
        """Point the graph-mode scratch row at the KV cache's scratch block (once the cache exists)."""
        self.scratch_block = block
        self.block_tables.write(np.full(self.max_blocks, block, np.int32), start=self.max_rows * self.max_blocks)

    def write(self, flat: FlatBatch, caches) -> tuple[paddle.Tensor, paddle.Tensor, ForwardMeta, paddle.Tensor]:
        """Copy `flat` into the buffers; return (input_ids, positions, meta, logits_indices) views of its size."""
        t, b = flat.num_tokens, flat.num_rows
        self._write_common(flat)
        width = flat.block_tables.shape[1]
        self.block_tables.write(flat.block_tables.reshape(-1))
        meta = ForwardMeta(
            slot_mapping=self.slot_mapping.view(t), token_rows=self.token_rows.view(t), positions=self.positions.view(t),
            block_tables=self.block_tables.view(b * width, [b, width]), seq_lens_kv=self.seq_lens_kv.view(b),
            cu_seqlens_q=self.cu_seqlens_q.view(b + 1), num_decodes=flat.num_decodes, block_size=self.block_size,
            prefills=flat.prefills, caches=caches, max_q_len=flat.max_q_len,
        )
        return self.input_ids.view(t), self.positions.view(t), meta, self.logits_indices.view(len(flat.logits_indices))

    def write_padded(self, flat: FlatBatch, size: int, decode: bool) -> None:
        """Graph mode: copy `flat` and pad it to `size` tokens (and, for decode graphs, rows).

        Padded tokens are token 0 at position 0 of the scratch row, writing the scratch slot. In a
        prefill graph they belong to no row (rows past the batch have no tokens, KV length 0). Each
        buffer is padded on the host and written once (on a GPU every write is a copy).
        """
        t, b = flat.num_tokens, flat.num_rows
        extra = max(0, size - t)
        rows = (size if decode else self.max_rows) - b
        tables = np.empty((b + max(rows, 0), self.max_blocks), np.int32)
        tables[:b, : flat.block_tables.shape[1]] = flat.block_tables
        tables[:b, flat.block_tables.shape[1] :] = self.scratch_block
        tables[b:] = self.scratch_block
        seq_lens, cu = flat.seq_lens_kv, flat.cu_seqlens_q
        if rows > 0:
            if decode:  # each padded row is one padded token
                seq_lens = np.concatenate([seq_lens, np.ones(rows, np.int32)])
                cu = np.concatenate([cu, np.arange(t + 1, size + 1, dtype=np.int32)])
            else:
                seq_lens = np.concatenate([seq_lens, np.zeros(rows, np.int32)])
                cu = np.concatenate([cu, np.full(rows, t, np.int32)])

        def pad(values: np.ndarray, fill: int) -> np.ndarray:
            return np.concatenate([values, np.full(extra, fill, values.dtype)]) if extra else values

        self.input_ids.write(pad(flat.input_ids, 0))
        self.positions.write(pad(flat.positions, 0))
        self.slot_mapping.write(pad(flat.slot_mapping, self.scratch_block * self.block_size))
        self.token_rows.write(pad(flat.token_rows, self.max_rows))
        self.seq_lens_kv.write(seq_lens)
        self.cu_seqlens_q.write(cu)
        self.logits_indices.write(flat.logits_indices)
        self.block_tables.write(tables.reshape(-1))

    def graph_views(self, size: int, decode: bool, caches) -> tuple[paddle.Tensor, paddle.Tensor, ForwardMeta]:
        """Fixed-shape views for a graph of `size` tokens: what capture binds and replay reads."""
        rows = size if decode else self.max_rows
        meta = ForwardMeta(
            slot_mapping=self.slot_mapping.view(size), token_rows=self.token_rows.view(size),
            positions=self.positions.view(size),
            block_tables=self.block_tables.view((self.max_rows + 1) * self.max_blocks, [self.max_rows + 1, self.max_blocks]),
            seq_lens_kv=self.seq_lens_kv.view(rows), cu_seqlens_q=self.cu_seqlens_q.view(rows + 1),
            num_decodes=size if decode else 0, block_size=self.block_size, prefills=None, caches=caches,
            max_q_len=1 if decode else 0,
        )
        return self.input_ids.view(size), self.positions.view(size), meta

    def logits_index_view(self, n: int) -> paddle.Tensor:
        return self.logits_indices.view(n)

    def _write_common(self, flat: FlatBatch) -> None:
        self.input_ids.write(flat.input_ids)
        self.positions.write(flat.positions)
        self.slot_mapping.write(flat.slot_mapping)
        self.token_rows.write(flat.token_rows)
        self.seq_lens_kv.write(flat.seq_lens_kv)
        self.cu_seqlens_q.write(flat.cu_seqlens_q)
        self.logits_indices.write(flat.logits_indices)
