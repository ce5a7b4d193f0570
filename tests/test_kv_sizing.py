"""The KV-cache sizing formula (DESIGN.md) fed with measured-looking numbers."""

from fdlite.kvcache.sizing import GRAPH_OVERHEAD_BYTES, MemoryProfile, graph_reserve_bytes, kv_cache_bytes, num_blocks_for

GiB = 1 << 30
PROFILE = MemoryProfile(total=80 * GiB, allocated_before=17 * GiB, peak_during=21 * GiB, used_after=17 * GiB,
                        temporary_kv_bytes=1 * GiB, profile_tokens=8192)


def test_formula_without_graphs():
    # 80 * 0.9 - 17 - (21 - 17) + 1 = 52 GiB
    assert kv_cache_bytes(PROFILE, 0.9, graph_reserve=0) == 52 * GiB
    assert num_blocks_for(52 * GiB, 2 * GiB) == 26


def test_graph_reserve_scales_activation_peak_to_largest_capture():
    # Activation peak 4 GiB for 8192 tokens; largest graph 256 tokens -> 4 GiB / 32, plus overhead per graph.
    assert graph_reserve_bytes(PROFILE, 256, 35) == GiB // 8 + 35 * GRAPH_OVERHEAD_BYTES
    assert graph_reserve_bytes(PROFILE, 16384, 1) == 4 * GiB + GRAPH_OVERHEAD_BYTES  # never above the peak
    assert graph_reserve_bytes(PROFILE, 256, 0) == 0


def test_graph_reserve_comes_out_of_the_cache():
    reserve = graph_reserve_bytes(PROFILE, 512, 20)
    assert kv_cache_bytes(PROFILE, 0.9, reserve) == 52 * GiB - reserve


def test_no_negative_block_count():
    assert num_blocks_for(-5, 1024) == 0
