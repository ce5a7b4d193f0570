"""Startup phase events: what ran, in which order, nested in what, and for how long.

`LLM.__init__` runs its phases inside `PhaseRecorder.phase(name)`; other code (the SOT counter,
the all-reduce capture context) adds point events. Tests assert the startup order from these
events, never from log text.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("fdlite")


@dataclass
class PhaseEvent:
    kind: str   # "begin", "end" or "point"
    name: str
    time: float
    info: dict = field(default_factory=dict)


class PhaseRecorder:
    def __init__(self) -> None:
        self.events: list[PhaseEvent] = []
        self.durations: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str, log: bool = True):
        """Time a phase; its events nest inside the phases already open."""
        t0 = time.perf_counter()
        self.events.append(PhaseEvent("begin", name, t0))
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.events.append(PhaseEvent("end", name, t1))
            self.durations[name] = self.durations.get(name, 0.0) + (t1 - t0)
            if log:
                logger.info("startup phase %s: %.2f s", name, t1 - t0)

    def point(self, name: str, **info) -> None:
        self.events.append(PhaseEvent("point", name, time.perf_counter(), info))

    def index(self, kind: str, name: str) -> int:
        """Position of the first event (kind, name); ValueError when absent."""
        for i, e in enumerate(self.events):
            if e.kind == kind and e.name == name:
                return i
        raise ValueError(f"no {kind} event named {name!r}")
