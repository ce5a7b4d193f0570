"""The GPU-only calls for CUDA graphs, kept in one thin module: capture and replay.

Written against the Paddle API (`paddle.device.cuda.graphs.CUDAGraph`), the same in 2.6 and 3.x.
Run on the lent H100 by tools/gpu/e2e_harness.py (Paddle 2.6.2 capturing fdlite's own kernels); the
CPU tests reach everything that calls into this module through `EagerReplayGraph`, which has the
same interface.
"""

from __future__ import annotations

from typing import Callable

import paddle

from fdlite.kernels.platform import is_gpu


def cuda_graphs_available() -> bool:
    """The GPU path on a CUDA build of Paddle with a device (not, say, the GPU path emulated on a CPU)."""
    return is_gpu() and paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def graphs_share_pool() -> bool:
    """Whether this Paddle lets captured graphs share one memory pool (3.x: yes; 2.6: no pool id)."""
    import inspect  # noqa: PLC0415

    from paddle.device.cuda.graphs import CUDAGraph  # noqa: PLC0415

    return "pool_id" in inspect.signature(CUDAGraph.__init__).parameters


class CudaGraph:
    """One captured graph. All graphs of a runner share one memory pool (captured largest first)."""

    _pool_id = None

    def __init__(self) -> None:
        from paddle.device.cuda.graphs import CoreCUDAGraph, CUDAGraph

        if graphs_share_pool():
            if CudaGraph._pool_id is None:
                CudaGraph._pool_id = CoreCUDAGraph.gen_new_memory_pool_id()
            self._graph = CUDAGraph(pool_id=CudaGraph._pool_id)
        else:  # Paddle 2.6: no shared pool in its Python API; each graph keeps its own
            self._graph = CUDAGraph()
        self.output = None

    def capture(self, fn: Callable[[], paddle.Tensor], static_inputs=None) -> paddle.Tensor:
        """Record `fn`'s kernels; its output tensor is rewritten in place by every replay.

        `static_inputs` (what the eager stand-in checks) is not needed here: the graph binds the
        addresses `fn` reads by itself."""
        self._graph.capture_begin()
        try:
            self.output = fn()
        finally:
            self._graph.capture_end()
        return self.output

    def replay(self) -> paddle.Tensor:
        self._graph.replay()
        return self.output

    def close(self) -> None:
        """Free the graph and its memory pool (`CUDAGraph.reset`, in 2.6 and 3.x). The output tensor lives in
        that pool, so it goes first; the graph must not be replayed again."""
        self.output = None
        graph, self._graph = self._graph, None
        if graph is not None and getattr(graph, "_graph", None) is not None:  # None: its capture never ended
            graph.reset()

    @classmethod
    def forget_pool(cls) -> None:
        """Graphs captured from now on take a new shared pool (3.x); the old one goes with its last graph."""
        cls._pool_id = None
