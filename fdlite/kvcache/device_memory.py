"""Device memory statistics for sizing the KV cache (docs/design.md, "Startup order" step 3 and "KV-cache sizing"), from Paddle's allocator.

Only calls that exist in both Paddle 2.6 and 3.x, or feature-detected: the profiling run reads
them on a GPU; on CPU there are none (the cache size comes from `kv_cache_memory_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle

from fdlite.kernels.platform import is_gpu as on_gpu


@dataclass
class DeviceMemory:
    total: int      # bytes on the device
    allocated: int  # bytes held by Paddle's allocator now
    peak: int       # most bytes held since the last reset


def device_memory() -> DeviceMemory | None:
    """Current CUDA memory numbers, or None on a CPU run."""
    if not on_gpu():
        return None
    dev = paddle.device.cuda
    return DeviceMemory(
        total=dev.get_device_properties().total_memory,
        allocated=dev.memory_allocated(),
        peak=dev.max_memory_allocated(),
    )


def reset_peak_memory() -> None:
    """Start a new peak; Paddle 2.6 has no reset call, so the peak then counts from process start
    (an over-estimate of the activation peak: a smaller, safe KV cache)."""
    if on_gpu():
        reset = getattr(paddle.device.cuda, "reset_max_memory_allocated", None)
        if reset is not None:
            reset()


def release_cached_memory() -> None:
    """Give the allocator's cached, unused blocks back to CUDA (`empty_cache`), on a GPU build; else nothing."""
    if not on_gpu() or not paddle.is_compiled_with_cuda():
        return
    empty = getattr(paddle.device.cuda, "empty_cache", None)
    if empty is not None:
        empty()
