"""Startup phase events: what ran, in which order, nested in what, and for how long.

`LLM.__init__` runs its phases inside `PhaseRecorder.phase(name)`; other code (the SOT counter,
the all-reduce capture context) adds point events. Tests assert the startup order from these
events, never from log text.

`probes` are counters read by the recorder itself at every phase's begin and end (the event's
`info`): `LLM` reads SOT's own translation count there, so "nothing was translated before capture
began" is checked from the counter, not from events that the code under test chose to emit.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("fdlite")


@dataclass
class PhaseEvent:
    kind: str   # "begin", "end" or "point"
    name: str
    time: float
    info: dict = field(default_factory=dict)


class PhaseRecorder:
    def __init__(self, probes: dict[str, Callable[[], int]] | None = None) -> None:
        self.events: list[PhaseEvent] = []
        self.durations: dict[str, float] = {}
        self.probes = dict(probes or {})

    def _read_probes(self) -> dict:
        return {name: read() for name, read in self.probes.items()}

    @contextlib.contextmanager
    def phase(self, name: str, log: bool = True):
        """Time a phase; its events nest inside the phases already open."""
        t0 = time.perf_counter()
        self.events.append(PhaseEvent("begin", name, t0, self._read_probes()))
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.events.append(PhaseEvent("end", name, t1, self._read_probes()))
            self.durations[name] = self.durations.get(name, 0.0) + (t1 - t0)
            if log:
                logger.debug("startup phase %s: %.2f s", name, t1 - t0)

    def point(self, name: str, **info) -> None:
        self.events.append(PhaseEvent("point", name, time.perf_counter(), info))

    def probe_at(self, kind: str, name: str, probe: str):
        """A probe's reading at the first (kind, name) event, kind "begin" or "end"."""
        return self.events[self.index(kind, name)].info[probe]

    def index(self, kind: str, name: str) -> int:
        """Position of the first event (kind, name); ValueError when absent."""
        for i, e in enumerate(self.events):
            if e.kind == kind and e.name == name:
                return i
        raise ValueError(f"no {kind} event named {name!r}")
