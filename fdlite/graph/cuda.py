"""The GPU-only calls, kept in one thin module: CUDA-graph capture/replay and CUDA memory statistics.

Written against the Paddle 3.x API (`paddle.device.cuda.graphs.CUDAGraph`, `paddle.device.cuda.*memory*`).
Not run in this repository's tests: no Paddle GPU build computes on the GPUs the project can reach
(see README). Everything that calls into this module is tested on CPU through `EagerReplayGraph`,
which has the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass
class DeviceMemory:
    total: int      # bytes on the device
    allocated: int  # bytes held by Paddle's allocator now
    peak: int       # most bytes held since the last reset


def device_memory() -> DeviceMemory | None:
    """Current CUDA memory numbers, or None on a CPU run."""
    if not cuda_graphs_available():
        return None
    dev = paddle.device.cuda
    return DeviceMemory(
        total=dev.get_device_properties().total_memory,
        allocated=dev.memory_allocated(),
        peak=dev.max_memory_allocated(),
    )


def reset_peak_memory() -> None:
    if cuda_graphs_available():
        paddle.device.cuda.reset_max_memory_allocated()
