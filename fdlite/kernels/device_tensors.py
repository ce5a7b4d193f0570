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


def release_tensor(t) -> None:
    """Free `t`'s memory now, whoever else still refers to the tensor object (it is left empty).

    For what an engine owns when it closes (KV cache, weights, buffers): a traceback, a notebook's
    history or a forgotten reference to one layer then keeps a Python object alive, not its memory.
    Views share the allocation, so the memory goes once every view is released or dropped. Anything
    that is not an initialised Paddle tensor is skipped."""
    if not isinstance(t, paddle.Tensor):
        return
    try:
        if not t._is_initialized():
            return
        clear = getattr(t, "_clear_data", None)
        if clear is not None:
            clear()
        else:  # older Paddle: the same call on the underlying DenseTensor
            t.get_tensor()._clear()
    except Exception:  # noqa: BLE001 - best effort: the reference is dropped by the caller anyway
        pass


def release_layer_tensors(layer) -> None:
    """`release_tensor` on every parameter, buffer and tensor attribute of `layer` and its sublayers."""
    for sub in layer.sublayers(include_self=True):
        tensors = [*sub._parameters.values(), *sub._buffers.values(),
                   *(v for v in vars(sub).values() if isinstance(v, paddle.Tensor))]
        for t in tensors:
            release_tensor(t)
