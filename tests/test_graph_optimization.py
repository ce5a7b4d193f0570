"""Graph optimization on CPU: SOT levels, the CUDA-graph path through the eager replay backend, startup order.

The CUDA-graph path (static buffers, padding, dispatch by size, verify, capture inside the all-reduce
context, SOT inside capture) is the same code that runs on a GPU; only the graph object differs
(`FDLITE_CUDAGRAPH_BACKEND=eager`, see fdlite/graph/eager_replay.py).
"""

import logging

import numpy as np
import pytest

import fdlite.graph.cudagraph_runner as cudagraph_runner
import fdlite.runner.model_runner as model_runner
from fdlite import LLM, SamplingParams
from fdlite.kvcache.device_memory import DeviceMemory
from fdlite.graph.static_graph import translation_count
from hf_models import load_reference, reference_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
COMMON = dict(max_num_seqs=8, max_model_len=256, skip_tokenizer_init=True)


def prompts(n, seed=0, max_len=80):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=int(k)).tolist() for k in rng.integers(1, max_len, size=n)]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def qwen3(model_dirs):
    return model_dirs["qwen3"]


@pytest.fixture(scope="module")
def eager_tokens(qwen3):
    llm = LLM(qwen3, **COMMON)
    return tokens(llm.generate(prompts(24), GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def sot_llm(qwen3):
    return LLM(qwen3, graph_optimization_config={"graph_opt_level": 1}, **COMMON)


def test_level0_matches_transformers(qwen3, eager_tokens):
    ref = reference_greedy(load_reference(qwen3), prompts(24)[:6], GREEDY.max_tokens)
    assert eager_tokens[:6] == ref


def test_sot_level1_matches_level0(sot_llm, eager_tokens):
    assert sot_llm.startup_report["sot_translations"] > 0  # SOT really translated at startup
    assert tokens(sot_llm.generate(prompts(24), GREEDY, use_tqdm=False)) == eager_tokens


def test_sot_translates_a_bounded_number_of_times(sot_llm):
    before, steps = translation_count(), sot_llm.engine.num_steps
    outs = sot_llm.generate(prompts(200, seed=1), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                            use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert sot_llm.engine.num_steps - steps >= 100  # many steps, many batch shapes
    # Warm-up made the token dimension symbolic: 200 requests of new shapes translate at most twice more.
    assert translation_count() - before <= 2


def test_top_level_use_cudagraph_is_fastdeploys_shorthand():
    from fdlite.config import EngineConfig

    assert EngineConfig(use_cudagraph=True).graph_optimization_config.use_cudagraph is True
    cfg = EngineConfig(use_cudagraph=True, graph_optimization_config='{"graph_opt_level": 1}')
    assert cfg.graph_optimization_config.use_cudagraph and cfg.graph_optimization_config.graph_opt_level == 1
    assert EngineConfig().graph_optimization_config.use_cudagraph is False
    with pytest.raises(ValueError, match="use_cudagraph must be a bool"):
        EngineConfig(use_cudagraph="yes")


def test_graph_opt_level_2_needs_cinn(qwen3):
    with pytest.raises(ValueError, match="graph_opt_level=2 needs a Paddle build with the CINN compiler"):
        LLM(qwen3, graph_optimization_config={"graph_opt_level": 2}, **COMMON)


def test_cudagraph_on_cpu_warns_and_runs_eagerly(qwen3, eager_tokens, caplog, monkeypatch):
    monkeypatch.delenv("FDLITE_CUDAGRAPH_BACKEND", raising=False)
    with caplog.at_level(logging.WARNING, logger="fdlite"):
        llm = LLM(qwen3, graph_optimization_config={"use_cudagraph": True}, **COMMON)
    assert [r for r in caplog.records if "use_cudagraph=True is ignored" in r.getMessage()]
    assert llm.runner.graph_runner is None and llm.startup_report["cudagraph_sizes"] == []
    assert tokens(llm.generate(prompts(24), GREEDY, use_tqdm=False)) == eager_tokens


@pytest.fixture(scope="module")
def graph_llm(qwen3):
    mp = pytest.MonkeyPatch()
    mp.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    try:
        yield LLM(qwen3, graph_optimization_config={"graph_opt_level": 1, "use_cudagraph": True}, **COMMON)
    finally:
        mp.undo()


def test_decode_graphs_give_identical_tokens(graph_llm, eager_tokens):
    assert graph_llm.startup_report["cudagraph_sizes"] == [1, 2, 4, 8]
    before = graph_llm.runner.graph_runner.num_replays
    assert tokens(graph_llm.generate(prompts(24), GREEDY, use_tqdm=False)) == eager_tokens
    assert graph_llm.runner.graph_runner.num_replays > before


def test_startup_order_sot_inside_capture_inside_allreduce_context(graph_llm):
    ph = graph_llm.phases
    order = [ph.index("end", "load_weights"), ph.index("end", "profile_run"), ph.index("end", "kv_cache"),
             ph.index("begin", "capture_custom_allreduce"), ph.index("begin", "cudagraph_capture"),
             ph.index("point", "sot_translate"), ph.index("point", "cudagraph_captured"),
             ph.index("end", "cudagraph_capture"), ph.index("end", "capture_custom_allreduce")]
    assert order == sorted(order)
    # No SOT translation before capture began: the first translation is inside it.
    first_translation = ph.index("point", "sot_translate")
    assert first_translation > ph.index("begin", "cudagraph_capture")
    captured = [e.info["size"] for e in ph.events if e.name == "cudagraph_captured"]
    assert captured == [8, 4, 2, 1]  # largest first, sharing one pool


def test_graph_buffers_keep_their_addresses(graph_llm):
    gr = graph_llm.runner.graph_runner
    ptrs = {k: t.data_ptr() for k, t in gr.buffers.tensors().items()}
    out_ptrs = {s: g.output.data_ptr() for s, g in gr.graphs.items()}
    steps, replays = graph_llm.engine.num_steps, gr.num_replays
    rng = np.random.default_rng(5)
    # Changing batches: sizes 1..8 come and go as requests of different lengths finish.
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(1, 40, size=60)]
    graph_llm.generate(prompts(60, seed=3, max_len=20), params, use_tqdm=False)
    assert graph_llm.engine.num_steps - steps >= 100 and gr.num_replays - replays >= 50
    assert {k: t.data_ptr() for k, t in gr.buffers.tensors().items()} == ptrs
    assert {s: g.output.data_ptr() for s, g in gr.graphs.items()} == out_ptrs


class StaleGraph(cudagraph_runner.EagerReplayGraph):
    """The bug class the self-check exists for: a replay that ignores the current inputs."""

    def replay(self):
        return self.output


def test_verify_rejects_a_graph_that_ignores_new_inputs(qwen3, monkeypatch):
    monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    monkeypatch.setattr(cudagraph_runner, "EagerReplayGraph", StaleGraph)
    with pytest.raises(RuntimeError, match="CUDA graph self-check failed: the decode graph for size 8"):
        LLM(qwen3, graph_optimization_config={"use_cudagraph": True}, **COMMON)
    # With the check off, the broken graph would have shipped.
    LLM(qwen3, graph_optimization_config={"use_cudagraph": True, "verify_cudagraph": False}, **COMMON)


def test_prefill_only_graphs_keyed_by_token_count(qwen3, eager_tokens, monkeypatch):
    monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    llm = LLM(qwen3, graph_optimization_config={"use_cudagraph": True, "cudagraph_only_prefill": True,
                                                 "cudagraph_capture_sizes": [16, 64, 256]}, **COMMON)
    assert llm.startup_report["cudagraph_sizes"] == [16, 64, 256]
    gr = llm.runner.graph_runner
    # Eight short prompts arrive together: the first step is prefill-only and runs in a graph.
    short = prompts(8, seed=7, max_len=20)
    ref = LLM(qwen3, **COMMON).generate(short, GREEDY, use_tqdm=False)
    assert tokens(llm.generate(short, GREEDY, use_tqdm=False)) == tokens(ref)
    assert gr.num_replays >= 1
    assert tokens(llm.generate(prompts(24), GREEDY, use_tqdm=False)) == eager_tokens


def test_gpu_sizing_formula_through_the_startup_path(qwen3, monkeypatch):
    """Feed the profiling step measured-looking numbers, as a GPU would report them."""
    GiB = 1 << 30
    readings = iter([DeviceMemory(8 * GiB, 1 * GiB, 1 * GiB),      # before the temporary cache
                     DeviceMemory(8 * GiB, 1 * GiB + 2**20, 1 * GiB),  # with it
                     DeviceMemory(8 * GiB, 1 * GiB + 2**20, 2 * GiB)])  # after the dummy prefill
    monkeypatch.setattr(model_runner, "device_memory", lambda: next(readings))
    llm = LLM(qwen3, gpu_memory_utilization=0.5, **COMMON)
    per_block = llm.runner.bytes_per_block
    # 8 * 0.5 - (1 GiB + 1 MiB) - (2 GiB - (1 GiB + 1 MiB)) + temporary KV bytes, no graphs.
    assert llm.config.max_num_batched_tokens == 2048  # the chunked-prefill default (8 * 256 fits it)
    lengths = [256] * 8  # max_num_batched_tokens over 8 sequences
    temp_bytes = sum(-(-n // 64) for n in lengths) * per_block
    expected = (4 * GiB - (GiB + 2**20) - (2 * GiB - (GiB + 2**20)) + temp_bytes) // per_block
    assert llm.num_blocks == expected
