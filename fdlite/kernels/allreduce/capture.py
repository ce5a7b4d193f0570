"""`capture_custom_allreduce()`: the context every CUDA-graph capture runs inside.

The custom all-reduce (custom_all_reduce.py) reads its input through a table of registered pointers
when a graph is being captured, and those pointers can only be registered once capture ends (docs/design.md,
section "SOT inside capture inside capture_custom_allreduce"). So capture must run inside this context, and SOT must translate inside
it too, so that the "are we capturing" branch is translated the way replay needs it.

Communicators that take part register themselves (`register_capture_participant`): each gets
`begin_capture()` when the outermost context is entered and `end_capture(register=...)` when it
exits, with register=False after an exception (a failed capture must not register half its
buffers). With one rank, or without the custom library, nothing is registered and the context
only marks that capture is under way.
"""

from __future__ import annotations

import contextlib
from typing import Protocol


class CaptureParticipant(Protocol):
    def begin_capture(self) -> None: ...

    def end_capture(self, register: bool = True) -> int: ...


_state = {"depth": 0}
_participants: list[CaptureParticipant] = []


def is_capturing_custom_allreduce() -> bool:
    return _state["depth"] > 0


def register_capture_participant(comm: CaptureParticipant) -> None:
    """Have `comm` record graph buffers during capture and register them when capture ends."""
    if comm not in _participants:
        _participants.append(comm)


def unregister_capture_participant(comm: CaptureParticipant) -> None:
    if comm in _participants:
        _participants.remove(comm)


@contextlib.contextmanager
def capture_custom_allreduce(recorder=None):
    """Mark CUDA-graph capture for the all-reduce; `recorder` (a PhaseRecorder) gets begin/end events."""
    ctx = recorder.phase("capture_custom_allreduce", log=False) if recorder is not None else contextlib.nullcontext()
    with ctx:
        outermost = _state["depth"] == 0
        if outermost:
            for comm in _participants:
                comm.begin_capture()
        _state["depth"] += 1
        ok = False
        try:
            yield
            ok = True
        finally:
            _state["depth"] -= 1
            if outermost:
                for comm in _participants:
                    comm.end_capture(register=ok)
