"""`support_graph_optimization`: the class decorator that opts a model's inner layer into graph optimization.

As in FastDeploy (its graph-optimization guide; docs/design.md, section "Sources"), it goes on the `nn.Layer` subclass holding the
embedding, the decoder layers and the final norm, and the layer is then called with keyword arguments.
Until a backend is attached the layer runs its own (dynamic) forward; the model runner attaches a
`GraphOptBackend` that runs the SOT-translated forward and replays CUDA graphs.
"""

from __future__ import annotations

import functools


def support_graph_optimization(cls):
    """Make `cls.forward` dispatch to `self.graph_opt_backend` when one is attached."""
    dynamic_forward = cls.forward

    @functools.wraps(dynamic_forward)
    def forward(self, **kwargs):
        backend = self.__dict__.get("graph_opt_backend")
        if backend is None:
            return dynamic_forward(self, **kwargs)
        return backend(**kwargs)

    cls.dynamic_forward = dynamic_forward
    cls.forward = forward
    cls.supports_graph_optimization = True
    return cls
