"""`CustomOp`: a layer with one implementation per device, picked once when it is constructed.

vLLM's `CustomOp.dispatch_forward` idea: `forward_cpu` is Paddle ops (the reference, and what the CPU
runs), `forward_gpu` calls fdlite's own CUDA kernels (`fdlite/kernels/gpu.py`). The choice is made in
`__init__` from `platform.current_device()`, so models call `op(x)` and never branch on the device,
and a step pays no dispatch beyond one bound-method call. Subclasses that are not layers (the
sampler) use `dispatch_forward` the same way.
"""

from __future__ import annotations

from typing import Callable

from paddle import nn

from fdlite.kernels import platform


def dispatch_forward(op) -> Callable:
    """`op.forward_gpu` on the GPU, `op.forward_cpu` otherwise."""
    if platform.is_gpu():
        from fdlite.kernels import gpu  # noqa: PLC0415 - registers the kernels (building them on first use)

        gpu.load()
        return op.forward_gpu
    return op.forward_cpu


class CustomOp(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self._forward_method = dispatch_forward(self)

    def forward(self, *args, **kwargs):
        return self._forward_method(*args, **kwargs)

    def forward_cpu(self, *args, **kwargs):
        raise NotImplementedError

    def forward_gpu(self, *args, **kwargs):
        raise NotImplementedError
