"""Device memory statistics for sizing the KV cache (docs/design.md, "Startup order" step 3 and "KV-cache sizing"), from Paddle's allocator.

Only calls that exist in both Paddle 2.6 and 3.x, or feature-detected: the profiling run reads
them on a GPU; on CPU there are none (the cache size comes from `kv_cache_memory_bytes`).

Paddle 2.6 cannot reset the allocated-bytes peak, so there it is the process's high-water mark: after a
first engine closed, that mark is the first engine's KV cache, and a second engine's profile would read it
as its own activation peak (and size its cache at 0 blocks). `profile_peak` handles that case.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle

from fdlite.kernels.platform import is_gpu as on_gpu


@dataclass
class DeviceMemory:
    total: int      # bytes on the device
    allocated: int  # bytes held by Paddle's allocator now
    peak: int       # most bytes held since the last reset (Paddle 2.6: since the process started)
    reserved: int | None = None  # bytes the allocator holds from CUDA, in use or cached (None: not read)


def device_memory() -> DeviceMemory | None:
    """Current CUDA memory numbers, or None on a CPU run."""
    if not on_gpu():
        return None
    dev = paddle.device.cuda
    reserved = getattr(dev, "memory_reserved", None)
    return DeviceMemory(
        total=dev.get_device_properties().total_memory,
        allocated=dev.memory_allocated(),
        peak=dev.max_memory_allocated(),
        reserved=reserved() if reserved is not None else None,
    )


def reset_peak_memory() -> bool:
    """Start a new peak; False where that is not possible (a CPU run; Paddle 2.6, which has no reset call, so
    its peak counts from process start: see `profile_peak`)."""
    if not on_gpu():
        return False
    reset = getattr(paddle.device.cuda, "reset_max_memory_allocated", None)
    if reset is None:
        return False
    reset()
    return True


def release_cached_memory() -> None:
    """Give the allocator's cached, unused blocks back to CUDA (`empty_cache`), on a GPU build; else nothing."""
    if not on_gpu() or not paddle.is_compiled_with_cuda():
        return
    empty = getattr(paddle.device.cuda, "empty_cache", None)
    if empty is not None:
        empty()


# Activation peaks measured without a peak reset, by what the profiling run computed (see `profile_peak`).
_STALE_PEAK_ACTIVATIONS: dict[tuple, int] = {}


def profile_peak(during: DeviceMemory, allocated_before: int, fresh: bool, key: tuple) -> int:
    """The allocated-bytes peak of the profiling forward, read after it (`during`).

    `fresh`: the peak was reset before the forward, so `during.peak` is the forward's own. Without a reset
    (Paddle 2.6) `during.peak` is the process's high-water mark, which after an earlier engine is that
    engine's whole KV cache. Then two upper bounds of the forward's peak are at hand, and the lower one is
    taken: that mark, and the bytes the allocator reserved after the forward (its cache was emptied just
    before it, and it returns nothing to CUDA in between, so its reserve covers the forward's peak). The
    activation part (peak - allocated_before) is remembered by `key` (the model and the profiled batch), and
    a later engine of the same key in this process takes it rather than a bound that an earlier engine's
    high-water mark or allocator layout could move: the same model gets the same cache every time."""
    if fresh or during.reserved is None:
        return during.peak
    known = _STALE_PEAK_ACTIVATIONS.get(key)
    if known is None:
        known = _STALE_PEAK_ACTIVATIONS[key] = max(0, min(during.peak, during.reserved) - allocated_before)
    return allocated_before + known
