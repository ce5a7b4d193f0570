"""The engine's worker threads: how they share the GIL while they run, and stopping them when it closes."""

from __future__ import annotations

import contextlib
import sys
from concurrent.futures import ThreadPoolExecutor

# Python's GIL switch interval while the engine's step thread and its own thread both run (async scheduling). At
# the default 5 ms, a thread that gave the GIL up in a C call (every Paddle op does) waits for the other thread's
# Python work to reach a blocking call before it runs again: the step thread's launch of the next forward then
# queues behind the engine thread's output processing, and the GPU idles (H100, batch 1: 1.10-1.51 ms a token for
# 0.9 ms of GPU work, varying run to run). A short interval bounds that wait.
ASYNC_SWITCH_INTERVAL_S = 2e-4


@contextlib.contextmanager
def async_switch_interval(enabled: bool = True):
    """Python's switch interval at most ASYNC_SWITCH_INTERVAL_S inside (when `enabled`), restored after."""
    old = sys.getswitchinterval()
    if enabled:
        sys.setswitchinterval(min(old, ASYNC_SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def shutdown_pool(pool: ThreadPoolExecutor) -> None:
    """Shut `pool` down: queued work is cancelled, running work finishes, its threads end and are joined.

    Called from one of the pool's own threads (a finalizer the garbage collector happened to run there), the
    join of that thread is skipped; the others still end."""
    try:
        pool.shutdown(wait=True, cancel_futures=True)
    except RuntimeError:  # "cannot join current thread"
        pass
