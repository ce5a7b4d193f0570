"""`GraphOptBackend`: what `support_graph_optimization` dispatches to once the runner attaches it.

Level 0 runs the layer's dynamic forward; levels 1 and 2 run it translated by SOT (static_graph.py).
CUDA graphs sit one level up, in `CudaGraphRunner`, which calls the layer (and so this backend)
when it warms up and captures. `num_calls` counts the calls into the translated function, so tests
can tell that steps really run through SOT rather than only that SOT translated at startup.
"""

from __future__ import annotations

import weakref

from fdlite.graph.static_graph import to_static


class GraphOptBackend:
    """Attached to `layer` as `layer.graph_opt_backend`. At level 0 it reaches the layer through a weak
    reference (layer -> backend -> layer would be a cycle); the translated function of levels 1 and 2 binds the
    layer itself, so there the cycle exists until `ModelRunner.close` detaches the backend."""

    def __init__(self, layer, graph_opt_level: int):
        self.graph_opt_level = graph_opt_level
        dynamic = type(layer).dynamic_forward
        if graph_opt_level >= 1:
            self._forward = to_static(layer, dynamic, graph_opt_level)
        else:
            layer_ref = weakref.ref(layer)
            self._forward = lambda **kwargs: dynamic(layer_ref(), **kwargs)
        self.num_calls = 0  # calls into the translated function (level >= 1)

    def __call__(self, **kwargs):
        if self.graph_opt_level >= 1:
            self.num_calls += 1
        return self._forward(**kwargs)
