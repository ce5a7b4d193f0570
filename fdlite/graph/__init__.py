"""Graph optimization: SOT static graphs (graph_opt_level 1), CINN (level 2), CUDA graphs per padded size."""

from fdlite.graph.decorator import support_graph_optimization

__all__ = ["support_graph_optimization"]
