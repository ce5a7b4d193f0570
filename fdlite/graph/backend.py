"""`GraphOptBackend`: what `support_graph_optimization` dispatches to once the runner attaches it.

Level 0 runs the layer's dynamic forward; levels 1 and 2 run it translated by SOT (static_graph.py).
CUDA graphs sit one level up, in `CudaGraphRunner`, which calls the layer (and so this backend)
when it warms up and captures.
"""

from __future__ import annotations

import types

from fdlite.graph.static_graph import to_static


class GraphOptBackend:
    def __init__(self, layer, graph_opt_level: int):
        self.graph_opt_level = graph_opt_level
        dynamic = type(layer).dynamic_forward
        self._forward = to_static(layer, dynamic, graph_opt_level) if graph_opt_level >= 1 else types.MethodType(dynamic, layer)

    def __call__(self, **kwargs):
        return self._forward(**kwargs)
