"""The forward's input tensors: allocated once at the largest step, written in place every step.

Eager steps, CUDA-graph capture and replay all read these same tensors (views of their first
rows), so their addresses never change: the invariant a captured graph relies on, with no second
set of graph buffers to keep in step. On CPU the host writes straight into Paddle's memory through
zero-copy numpy views. On a GPU each buffer has a host staging array: a step fills the staging arrays
(padding included, no temporaries), then one call copies every used prefix (`_flush`: one ctypes call
that enqueues all the copies, where a wrapper call per buffer cost ~20 us of Python each at batch 1).

Graph mode (`pad_to`): shapes are fixed by the captured size, padded tokens write the scratch slot
and read the scratch row of block tables (the row after the last real one), and attention reads
tensors only (`ForwardMeta.prefills` is None). An eager step's GPU attention plans its launch (each row's kernel and
KV split count) for the graph the step would run in (`graph_attention`), so that it gives that graph's bits.
"""

from __future__ import annotations

import numpy as np
import paddle

from fdlite.kernels import device_tensors, platform
from fdlite.layers.forward_meta import FlatBatch, ForwardMeta


class _Buffer:
    """One persistent tensor and the numpy array the host writes: on CPU a view of the tensor's memory, on
    GPU a staging array whose written prefix `_flush` copies to the device."""

    def __init__(self, size: int, dtype: str, fill: int = 0):
        self.tensor = device_tensors.full([size], fill, dtype)
        self.on_gpu = platform.is_gpu()
        if self.on_gpu:
            self.host = np.full(size, fill, dtype)
            self.device_ptr = self.tensor.data_ptr()
        else:
            self.host = np.from_dlpack(self.tensor)
        self.lo, self.hi = size, 0  # GPU: elements [lo, hi) of `host` not yet copied
        # CPU views by (length, shape): a slice costs ~10 us of Paddle dispatch, and a decode batch keeps
        # its size for many steps. Views share the buffer's memory, so a cached one sees every later write.
        self._views: dict[tuple, paddle.Tensor] = {}

    def stage(self, values, start: int = 0, count: int | None = None) -> None:
        """host[start : start + count] = values (an array, or a scalar with `count`); copied by `_flush`."""
        n = len(values) if count is None else count
        if not n:
            return
        self.host[start : start + n] = values
        self.mark(start, start + n)

    def mark(self, start: int, stop: int) -> None:
        """host[start:stop] was written directly (`_flush` copies it)."""
        self.lo, self.hi = min(self.lo, start), max(self.hi, stop)

    def write(self, values: np.ndarray, start: int = 0) -> None:
        """Stage and copy at once (writes outside a step)."""
        self.stage(values, start)
        _flush([self])

    def view(self, n: int, shape: list[int] | None = None) -> paddle.Tensor:
        if self.on_gpu:  # GPU: not cached (that a slice is a view there is checked on CPU only)
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


def graph_attention(size: int, decode: bool) -> tuple[int, int]:
    """`ForwardMeta`'s (max_q_len, graph_tokens) in the graph of `size` (decode: rows of one token each; mixed: rows
    of any length, max_q_len 0 for unknown), and in every eager step that graph would run."""
    return (1 if decode else 0), size


def _flush(buffers) -> None:
    """GPU: copy each buffer's staged range to the device, all in one call (CPU: already in place)."""
    if not buffers or not buffers[0].on_gpu:
        return
    dsts, srcs, sizes = [], [], []
    for b in buffers:
        if b.hi > b.lo:
            k = b.host.itemsize
            dsts.append(b.device_ptr + b.lo * k)
            srcs.append(b.host.ctypes.data + b.lo * k)
            sizes.append((b.hi - b.lo) * k)
            b.lo, b.hi = len(b.host), 0
    if dsts:
        from fdlite.kernels import gpu as gpu_ops  # noqa: PLC0415

        gpu_ops.copy_from_host_many(dsts, srcs, sizes)


class ForwardBuffers:
    def __init__(self, max_tokens: int, max_rows: int, max_blocks: int, block_size: int):
        self.max_tokens, self.max_rows, self.max_blocks, self.block_size = max_tokens, max_rows, max_blocks, block_size
        self.max_kv_len = max_blocks * block_size  # a row's longest KV (a graph's table width): attention plans by it
        self.input_ids = _Buffer(max_tokens, "int64")
        self.positions = _Buffer(max_tokens, "int64")
        self.slot_mapping = _Buffer(max_tokens, "int64")
        self.token_rows = _Buffer(max_tokens, "int64")
        # Row-major block tables; graph mode uses rows of max_blocks with one scratch row at the end.
        self.block_tables = _Buffer((max_rows + 1) * max_blocks, "int32")
        self.seq_lens_kv = _Buffer(max_rows, "int32")
        self.cu_seqlens_q = _Buffer(max_rows + 1, "int32")
        self.logits_indices = _Buffer(max_rows, "int64")
        self.patch_src = _Buffer(max_tokens, "int64")  # `TokenPatch.src`, staged with the step's inputs
        self._all = [b for b in vars(self).values() if isinstance(b, _Buffer)]
        self.scratch_block: int | None = None

    def release(self) -> None:
        """Free every buffer's tensor (the engine is closing); the buffers cannot be written afterwards."""
        for b in self._all:
            b._views.clear()
            device_tensors.release_tensor(b.tensor)
            b.tensor = b.host = None

    def tensors(self) -> dict[str, paddle.Tensor]:
        """Every persistent tensor by name (their addresses must never change)."""
        return {k: v.tensor for k, v in vars(self).items() if isinstance(v, _Buffer)}

    def set_scratch_block(self, block: int) -> None:
        """Point the graph-mode scratch row at the KV cache's scratch block (once the cache exists)."""
        self.scratch_block = block
        self.block_tables.write(np.full(self.max_blocks, block, np.int32), start=self.max_rows * self.max_blocks)

    def write(self, flat: FlatBatch, caches, patch=None,
              graph: tuple[int, bool] | None = None) -> tuple[paddle.Tensor, paddle.Tensor, ForwardMeta, paddle.Tensor]:
        """Copy `flat` into the buffers (then `patch`: see `apply_patch`); return (input_ids, positions, meta,
        logits_indices) views of its size. `graph`: (size, decode) of the CUDA graph this step would run in (None:
        none would), whose attention plan it takes (`graph_attention`)."""
        t, b = flat.num_tokens, flat.num_rows
        self._stage_common(flat)
        width = flat.block_tables.shape[1]
        self.block_tables.stage(flat.block_tables.reshape(-1))
        self._stage_patch(patch)
        _flush(self._all)
        self._apply_patch(patch)
        max_q_len, graph_tokens = graph_attention(*graph) if graph is not None else (flat.max_q_len, 0)
        meta = ForwardMeta(
            slot_mapping=self.slot_mapping.view(t), token_rows=self.token_rows.view(t), positions=self.positions.view(t),
            block_tables=self.block_tables.view(b * width, [b, width]), seq_lens_kv=self.seq_lens_kv.view(b),
            cu_seqlens_q=self.cu_seqlens_q.view(b + 1), num_decodes=flat.num_decodes, block_size=self.block_size,
            prefills=flat.prefills, caches=caches, max_q_len=max_q_len, graph_tokens=graph_tokens,
            max_kv_len=self.max_kv_len,
        )
        return self.input_ids.view(t), self.positions.view(t), meta, self.logits_indices.view(len(flat.logits_indices))

    def write_padded(self, flat: FlatBatch, size: int, decode: bool, patch=None) -> None:
        """Graph mode: copy `flat` and pad it to `size` tokens (and, for decode graphs, rows).

        Padded tokens are token 0 at position 0 of the scratch row, writing the scratch slot. In a
        prefill graph they belong to no row (rows past the batch have no tokens, KV length 0). Each
        buffer is padded in its host array, then all are copied at once (GPU).
        """
        t, b = flat.num_tokens, flat.num_rows
        extra = max(0, size - t)
        rows = max(0, (size if decode else self.max_rows) - b)
        w = flat.block_tables.shape[1]
        tables = self.block_tables.host[: (b + rows) * self.max_blocks].reshape(b + rows, self.max_blocks)
        tables[:b, :w] = flat.block_tables
        tables[:b, w:] = self.scratch_block
        tables[b:] = self.scratch_block
        self.block_tables.mark(0, (b + rows) * self.max_blocks)
        self._stage_common(flat)
        self.input_ids.stage(0, t, extra)
        self.positions.stage(0, t, extra)
        self.slot_mapping.stage(self.scratch_block * self.block_size, t, extra)
        self.token_rows.stage(self.max_rows, t, extra)
        if decode:  # each padded row is one padded token
            self.seq_lens_kv.stage(1, b, rows)
            self.cu_seqlens_q.stage(np.arange(t + 1, t + 1 + rows, dtype=np.int32), b + 1)
        else:  # padded rows hold no tokens
            self.seq_lens_kv.stage(0, b, rows)
            self.cu_seqlens_q.stage(t, b + 1, rows)
        self._stage_patch(patch)
        _flush(self._all)
        self._apply_patch(patch)

    def _stage_patch(self, patch) -> None:
        if patch is not None and self.input_ids.on_gpu:
            self.patch_src.stage(patch[0].src)

    def _apply_patch(self, patch) -> None:
        """`patch` = (TokenPatch, the previous step's sampled ids): input_ids[dst[i]] = ids[src[i]], after the
        inputs were written. On a GPU one `gather_rows` per run of consecutive `dst` (the decode rows come first,
        so usually one run) from the device ids into the buffer, its index the staged `patch_src`; on CPU the
        same on the host view."""
        if patch is None:
            return
        p, ids = patch
        dst = p.dst
        cuts = np.flatnonzero(np.diff(dst) != 1) + 1
        for a, z in zip([0, *cuts.tolist()], [*cuts.tolist(), len(dst)]):
            start = int(dst[a])
            if self.input_ids.on_gpu:
                from fdlite.kernels import gpu as gpu_ops  # noqa: PLC0415

                gpu_ops.gather_rows(ids, self.patch_src.tensor[a:z], out=self.input_ids.tensor[start : start + z - a])
            else:
                self.input_ids.host[start : start + z - a] = np.asarray(ids)[p.src[a:z]]

    def graph_views(self, size: int, decode: bool, caches) -> tuple[paddle.Tensor, paddle.Tensor, ForwardMeta]:
        """Fixed-shape views for a graph of `size` tokens: what capture binds and replay reads."""
        rows = size if decode else self.max_rows
        max_q_len, graph_tokens = graph_attention(size, decode)
        meta = ForwardMeta(
            slot_mapping=self.slot_mapping.view(size), token_rows=self.token_rows.view(size),
            positions=self.positions.view(size),
            block_tables=self.block_tables.view((self.max_rows + 1) * self.max_blocks, [self.max_rows + 1, self.max_blocks]),
            seq_lens_kv=self.seq_lens_kv.view(rows), cu_seqlens_q=self.cu_seqlens_q.view(rows + 1),
            num_decodes=size if decode else 0, block_size=self.block_size, prefills=None, caches=caches,
            max_q_len=max_q_len, graph_tokens=graph_tokens, max_kv_len=self.max_kv_len,
        )
        return self.input_ids.view(size), self.positions.view(size), meta

    def logits_index_view(self, n: int) -> paddle.Tensor:
        return self.logits_indices.view(n)

    def _stage_common(self, flat: FlatBatch) -> None:
        self.input_ids.stage(flat.input_ids)
        self.positions.stage(flat.positions)
        self.slot_mapping.stage(flat.slot_mapping)
        self.token_rows.stage(flat.token_rows)
        self.seq_lens_kv.stage(flat.seq_lens_kv)
        self.cu_seqlens_q.stage(flat.cu_seqlens_q)
        self.logits_indices.stage(flat.logits_indices)
