"""The GPU-only calls for CUDA graphs, kept in one thin module: capture and replay.

Written against the Paddle API (`paddle.device.cuda.graphs.CUDAGraph`), the same in 2.6 and 3.x.
Not run in this repository's tests: no Paddle GPU build computes on the GPUs the project can reach
(see README). Everything that calls into this module is tested on CPU through `EagerReplayGraph`,
which has the same interface.
"""

from __future__ import annotations

from typing import Callable

import paddle


def cuda_graphs_available() -> bool:
    return paddle.is_compiled_with_cuda() and paddle.get_device().startswith("gpu")


class CudaGraph:
    """One captured graph. All graphs of a runner share one memory pool (captured largest first)."""

    _pool_id = None

    def __init__(self) -> None:
        from paddle.device.cuda.graphs import CoreCUDAGraph, CUDAGraph

        if CudaGraph._pool_id is None:
            CudaGraph._pool_id = CoreCUDAGraph.gen_new_memory_pool_id()
        self._graph = CUDAGraph(pool_id=CudaGraph._pool_id)
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
