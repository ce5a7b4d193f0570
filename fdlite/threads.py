"""Stopping the engine's worker threads when it closes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def shutdown_pool(pool: ThreadPoolExecutor) -> None:
    """Shut `pool` down: queued work is cancelled, running work finishes, its threads end and are joined.

    Called from one of the pool's own threads (a finalizer the garbage collector happened to run there), the
    join of that thread is skipped; the others still end."""
    try:
        pool.shutdown(wait=True, cancel_futures=True)
    except RuntimeError:  # "cannot join current thread"
        pass
