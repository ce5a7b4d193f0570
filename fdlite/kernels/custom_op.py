"""`CustomOp`: a layer with one implementation per device, picked once when it is constructed.

vLLM's `CustomOp.dispatch_forward` idea: `forward_cpu` is Paddle ops (the reference, and what the CPU
runs), `forward_gpu` calls fdlite's own CUDA kernels (`fdlite/kernels/gpu.py`). The choice is made in
`__init__` from `platform.current_device()`, so models call `op(x)` and never branch on the device,
and a step pays no dispatch beyond one function call. Subclasses that are not layers (the
sampler) use `dispatch_forward` the same way.

What is kept is the class's plain function, called with the op (`self._forward_method(self, ...)`), not
the bound method `self.forward_gpu`: a bound method stored on its own object is a reference cycle, so
every op (and the weights it holds) would outlive `del llm` until the garbage collector ran.
"""

from __future__ import annotations

from typing import Callable

from paddle import nn

from fdlite.kernels import platform


def dispatch_forward(op) -> Callable:
    """`type(op).forward_gpu` on the GPU, `type(op).forward_cpu` otherwise: the unbound function, which the
    caller calls with `op` as its first argument (no reference from `op` to itself; see the module docstring)."""
    if platform.is_gpu():
        from fdlite.kernels import gpu  # noqa: PLC0415 - registers the kernels (building them on first use)

        gpu.load()
        return type(op).forward_gpu
    return type(op).forward_cpu


class CustomOp(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self._forward_method = dispatch_forward(self)

    def forward(self, *args, **kwargs):
        return self._forward_method(self, *args, **kwargs)

    def forward_cpu(self, *args, **kwargs):
        raise NotImplementedError

    def forward_gpu(self, *args, **kwargs):
        raise NotImplementedError
