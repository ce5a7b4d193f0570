"""How many KV-cache blocks fit: the formula of docs/design.md (section "KV-cache sizing") fed with the profiling run's measured numbers.

available = total * gpu_memory_utilization - used_after_profile
            - (peak_during_profile - allocated_before_profile) + temporary_kv_bytes - graph_reserve

Unlike FastDeploy, CUDA-graph memory is reserved before the cache is sized (`graph_reserve`), so the
default options cannot run out of memory at capture time.
"""

from __future__ import annotations

from dataclasses import dataclass

# Per captured graph: the graph object and its kernel parameters (a documented estimate; the
# activations themselves live in the shared pool, counted once below).
GRAPH_OVERHEAD_BYTES = 4 << 20


@dataclass
class MemoryProfile:
    total: int                # device bytes
    allocated_before: int     # held before the profiling run (weights, temporary KV cache)
    peak_during: int          # most held during the profiling forward
    used_after: int           # held after it (weights + temporary KV cache)
    temporary_kv_bytes: int   # the small cache the profiling run used
    profile_tokens: int       # tokens in the profiling forward

    @property
    def activation_peak(self) -> int:
        """What the profiling forward held beyond what was there before it: its activations at the peak."""
        return self.peak_during - self.allocated_before


def graph_reserve_bytes(profile: MemoryProfile, largest_capture_tokens: int, num_graphs: int,
                        pooled_capture_tokens: int | None = None) -> int:
    """Memory the CUDA graphs will hold: one shared activation pool sized for the largest graph.

    Activations grow with the token count, so the pool is the profiling run's activation peak scaled to
    the largest captured size (never more than the peak itself), plus a fixed overhead per graph.
    Where graphs cannot share a pool (Paddle 2.6's CUDAGraph takes no pool id), each holds its own:
    pass `pooled_capture_tokens`, the sum of all captured sizes, and the scale follows that sum.
    """
    if num_graphs == 0:
        return 0
    activations = max(0, profile.activation_peak)
    scale = min(1.0, largest_capture_tokens / max(1, profile.profile_tokens))
    if pooled_capture_tokens is not None:
        scale = pooled_capture_tokens / max(1, profile.profile_tokens)
    return int(activations * scale) + num_graphs * GRAPH_OVERHEAD_BYTES


def kv_cache_bytes(profile: MemoryProfile, gpu_memory_utilization: float, graph_reserve: int) -> int:
    """Bytes left for the KV cache (docs/design.md, section "KV-cache sizing": the formula, minus the graph reserve)."""
    return int(
        profile.total * gpu_memory_utilization
        - profile.used_after
        - profile.activation_peak
        + profile.temporary_kv_bytes
        - graph_reserve
    )


def sizing_report(profile: MemoryProfile, gpu_memory_utilization: float, graph_reserve: int,
                  available: int) -> dict[str, float]:
    """The numbers behind a measured KV cache's size, in GiB (`LLM.startup_report["kv_sizing"]`): why a model's
    cache holds what it holds, e.g. how much the CUDA-graph reserve took."""
    gib = float(1 << 30)
    return {"total_GiB": round(profile.total / gib, 3), "gpu_memory_utilization": gpu_memory_utilization,
            "used_after_profile_GiB": round(profile.used_after / gib, 3),
            "activation_peak_GiB": round(profile.activation_peak / gib, 3),
            "cudagraph_reserve_GiB": round(graph_reserve / gib, 3), "kv_cache_GiB": round(available / gib, 3)}


def num_blocks_for(available_bytes: int, bytes_per_block: int) -> int:
    return max(0, available_bytes // bytes_per_block)
