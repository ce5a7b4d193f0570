"""Graph optimization on CPU: SOT levels, the CUDA-graph path through the eager replay backend, startup order.

The CUDA-graph path (static buffers, padding, dispatch by size, verify, capture inside the all-reduce
context, SOT inside capture) is the same code that runs on a GPU; only the graph object differs
(`FDLITE_CUDAGRAPH_BACKEND=eager`, see fdlite/graph/eager_replay.py).
"""

import logging

import numpy as np
import paddle
import pytest

import fdlite.runner.cudagraph_runner as cudagraph_runner
import fdlite.runner.model_runner as model_runner
from fdlite import LLM, SamplingParams
from fdlite.kvcache.device_memory import DeviceMemory
from fdlite.graph.static_graph import translation_count
from env_patch import EnvMonkeyPatch
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
def eager_llm(qwen3):
    return LLM(qwen3, use_cudagraph=False, **COMMON)


@pytest.fixture(scope="module")
def eager_tokens(eager_llm):
    return tokens(eager_llm.generate(prompts(24), GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def sot_llm(qwen3):
    return LLM(qwen3, graph_optimization_config={"graph_opt_level": 1}, **COMMON)


def test_level0_matches_transformers(qwen3, eager_tokens):
    ref = reference_greedy(load_reference(qwen3), prompts(24)[:6], GREEDY.max_tokens)
    assert eager_tokens[:6] == ref


def test_sot_level1_matches_level0(sot_llm, eager_tokens):
    assert sot_llm.startup_report["sot_translations"] > 0  # SOT really translated at startup
    assert tokens(sot_llm.generate(prompts(24), GREEDY, use_tqdm=False)) == eager_tokens
    # ... and every step of the run went through the translated function, not the dynamic forward.
    stats = sot_llm.last_generate_stats
    assert stats["sot_calls"] == stats["num_steps"] > 0


def test_a_second_sot_engine_with_another_vocabulary_in_the_process(sot_llm, model_dirs, tmp_path, eager_tokens):
    """Translating a model whose embedding table has another row count makes SOT treat that dimension as
    symbolic; the embedding must not trip over it (F.embedding's padding-index check did: "padding_idx must be
    within [--1, -1)"). Both engines keep giving their eager tokens."""
    from hf_models import write_random_model

    other = write_random_model(str(tmp_path / "v700"), "qwen3", seed=4, vocab_size=700)
    want = tokens(LLM(other, use_cudagraph=False, **COMMON).generate(prompts(6), GREEDY, use_tqdm=False))
    second = LLM(other, graph_optimization_config={"graph_opt_level": 1}, **COMMON)
    assert tokens(second.generate(prompts(6), GREEDY, use_tqdm=False)) == want
    assert tokens(sot_llm.generate(prompts(24), GREEDY, use_tqdm=False)) == eager_tokens


def test_sot_translates_in_its_warmup_phase_only(sot_llm):
    """Translation counts read by the phase recorder from SOT's own counter at each phase's start."""
    ph = sot_llm.phases
    at = {phase: ph.probe_at("begin", phase, "sot_translations")
          for phase in ("load_weights", "profile_run", "kv_cache", "graph_optimization", "sot_warmup")}
    assert len(set(at.values())) == 1, at  # nothing translated before the warm-up began
    end = ph.probe_at("end", "sot_warmup", "sot_translations")
    assert end > at["sot_warmup"]
    assert ph.probe_at("end", "graph_optimization", "sot_translations") == end
    assert sot_llm.startup_report["sot_translations"] == end - at["load_weights"]


def test_sot_translates_a_bounded_number_of_times(sot_llm):
    before, steps = translation_count(), sot_llm.engine.num_steps
    outs = sot_llm.generate(prompts(200, seed=1), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                            use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert sot_llm.engine.num_steps - steps >= 100  # many steps, many batch shapes
    # Warm-up made the token dimension symbolic: 200 requests of new shapes translate at most twice more.
    assert translation_count() - before <= 2
    # Not because SOT sat idle: every one of those steps called the translated function.
    assert sot_llm.last_generate_stats["sot_calls"] == sot_llm.engine.num_steps - steps


def test_top_level_use_cudagraph_is_fastdeploys_shorthand():
    from fdlite.config import EngineConfig

    assert EngineConfig(use_cudagraph=True).graph_optimization_config.use_cudagraph is True
    cfg = EngineConfig(use_cudagraph=True, graph_optimization_config='{"graph_opt_level": 1}')
    assert cfg.graph_optimization_config.use_cudagraph and cfg.graph_optimization_config.graph_opt_level == 1
    # Default: None, on where graphs can run (FastDeploy's default since 2.3); False turns them off.
    assert EngineConfig().graph_optimization_config.use_cudagraph is None
    assert EngineConfig(use_cudagraph=False, graph_optimization_config={"use_cudagraph": True}
                        ).graph_optimization_config.use_cudagraph is False
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
    mp = EnvMonkeyPatch()
    mp.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    try:
        yield LLM(qwen3, graph_optimization_config={"graph_opt_level": 1, "use_cudagraph": True}, **COMMON)
    finally:
        mp.undo()


def test_decode_and_mixed_graphs_give_identical_tokens(graph_llm, eager_tokens):
    assert graph_llm.startup_report["cudagraph_sizes"] == [1, 2, 4, 8]
    # Steps with prefill tokens: the default token counts, cut to max_num_batched_tokens (2048 here).
    assert graph_llm.startup_report["cudagraph_mixed_sizes"] == [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
    decode, mixed = graph_llm.runner.graph_runner, graph_llm.runner.mixed_graph_runner
    before = decode.num_replays, mixed.num_replays
    assert tokens(graph_llm.generate(prompts(24), GREEDY, use_tqdm=False)) == eager_tokens
    stats = graph_llm.last_generate_stats
    assert decode.num_replays > before[0] and mixed.num_replays > before[1]
    # Every step replayed a graph: 24 prompts over 8 rows join while others decode (mixed steps).
    assert stats["cudagraph_replays"] == decode.num_replays + mixed.num_replays - sum(before) == stats["num_steps"]
    assert stats["cudagraph_mixed_replays"] == mixed.num_replays - before[1]
    # The stand-in's replays call the translated function (SOT) too.
    assert stats["sot_calls"] == stats["num_steps"]


def test_padded_decode_graphs_give_identical_tokens(qwen3, monkeypatch):
    """Batches of 7, 6, 5 and 3 run in the graphs of 8 and 4: the tokens are eager's, and the padding rows
    write nothing outside the scratch block (the KV cache equals eager's everywhere else)."""
    monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    graph = LLM(qwen3, graph_optimization_config={"use_cudagraph": True}, **COMMON)
    eager = LLM(qwen3, use_cudagraph=False, **COMMON)  # fresh too, so both hand out the same blocks in the same order
    # Eight prompts prefill together; one finishes after each step, so decode batches shrink 7, 6, ..., 1.
    batch = prompts(8, seed=2, max_len=30)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in range(1, 9)]
    for llm in (graph, eager):  # the same start: capture and verify wrote dummy KV into the graph LLM's cache
        llm.runner.kv_cache.poison_blocks(list(range(llm.num_blocks)))
    assert tokens(graph.generate(batch, params, use_tqdm=False)) == tokens(eager.generate(batch, params, use_tqdm=False))
    gr = graph.runner.graph_runner
    assert gr.replays_by_size == {(8, 7): 1, (8, 6): 1, (8, 5): 1, (4, 4): 1, (4, 3): 1, (2, 2): 1, (1, 1): 1}
    assert gr.num_padded_replays == 4
    # The first step (eight prompts, 8-29 tokens each) ran in the token-count graph of 256, padded.
    assert graph.runner.mixed_graph_runner.num_replays == 1 and graph.last_generate_stats["cudagraph_padded_replays"] == 5
    for got, want in zip(graph.runner.kv_cache.caches, eager.runner.kv_cache.caches):
        for g, w in zip(got, want):  # K and V; the last block is the scratch one
            np.testing.assert_allclose(g.numpy()[:-1], w.numpy()[:-1], rtol=1e-4, atol=1e-4)


def test_a_replaced_static_buffer_is_caught_at_replay(graph_llm):
    """The eager stand-in binds its inputs at capture, as a real graph binds addresses: a buffer
    replaced by a new tensor (instead of written in place) fails the replay."""
    buf = graph_llm.runner.graph_runner.buffers.input_ids
    saved = buf.tensor, buf.host
    buf.tensor = saved[0].clone()
    buf.host = np.from_dlpack(buf.tensor)
    try:
        with pytest.raises(RuntimeError, match=r"static graph inputs \['input_ids'\] are not the tensors captured"):
            graph_llm.generate(prompts(2), GREEDY, use_tqdm=False)
    finally:
        buf.tensor, buf.host = saved


def test_startup_order_sot_inside_capture_inside_allreduce_context(graph_llm):
    ph = graph_llm.phases
    order = [ph.index("end", "load_weights"), ph.index("end", "profile_run"), ph.index("end", "kv_cache"),
             ph.index("begin", "capture_custom_allreduce"), ph.index("begin", "cudagraph_capture"),
             ph.index("point", "sot_translate"), ph.index("point", "cudagraph_captured"),
             ph.index("end", "cudagraph_capture"), ph.index("end", "capture_custom_allreduce"),
             # the self-check replays after the context: the custom all-reduce registers the graphs' buffers as it exits
             ph.index("begin", "cudagraph_verify")]
    assert order == sorted(order)
    # No SOT translation before capture began, read from SOT's own counter at each phase's start
    # (not from the "sot_translate" points, which the capture code emits itself).
    at = {phase: ph.probe_at("begin", phase, "sot_translations")
          for phase in ("load_weights", "profile_run", "kv_cache", "graph_optimization", "capture_custom_allreduce",
                        "cudagraph_capture")}
    assert len(set(at.values())) == 1, at
    assert ph.probe_at("end", "cudagraph_capture", "sot_translations") > at["cudagraph_capture"]
    first_translation = ph.index("point", "sot_translate")
    assert first_translation > ph.index("begin", "cudagraph_capture")
    captured = [(e.info["kind"], e.info["size"]) for e in ph.events if e.name == "cudagraph_captured"]
    # Largest first in each kind (one pool where Paddle shares one), decode graphs then token-count graphs.
    assert captured == [("decode", s) for s in (8, 4, 2, 1)] + [
        ("mixed", s) for s in sorted(graph_llm.startup_report["cudagraph_mixed_sizes"], reverse=True)]


def test_graph_buffers_keep_their_addresses(graph_llm, eager_llm):
    gr = graph_llm.runner.graph_runner
    ptrs = {k: t.data_ptr() for k, t in gr.buffers.tensors().items()}
    graphs = dict(gr.graphs)
    outputs = {s: g.output for s, g in gr.graphs.items()}
    out_ptrs = {s: g.output.data_ptr() for s, g in gr.graphs.items()}
    steps, replays, padded = graph_llm.engine.num_steps, gr.num_replays, gr.num_padded_replays
    rng = np.random.default_rng(5)
    # Changing batches: sizes 1..8 come and go as requests of different lengths finish.
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(1, 40, size=60)]
    batch = prompts(60, seed=3, max_len=20)
    got = tokens(graph_llm.generate(batch, params, use_tqdm=False))
    assert graph_llm.engine.num_steps - steps >= 100 and gr.num_replays - replays >= 50
    assert gr.num_padded_replays - padded >= 10
    assert got == tokens(eager_llm.generate(batch, params, use_tqdm=False))
    assert {k: t.data_ptr() for k, t in gr.buffers.tensors().items()} == ptrs
    # Nothing was captured again: the same graphs, each replaying into the output it captured.
    assert gr.graphs == graphs and all(g.output is outputs[s] for s, g in gr.graphs.items())
    assert {s: g.output.data_ptr() for s, g in gr.graphs.items()} == out_ptrs


class StaleGraph(cudagraph_runner.EagerReplayGraph):
    """The bug class the self-check exists for: a replay that ignores the current inputs."""

    def replay(self):
        return self.output


def test_verify_rejects_a_graph_that_ignores_new_inputs(qwen3, eager_tokens, monkeypatch):
    monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    monkeypatch.setattr(cudagraph_runner, "EagerReplayGraph", StaleGraph)
    with pytest.raises(RuntimeError, match="CUDA graph self-check failed: the decode graph for size 8"):
        LLM(qwen3, graph_optimization_config={"use_cudagraph": True}, **COMMON)
    # With the check off, the broken graph would have shipped: it starts, and its outputs are wrong.
    broken = LLM(qwen3, graph_optimization_config={"use_cudagraph": True, "verify_cudagraph": False}, **COMMON)
    got = tokens(broken.generate(prompts(24), GREEDY, use_tqdm=False))
    assert broken.runner.graph_runner.num_replays > 0
    assert got != eager_tokens


def test_verify_replays_each_graph_on_other_inputs_than_its_capture(qwen3, monkeypatch):
    """The self-check writes a batch of its own (other context lengths, for a token-count graph another split)
    before it replays: a graph replayed on its capture's inputs would pass whatever it ignores."""
    monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    written = []
    real_write = cudagraph_runner.CudaGraphRunner._write

    def recording(self, batch, size, patch=None):
        written.append((self.kind, size, batch.seq_lens_kv.tobytes() + batch.cu_seqlens_q.tobytes()))
        return real_write(self, batch, size, patch)
    monkeypatch.setattr(cudagraph_runner.CudaGraphRunner, "_write", recording)
    llm = LLM(qwen3, graph_optimization_config={"use_cudagraph": True}, **COMMON)
    kinds_sizes = {(k, s) for k, s, _ in written}
    assert {k for k, _ in kinds_sizes} == {"decode", "mixed"}
    full = COMMON["max_num_seqs"] * COMMON["max_model_len"]  # every row full: the one split there is
    for kind, size in kinds_sizes:
        batches = [b for k, s, b in written if (k, s) == (kind, size)]
        assert len(batches) == 2, (kind, size)  # the capture's, then the check's
        assert batches[0] != batches[1] or (kind == "mixed" and size == full), (kind, size)
    llm.close()


class CaptureSplitGraph(cudagraph_runner.EagerReplayGraph):
    """FastDeploy's prefill-graph bug as a stand-in: the replay runs with the split of the tokens into rows that
    was there at capture (a kernel whose launch grid was sized from it), whatever the batch's split is now."""

    def capture(self, fn, static_inputs=None):
        bufs = static_inputs()
        self._split = {k: bufs[k].numpy().copy() for k in ("cu_seqlens_q", "token_rows")}
        return super().capture(fn, static_inputs)

    def replay(self):
        bufs = self._static_inputs()
        now = {k: bufs[k].numpy().copy() for k in self._split}
        for k, v in self._split.items():
            paddle.assign(paddle.to_tensor(v), output=bufs[k])
        try:
            return super().replay()
        finally:
            for k, v in now.items():
                paddle.assign(paddle.to_tensor(v), output=bufs[k])


def test_verify_replays_a_mixed_graph_on_another_split(qwen3, monkeypatch):
    monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    monkeypatch.setattr(cudagraph_runner, "EagerReplayGraph", CaptureSplitGraph)
    with pytest.raises(RuntimeError, match="CUDA graph self-check failed: the mixed graph for size"):
        LLM(qwen3, graph_optimization_config={"cudagraph_capture_sizes": [1], "cudagraph_mixed_capture_sizes": [64]},
            **COMMON)


def test_a_churning_job_replays_nearly_every_step_and_matches_eager(qwen3, monkeypatch):
    """More requests than rows, of mixed lengths: sequences join while others decode, so most steps mix prefill
    chunks and decodes. With token-count graphs they replay (padded), and the tokens are eager's."""
    monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    rng = np.random.default_rng(9)
    batch = prompts(48, seed=9, max_len=120)
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(2, 30, size=48)]
    opts = dict(COMMON, max_num_batched_tokens=96)  # long prompts take several chunks
    eager = LLM(qwen3, use_cudagraph=False, **opts)
    want = tokens(eager.generate(batch, params, use_tqdm=False))
    graph = LLM(qwen3, **opts)  # graphs by default where they can run
    assert graph.startup_report["cudagraph_mixed_sizes"] == [16, 32, 64, 96]
    got = tokens(graph.generate(batch, params, use_tqdm=False))
    st = graph.last_generate_stats
    assert got == want
    mixed = graph.runner.mixed_graph_runner
    assert st["cudagraph_replays"] == st["num_steps"] and st["cudagraph_mixed_replays"] >= st["num_steps"] // 3
    assert len({tokens for (_, tokens) in mixed.replays_by_size}) >= 10  # many token counts, padded up


def test_prefill_only_graphs_keyed_by_token_count(qwen3, eager_tokens, monkeypatch):
    monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    llm = LLM(qwen3, graph_optimization_config={"use_cudagraph": True, "cudagraph_only_prefill": True,
                                                 "cudagraph_capture_sizes": [16, 64, 256]}, **COMMON)
    assert llm.startup_report["cudagraph_mixed_sizes"] == [16, 64, 256] and llm.runner.graph_runner is None
    gr = llm.runner.mixed_graph_runner
    # Eight short prompts arrive together: the first step is prefill-only and runs in a graph.
    short = prompts(8, seed=7, max_len=20)
    ref = LLM(qwen3, use_cudagraph=False, **COMMON).generate(short, GREEDY, use_tqdm=False)
    assert tokens(llm.generate(short, GREEDY, use_tqdm=False)) == tokens(ref)
    assert gr.num_replays >= 1
    assert tokens(llm.generate(prompts(24), GREEDY, use_tqdm=False)) == eager_tokens


def test_gpu_sizing_formula_through_the_startup_path(qwen3, monkeypatch):
    """Feed the profiling step measured-looking numbers, as a GPU would report them."""
    GiB = 1 << 30
    readings = iter([DeviceMemory(8 * GiB, 1 * GiB, 1 * GiB),      # before the temporary cache (also: memory is measured)
                     DeviceMemory(8 * GiB, 1 * GiB + 2**20, 1 * GiB),  # with it
                     DeviceMemory(8 * GiB, 1 * GiB + 2**20, 2 * GiB)])  # after the dummy prefill
    monkeypatch.setattr(model_runner, "device_memory", lambda: next(readings))
    llm = LLM(qwen3, gpu_memory_utilization=0.5, use_cudagraph=False, **COMMON)
    per_block = llm.runner.bytes_per_block
    # 8 * 0.5 - (1 GiB + 1 MiB) - (2 GiB - (1 GiB + 1 MiB)) + temporary KV bytes, no graphs.
    assert llm.config.max_num_batched_tokens == 2048  # the chunked-prefill default (8 * 256 fits it)
    lengths = [256] * 8  # max_num_batched_tokens over 8 sequences
    temp_bytes = sum(-(-n // 64) for n in lengths) * per_block
    expected = (4 * GiB - (GiB + 2**20) - (2 * GiB - (GiB + 2**20)) + temp_bytes) // per_block
    assert llm.num_blocks == expected
