"""graph_opt_level 1 and 2: the model's inner layer translated to a static graph by SOT.

Level 1 is `paddle.jit.to_static(..., full_graph=False)`: SOT translates Python bytecode into static
subgraphs, breaking the graph where it must (at paged attention, see graph_break.py) and running
those parts eagerly. Level 2 adds Paddle's CINN compiler, which only CINN-enabled builds have.

SOT translates a code object again whenever a guard fails (a new shape, a new Python value). The
token and batch dimensions become symbolic after the first change (SOT's dynamic shapes, on by
default in Paddle 3), so the count of translations stays bounded; `translation_count()` exposes it.
"""

from __future__ import annotations

import sys
import types
from typing import Callable

import paddle


def translation_count() -> int:
    """How many code objects SOT has translated in this process (0 where SOT is unavailable)."""
    try:
        from paddle.jit.sot.opcode_translator.executor.executor_cache import OpcodeExecutorCache
    except ImportError:
        return 0
    return OpcodeExecutorCache().translate_count


def sot_unavailable_reason() -> str | None:
    """Why this Paddle and Python cannot translate with SOT, or None when they can.

    Paddle 2.x's SOT runs on Python up to 3.11; on 3.12 its `to_static(full_graph=False)` only warns and
    switches to whole-function AST translation (a different backend, which fdlite's graph breaks do not
    fit), so that is refused here rather than run silently."""
    try:
        import paddle.jit.sot  # noqa: F401, PLC0415
    except ImportError as e:
        return f"this Paddle build (paddlepaddle {paddle.__version__}) has no SOT translator ({e})"
    major = int(paddle.__version__.split(".")[0] or 0)
    if 0 < major < 3 and sys.version_info >= (3, 12):
        return (f"paddlepaddle {paddle.__version__} translates with SOT only on Python <= 3.11, and this is Python "
                f"{sys.version_info[0]}.{sys.version_info[1]} (Paddle would fall back to AST translation)")
    return None


def check_graph_opt_level(level: int) -> None:
    """Stop with a clear message when this Paddle build cannot run `level`."""
    if level >= 1:
        reason = sot_unavailable_reason()
        if reason is not None:
            raise ValueError(f"graph_optimization_config.graph_opt_level={level} needs SOT, but {reason}. Use "
                             "graph_opt_level=0 (CUDA graphs need no SOT), or Paddle 3.x / Python <= 3.11.")
    if level == 2 and not paddle.is_compiled_with_cinn():
        raise ValueError(
            f"graph_optimization_config.graph_opt_level=2 needs a Paddle build with the CINN compiler; "
            f"this one (paddlepaddle {paddle.__version__}) has none. Use graph_opt_level=1 (SOT static graph) "
            "or install a CINN-enabled paddlepaddle-gpu."
        )


def to_static(layer: paddle.nn.Layer, dynamic_forward: Callable, level: int) -> Callable:
    """`dynamic_forward` bound to `layer`, translated for `level` (1: SOT, 2: SOT + CINN)."""
    check_graph_opt_level(level)
    build_strategy = None
    backend = None
    if level == 2:
        build_strategy = paddle.static.BuildStrategy()
        build_strategy.build_cinn_pass = True
        backend = "CINN"
    bound = types.MethodType(dynamic_forward, layer)
    return paddle.jit.to_static(bound, full_graph=False, backend=backend, build_strategy=build_strategy)
