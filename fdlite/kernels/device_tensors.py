"""Filled tensors, host-to-device writes and host read-back that run no Paddle kernel on the GPU.

The runner's persistent buffers and the KV cache need fills and copies, and the graph check needs
results back in float32. On CPU these are Paddle's own ops. On GPU they are fdlite's fill and copy
kernels and host-side conversion: Paddle's `full`, `zeros`, `astype` and `scatter` launch its own
kernels, which on the lent Hoppers silently do nothing (`fdlite/kernels/gpu.py`).
"""

from __future__ import annotations

import numpy as np
import paddle

from fdlite.kernels import platform

_NP_DTYPES = {"int64": np.int64, "int32": np.int32, "float32": np.float32, "float16": np.float16}


def full(shape: list[int], value, dtype: str) -> paddle.Tensor:
    """A new tensor on the current device, every element `value`."""
    if not platform.is_gpu():
        return paddle.full(shape, value, dtype=dtype)
    from fdlite.kernels import gpu as gpu_ops  # noqa: PLC0415

    out = paddle.empty(shape, dtype=dtype)
    gpu_ops.fill_(out, value)
    return out


def fill_(dst: paddle.Tensor, value) -> None:
    """dst[...] = value, in place (dst may be a leading-axis slice: a view of its base tensor)."""
    if not platform.is_gpu():
        # `Tensor.fill_` refuses NaN (the cache poison); a filled tensor assigned into the view does not.
        paddle.assign(paddle.full(dst.shape, value, dtype=dst.dtype), output=dst)
        return
    from fdlite.kernels import gpu as gpu_ops  # noqa: PLC0415

    gpu_ops.fill_(dst, value)


def write_from_host(dst: paddle.Tensor, values: np.ndarray) -> None:
    """dst[...] = values (same number of elements; dst contiguous, e.g. a leading-rows view)."""
    array = np.ascontiguousarray(values, dtype=_NP_DTYPES[str(dst.dtype).replace("paddle.", "")]).reshape(dst.shape)
    if not platform.is_gpu():
        paddle.assign(paddle.to_tensor(array, place=paddle.CPUPlace()), output=dst)
        return
    from fdlite.kernels import gpu as gpu_ops  # noqa: PLC0415

    gpu_ops.copy_from_host(dst, array)


def to_numpy_f32(t: paddle.Tensor) -> np.ndarray:
    """A float tensor's values as float32 numpy, converted on the host (bfloat16 arrives as its uint16 bits)."""
    a = t.numpy()
    if a.dtype == np.uint16:  # bfloat16: the upper half of a float32
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)
