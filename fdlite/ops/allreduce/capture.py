"""`capture_custom_allreduce()`: the context every CUDA-graph capture runs inside.

The custom all-reduce reads its input through a table of registered pointers when a graph is being
captured, and those pointers can only be registered once capture ends (seed:
pr_sot_custom_allreduce.md). So capture must run inside this context, and SOT must translate inside
it too, so that the "are we capturing" branch is translated the way replay needs it. With one rank, or
before the custom all-reduce library is built, the context does no communication work: it only
marks that capture is under way and, at exit, asks a registered communicator to register the
graph buffers.
"""

from __future__ import annotations

import contextlib
from typing import Callable

_state = {"depth": 0}
_on_exit: list[Callable[[], None]] = []


def is_capturing_custom_allreduce() -> bool:
    return _state["depth"] > 0


def register_capture_exit_hook(fn: Callable[[], None]) -> None:
    """A communicator's "register the graph buffers now" step, run when the outermost context exits."""
    _on_exit.append(fn)


@contextlib.contextmanager
def capture_custom_allreduce(recorder=None):
    """Mark CUDA-graph capture for the all-reduce; `recorder` (a PhaseRecorder) gets begin/end events."""
    ctx = recorder.phase("capture_custom_allreduce", log=False) if recorder is not None else contextlib.nullcontext()
    with ctx:
        _state["depth"] += 1
        try:
            yield
        finally:
            _state["depth"] -= 1
            if _state["depth"] == 0:
                for fn in list(_on_exit):
                    fn()
