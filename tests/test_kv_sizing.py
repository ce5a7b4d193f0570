"""The KV-cache sizing formula (docs/design.md, section "KV-cache sizing") fed with measured-looking numbers."""

from fdlite.kvcache.sizing import (GRAPH_OVERHEAD_BYTES, MemoryProfile, graph_reserve_bytes, kv_cache_bytes,
                                   num_blocks_for, sizing_report)

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


def test_sizing_report_gives_the_formula_s_terms():
    """What LLM.startup_report["kv_sizing"] shows: the profile's terms and the reserve, in GiB."""
    reserve = 3 * GiB // 2
    report = sizing_report(PROFILE, 0.9, reserve, kv_cache_bytes(PROFILE, 0.9, reserve))
    assert report == {"total_GiB": 80.0, "gpu_memory_utilization": 0.9, "used_after_profile_GiB": 17.0,
                      "activation_peak_GiB": 4.0, "cudagraph_reserve_GiB": 1.5, "kv_cache_GiB": 50.5}


def test_no_negative_block_count():
    assert num_blocks_for(-5, 1024) == 0


def test_budget_above_what_a_step_can_hold_still_starts(model_dirs):
    """An explicit token budget larger than max_num_seqs * max_model_len: the profiling run clamps to what
    one step can ever hold instead of making rows longer than max_model_len."""
    from fdlite import LLM, SamplingParams

    llm = LLM(model_dirs["qwen3"], max_model_len=64, max_num_seqs=2, max_num_batched_tokens=1000,
              enable_chunked_prefill=True, skip_tokenizer_init=True)
    out = llm.generate([[5] * 60], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_the_runner_keeps_the_report_of_its_measured_sizing(model_dirs):
    """The engine's measured sizing (GPU) leaves its numbers on the runner, which the startup report shows; the CPU
    byte budget measures nothing and shows None."""
    from fdlite import LLM

    llm = LLM(model_dirs["qwen3"], max_model_len=64, max_num_seqs=2, skip_tokenizer_init=True)
    assert llm.startup_report["kv_sizing"] is None
    runner = llm.runner
    blocks = runner._local_num_blocks(PROFILE)
    available = kv_cache_bytes(PROFILE, runner.config.gpu_memory_utilization, 0)
    assert blocks == num_blocks_for(available, runner.bytes_per_block)
    assert runner.kv_sizing == sizing_report(PROFILE, runner.config.gpu_memory_utilization, 0, available)
