"""Keep an op out of SOT's translated graphs: it runs eagerly between the translated pieces.

Paged attention reads Python-side batch structure (how many decode rows, each prefill's span) that
changes every step. Translated, each new structure would fail a guard and translate again, without
bound. Marked opaque, SOT breaks the graph at the call and runs the op eagerly with its own frame
evaluation turned off, so what SOT guards on is only the tensors around it. This is what FastDeploy
gets from attention being a custom op.

The two hooks used are SOT internals (`add_break_graph_function`, `no_eval_frame`); they are wrapped
here, once, so that a Paddle release that moves them breaks one import, not the models.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


def opaque_to_sot(fn: F) -> F:
    """Return `fn` wrapped so that SOT neither inlines nor translates it."""
    try:
        from paddle.jit.sot.utils import no_eval_frame
        from paddle.jit.sot.utils.paddle_api_config import add_break_graph_function
    except ImportError:  # a Paddle without SOT: nothing translates anyway
        return fn
    wrapped = functools.wraps(fn)(no_eval_frame(fn))
    add_break_graph_function(wrapped)
    return wrapped
