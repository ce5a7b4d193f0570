"""The device fdlite computes on, chosen once per process before the model is built.

Every layer in `fdlite/layers/` reads it when it is constructed (`CustomOp`), so the choice is made in one
place: the `device` option, or Paddle's current device when it is left unset (what the user set with
`paddle.set_device`). It is never widened behind the user's back: a CPU choice on a machine with a
GPU computes on the CPU (an earlier runner switched to the GPU whenever Paddle had CUDA, which on the
Hoppers ran Paddle's no-op kernels and sampled garbage).

"gpu" means fdlite's own CUDA kernels (`fdlite/kernels/gpu.py`), never Paddle's built-in GPU kernels:
PyPI's paddlepaddle-gpu has no sm_90 code, so on the lent Hoppers those silently do nothing.
"""

from __future__ import annotations

import paddle

from fdlite.config import parse_device

_current: dict[str, str] = {}


def select_device(requested: str | None) -> str:
    """Make `requested` (None: Paddle's current device) the device of this process; returns "cpu" or "gpu"."""
    device = parse_device(requested) or paddle.get_device()
    if device.startswith("gpu"):
        if not paddle.is_compiled_with_cuda():
            raise ValueError(f"device={device!r} needs a CUDA build of Paddle; this one (paddlepaddle "
                             f"{paddle.__version__}) is CPU-only. Use device='cpu'.")
        if paddle.device.cuda.device_count() == 0:
            raise ValueError(f"device={device!r}: Paddle sees no GPU (CUDA_VISIBLE_DEVICES?). Use device='cpu'.")
    paddle.set_device(device)
    kind = "gpu" if device.startswith("gpu") else "cpu"
    _current["device"] = kind
    return kind


def current_device() -> str:
    """"cpu" or "gpu": the selected device, else Paddle's current one (ops built outside an engine, e.g. tests)."""
    device = _current.get("device")
    if device is None:
        device = "gpu" if paddle.get_device().startswith("gpu") else "cpu"
    return device


def is_gpu() -> bool:
    return current_device() == "gpu"
