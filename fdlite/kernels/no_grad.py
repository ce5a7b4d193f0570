"""`no_grad`: a function run with Paddle's autograd off, at the cost of a context manager.

`@paddle.no_grad()` as a decorator goes through the `decorator` package, which binds every call's arguments to the
function's signature (`inspect.Signature.bind`): tens of microseconds a call on Paddle 2.6, three calls on every
step's critical path (`ModelRunner.execute`, `forward_hidden`, the sampler), where a batch-1 decode step of a small
model has about 0.9 ms of GPU time for all of its host work to hide behind. The `with` form does the same switch.
"""

from __future__ import annotations

import functools

import paddle


def no_grad(fn):
    """`fn` with autograd off while it runs (as `@paddle.no_grad()`, without the per-call signature binding)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with paddle.no_grad():
            return fn(*args, **kwargs)

    return wrapper
