"""CUDA graphs per padded size: static input buffers, capture, verify, and replay of a flat batch.

One runner serves one kind of batch: decode-only batches keyed by batch size, or steps that hold prefill
tokens (prefill rows alone, or mixed with decode rows) keyed by token count. In a token-count graph the
kernels' launch configurations depend only on the token count and the row capacity (max_num_seqs): the
attention kernel takes any split of the tokens into rows, and rows past the batch hold no tokens, so one
captured graph serves every split of the same token count (FastDeploy's "last request comes out garbled"
bug was a graph captured for one split and replayed for another). Captures use the worst-case split anyway
(docs/design.md, section "Prefill graphs: the worst-case split"), and the verify step replays each graph on a
different split, with decode rows after long contexts beside prefill chunks.

The graphs read the runner's persistent input buffers (`runner/forward_buffers.py`), the same
tensors eager steps use, written in place every step, so their addresses never change: the
invariant CUDA graphs rely on. Padded tokens read and write only the scratch block at the end of
the KV cache.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from typing import Callable

import numpy as np
import paddle

from fdlite import envs
from fdlite.graph.cuda import CudaGraph, cuda_graphs_available
from fdlite.graph.eager_replay import EagerReplayGraph
from fdlite.graph.capture_sizes import padded_size, random_split, worst_case_prefill_split
from fdlite.runner.dummy_batch import dummy_batch
from fdlite.graph.static_graph import translation_count
from fdlite.kernels.device_tensors import to_numpy_f32
from fdlite.layers.forward_meta import FlatBatch
from fdlite.runner.forward_buffers import ForwardBuffers

logger = logging.getLogger("fdlite")


def graph_size(batch: FlatBatch, sizes: list[int], mixed: bool, max_num_seqs: int) -> int | None:
    """The size among `sizes` of the graph `batch` runs in, or None: decode graphs (keyed by batch size) take
    decode-only batches, mixed graphs (keyed by token count) any split of the tokens over at most max_num_seqs rows."""
    fits = batch.num_rows <= max_num_seqs if mixed else batch.num_decodes == batch.num_rows
    return padded_size(sizes, batch.num_tokens) if fits else None


class CudaGraphRunner:
    """Captured graphs of `model_layer` for each size in `sizes` (decode: batch sizes; mixed: token counts)."""

    def __init__(self, model_layer, kv_cache, buffers: ForwardBuffers, sizes: list[int], mixed: bool,
                 max_num_seqs: int, graph_factory: Callable[[], object]):
        self.model_layer = model_layer
        self.kv_cache = kv_cache
        self.sizes = sorted(sizes)
        self.mixed = mixed
        self.kind = "mixed" if mixed else "decode"
        self.max_num_seqs = max_num_seqs
        self.block_size = kv_cache.block_size
        self.scratch_block = kv_cache.num_blocks
        self.graph_factory = graph_factory
        self.buffers = buffers
        buffers.set_scratch_block(self.scratch_block)
        self.graphs: dict[int, object] = {}
        self.replays_by_size: Counter[tuple[int, int]] = Counter()  # (graph size, batch tokens) -> replays

    # ---- capture -------------------------------------------------------------------------

    def _forward(self, size: int, dynamic: bool = False) -> paddle.Tensor:
        ids, positions, meta = self.buffers.graph_views(size, not self.mixed, self.kv_cache.caches)
        kwargs = dict(ids_remove_padding=ids, positions=positions, forward_meta=meta)
        if dynamic:  # the eager reference for verification, whatever backend is attached
            return type(self.model_layer).dynamic_forward(self.model_layer, **kwargs)
        return self.model_layer(**kwargs)

    def _write(self, batch: FlatBatch, size: int, patch=None) -> None:
        self.buffers.write_padded(batch, size, decode=not self.mixed, patch=patch)

    def dummy_batch(self, size: int, seed: int, worst_case: bool) -> FlatBatch:
        """A batch of `size` tokens with distinct cache slots (so replays are deterministic).

        worst_case: the capture split (rows of one token and one long row); otherwise a random
        split, which is what the verify step replays: for a mixed graph, decode rows after random-length
        contexts, then prefill chunks, some after a cached context; for a decode graph, decode rows after
        random-length contexts.
        """
        rng = np.random.default_rng(seed)
        bs, nb = self.block_size, self.kv_cache.num_blocks
        longest = min(self.buffers.max_blocks * bs, 4 * bs)
        if not self.mixed:
            return dummy_batch([int(rng.integers(0, longest)) + 1 for _ in range(size)], bs, nb, decode=True, rng=rng)
        max_len = self.buffers.max_blocks * bs  # a row's most tokens: its block table's width
        if worst_case:
            return dummy_batch(worst_case_prefill_split(size, self.max_num_seqs, max_len), bs, nb, rng=rng)
        counts = np.asarray(random_split(size, self.max_num_seqs, max_len, rng))  # one-token rows (decodes) first
        room = np.minimum(max_len - counts, longest)  # a row's context must leave room for its tokens
        context = np.where(rng.random(len(counts)) < 0.5, rng.integers(0, np.maximum(1, room + 1)), 0)
        context = np.minimum(np.where(counts == 1, np.maximum(context, 1), context), max_len - counts)
        return dummy_batch((context + counts).tolist(), bs, nb, rng=rng, computed=context.tolist())

    def capture_all(self, recorder=None, verify: bool = True, tolerance: float = 1e-4) -> None:
        """Capture every size, largest first (one shared memory pool), each after an eager warm-up.

        The warm-up is where SOT translates (inside capture: docs/design.md, section "SOT inside capture inside capture_custom_allreduce"); its translation
        count is recorded as a "sot_translate" event.
        """
        for size in sorted(self.sizes, reverse=True):
            self._write(self.dummy_batch(size, seed=size, worst_case=True), size)
            before = translation_count()
            self._forward(size)  # warm-up: lazy initialisation and SOT translation happen here
            translated = translation_count() - before
            if recorder is not None and translated:
                recorder.point("sot_translate", size=size, count=translated)
            graph = self.graph_factory()
            # Through a weak reference: the eager stand-in keeps the function, and a strong `self` in it
            # would make runner -> graphs -> function -> runner a cycle that outlives `del llm`.
            runner = weakref.proxy(self)
            graph.capture(lambda s=size: runner._forward(s), static_inputs=self.buffers.tensors)
            self.graphs[size] = graph
            if recorder is not None:
                recorder.point("cudagraph_captured", size=size, kind=self.kind)
            if verify:
                self.verify(size, tolerance)
        logger.info("captured %d %s CUDA graphs: sizes %s", len(self.graphs), self.kind, self.sizes)

    def verify_all(self, tolerance: float = 1e-4) -> None:
        """`verify` every captured size, largest first (the engine calls it once the capture context has exited)."""
        for size in sorted(self.graphs, reverse=True):
            self.verify(size, tolerance)

    def verify(self, size: int, tolerance: float) -> None:
        """Replay the graph of `size` on new inputs (another split) and compare with the eager forward."""
        batch = self.dummy_batch(size, seed=10_000 + size, worst_case=False)
        self._write(batch, size)
        got = to_numpy_f32(self.graphs[size].replay())
        want = to_numpy_f32(self._forward(size, dynamic=True))
        err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))
        if not np.isfinite(got).all() or err > tolerance:
            raise RuntimeError(
                f"CUDA graph self-check failed: the {self.kind} graph for size {size} "
                f"disagrees with the eager forward (max relative difference {err:.3g} > {tolerance}). "
                "Run without use_cudagraph, and report this."
            )

    def close(self) -> None:
        """Free every graph (and its memory pool) and drop the runner's references to the model, the KV cache
        and the buffers; no graph may be replayed afterwards (with `graphs` empty, every batch then runs eagerly).
        The captured function (the eager stand-in keeps it) refers back to this runner: closing breaks that cycle."""
        graphs, self.graphs = self.graphs, {}
        for graph in graphs.values():
            close = getattr(graph, "close", None)
            if close is not None:
                close()
        forget_pool = getattr(self.graph_factory, "forget_pool", None)
        if forget_pool is not None:
            forget_pool()
        self.model_layer = self.kv_cache = self.buffers = None

    # ---- replay --------------------------------------------------------------------------

    @property
    def num_replays(self) -> int:
        return sum(self.replays_by_size.values())

    @property
    def num_padded_replays(self) -> int:
        """Replays of a batch smaller than its graph (padded rows ran too)."""
        return sum(n for (size, tokens), n in self.replays_by_size.items() if tokens < size)

    def size_for(self, batch: FlatBatch) -> int | None:
        """The captured size this batch runs in, or None to run it eagerly."""
        return graph_size(batch, self.sizes, self.mixed, self.max_num_seqs) if self.graphs else None

    def run(self, batch: FlatBatch, size: int, patch=None) -> paddle.Tensor:
        """Write the batch into the buffers (and `patch`, `ForwardBuffers.write`), replay the graph of `size`,
        return hidden states [T, hidden]."""
        self._write(batch, size, patch)
        self.replays_by_size[size, batch.num_tokens] += 1
        return self.graphs[size].replay()[: batch.num_tokens]


def cudagraph_factory(device: str) -> Callable[[], object] | None:
    """What captures graphs here: CUDA graphs on a GPU, the eager stand-in when asked for, else None."""
    if envs.FDLITE_CUDAGRAPH_BACKEND == "eager":
        return EagerReplayGraph
    if device == "gpu" and cuda_graphs_available():
        return CudaGraph
    return None
