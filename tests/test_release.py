"""An `LLM` gives back what it holds: on `close()`, at the end of a `with` block, and on `del llm`.

Notebooks create an `LLM`, delete it and create another in the same process; the second must get the same
KV cache (vLLM's most reported offline problem is that it does not). On CPU Paddle's allocator returns freed
memory to the system, so the process's resident memory shows a leak directly; the weak references show
what holds on, and that nothing is kept alive by a reference cycle (they die on `del` with the garbage
collector off). The GPU side (CUDA statistics, graph pools) is `tools/gpu/e2e_harness.py memory`.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest

import gpu_emulator
from fdlite import LLM, SamplingParams
from fdlite.kvcache import device_memory
from fdlite.kvcache.device_memory import DeviceMemory, profile_peak
from fdlite.runner import model_runner
from fdlite.runner.model_runner import ModelRunner
from fdlite.sampling_params import StructuredOutputsParams

MiB = 1 << 20
# The built-in model (78 MB of float32 weights) and a 384 MiB cache: a leak of either shows in the RSS. No
# tokenizer: loading Qwen3's leaves ~150 MB with the allocator (measured: a plateau, the object itself is freed).
BIG = dict(max_num_seqs=4, max_model_len=256, kv_cache_memory_bytes=384 * MiB, skip_tokenizer_init=True)
SMALL = dict(max_num_seqs=4, block_size=16, max_model_len=256, max_num_batched_tokens=96, kv_cache_memory_bytes=4 * MiB)
PARAMS = SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


def run_a_little(llm: LLM, n: int = 3) -> None:
    outs = llm.generate([[5, 6, 7, 8]] * n, PARAMS, use_tqdm=False)  # ids every test model has
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


def handles(llm: LLM) -> dict[str, weakref.ref]:
    """Weak references to what an engine holds (the objects, and the big tensors)."""
    runner = llm.runner
    objs = {"llm": llm, "engine": llm.engine, "runner": runner, "model": runner.model, "sampler": runner.sampler,
            "kv_cache": runner.kv_cache, "k_cache_0": runner.kv_cache.caches[0][0],
            "embedding": runner.model.model.embed_tokens.weight, "a_linear_layer": runner.model.model.layers[0].mlp,
            "input_ids_buffer": runner.buffers.input_ids.tensor, "worker": llm.engine.worker}
    if runner.graph_runner is not None:
        objs["graph_runner"] = runner.graph_runner
    return {k: weakref.ref(v) for k, v in objs.items()}


def alive(refs: dict[str, weakref.ref]) -> list[str]:
    return sorted(k for k, r in refs.items() if r() is not None)


def test_three_rounds_in_one_process_free_their_memory_and_get_the_same_cache():
    gc.collect()
    start = rss_mib()
    blocks, grown, kept = [], [], []
    for _ in range(3):
        llm = LLM(**BIG)
        run_a_little(llm)
        grown.append(rss_mib() - start)
        blocks.append(llm.num_blocks)
        del llm
        gc.collect()
        kept.append(rss_mib() - start)
    assert blocks[0] > 0 and blocks == [blocks[0]] * 3
    # One engine is ~550 MiB here (measured); after each delete the process is back within 64 MiB of where it
    # started (first-use costs, ~20 MiB measured), and it does not creep up round after round.
    assert min(grown) > 450, grown
    assert max(kept) < 64, (grown, kept)
    assert kept[2] - kept[0] < 16, (grown, kept)


@pytest.mark.parametrize("options", [
    {},
    {"async_scheduling": True},
    {"graph_optimization_config": {"graph_opt_level": 1, "use_cudagraph": True}},
], ids=["eager", "async", "sot+graphs"])
def test_del_frees_the_engine_without_the_garbage_collector(options, model_dirs, monkeypatch):
    """No reference cycle keeps the engine alive: with the collector off, `del llm` alone frees everything
    (bound methods kept on their own objects, graph functions and backends referring back are the usual cycles).
    The random Qwen3 of test_graph_optimization.py: SOT marks the vocabulary dimension dynamic when a second model
    of another vocabulary size runs through it in one process, and then fails to translate (Paddle 3.3.1)."""
    monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    llm = LLM(model_dirs["qwen3"], **SMALL, skip_tokenizer_init=True, **options)
    run_a_little(llm, n=9)
    refs = handles(llm)
    gc.collect()
    gc.disable()
    try:
        del llm
        assert alive(refs) == []
    finally:
        gc.enable()


def test_close_frees_memory_that_references_still_point_at():
    """A traceback or a kept layer keeps an object, not its memory: close() frees the tensors in place."""
    llm = LLM(**{**SMALL, "max_num_seqs": 20}, async_scheduling=True)
    run_a_little(llm, n=20)  # 16 or more sampled rows: the sampler's draw threads start too
    runner, engine = llm.runner, llm.engine
    kv = runner.kv_cache.caches[0][0]
    weight = runner.model.model.layers[0].mlp.down_proj.weight
    cos = runner.model.model.layers[0].self_attn.attn.rotary.cos
    threads = [*engine._executor._threads, *runner.sampler._pool._threads]
    assert threads and all(t.is_alive() for t in threads)
    llm.close()
    assert llm.closed and runner.closed
    assert not kv._is_initialized() and not weight._is_initialized() and not cos._is_initialized()
    assert runner.kv_cache is None and runner.model is None and llm.engine is None and llm.runner is None
    assert not any(t.is_alive() for t in threads)
    assert engine._executor is None and runner.sampler._pool is None


def test_close_twice_with_block_and_use_after_close():
    with LLM(**SMALL) as llm:
        run_a_little(llm)
        assert not llm.closed
    assert llm.closed
    llm.close()  # a second close does nothing
    for call in (lambda: llm.generate("Hi", use_tqdm=False), lambda: llm.generate_stream("Hi"),
                 lambda: llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False), llm.reset_prefix_cache):
        with pytest.raises(RuntimeError, match=r"closed \(close\(\)"):
            call()


def test_close_while_a_stream_is_open_stops_it_with_the_same_error():
    llm = LLM(**SMALL)
    stream = llm.generate_stream([[5, 6, 7]] * 3, SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(stream)


def test_a_failed_start_releases_the_weights(monkeypatch):
    closed = []
    real = ModelRunner.close
    monkeypatch.setattr(ModelRunner, "close", lambda self: (closed.append(self), real(self)))
    with pytest.raises(ValueError, match="KV cache holds"):
        LLM(**{**SMALL, "kv_cache_memory_bytes": 64 * 1024})
    assert len(closed) == 1 and closed[0].model is None and closed[0].kv_cache is None


def test_emulated_gpu_close_frees_graphs_device_tables_and_the_grammar_thread(monkeypatch):
    """The GPU path's extra holdings: CUDA graphs (eager stand-in here), the sampler's device token tables."""
    gpu_emulator.install_engine(monkeypatch)
    monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    llm = LLM(**SMALL, use_cudagraph=True)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=4, repetition_penalty=1.3) for i in range(3)]
    params.append(SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    llm.generate(["Is it?"] * 4, params, use_tqdm=False)
    runner = llm.runner
    graphs = list(runner.graph_runner.graphs.values())
    tables = runner.sampler._gpu.tables
    counts = tables.counts
    grammar_threads = list(runner.bitmasks._pool._threads)
    assert graphs and counts._is_initialized() and grammar_threads
    refs = handles(llm)
    llm.close()
    assert all(g.output is None and g._fn is None for g in graphs)
    assert not counts._is_initialized() and tables.counts is None and runner.sampler._gpu is None
    assert not any(t.is_alive() for t in grammar_threads)
    del llm, runner, graphs, tables
    assert alive(refs) == []


def test_del_at_interpreter_exit_is_quiet(tmp_path):
    """A live LLM at exit (one in a reference cycle too) ends the process without "Exception ignored in"."""
    script = tmp_path / "exit.py"
    script.write_text(
        "from fdlite import LLM, SamplingParams\n"
        f"llm = LLM(**{SMALL!r}, async_scheduling=True)\n"
        "llm.generate([[5, 6, 7]] * 20, SamplingParams(temperature=0.8, max_tokens=3), use_tqdm=False)\n"
        "llm.me = llm  # a cycle: only the collector or the exit would free it\n"
        "other = LLM(**" + repr(SMALL) + ")\n"
        "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                          os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


# ---- sizing a second engine on Paddle 2.6 (no peak reset) ------------------------------------------------------

GiB = 1 << 30


def test_profile_peak_without_a_reset_takes_the_tighter_bound_and_keeps_it(monkeypatch):
    monkeypatch.setattr(device_memory, "_STALE_PEAK_ACTIVATIONS", {})
    first = DeviceMemory(80 * GiB, 2 * GiB, peak=5 * GiB, reserved=4 * GiB)
    assert profile_peak(first, 2 * GiB, fresh=True, key=("m",)) == 5 * GiB  # a reset peak is the forward's own
    assert profile_peak(DeviceMemory(80 * GiB, 2 * GiB, 5 * GiB), 2 * GiB, fresh=False, key=("m",)) == 5 * GiB
    assert profile_peak(first, 2 * GiB, fresh=False, key=("m",)) == 4 * GiB  # min(peak, reserved)
    # The next engine of the same model in this process: the high-water mark is the first one's KV cache.
    stale = DeviceMemory(80 * GiB, 2 * GiB, peak=72 * GiB, reserved=int(4.5 * GiB))
    assert profile_peak(stale, 2 * GiB, fresh=False, key=("m",)) == 4 * GiB
    assert profile_peak(stale, 2 * GiB, fresh=False, key=("other",)) == int(4.5 * GiB)


def test_second_engine_on_paddle_26_gets_the_same_cache(monkeypatch):
    """Through the startup path: a GPU whose allocator peak cannot be reset and still shows the first engine."""
    monkeypatch.setattr(device_memory, "_STALE_PEAK_ACTIVATIONS", {})
    monkeypatch.setattr(model_runner, "reset_peak_memory", lambda: False)
    blocks = []
    for high_water in (300 * MiB, 7 * GiB):  # round 2: the first engine's cache is the process's peak
        readings = iter([DeviceMemory(GiB, 100 * MiB, high_water, reserved=100 * MiB),
                         DeviceMemory(GiB, 101 * MiB, high_water, reserved=101 * MiB),
                         DeviceMemory(GiB, 101 * MiB, high_water, reserved=300 * MiB)])
        monkeypatch.setattr(model_runner, "device_memory", lambda: next(readings))
        with LLM(gpu_memory_utilization=0.4, max_num_seqs=8, max_model_len=256, skip_tokenizer_init=True) as llm:
            blocks.append(llm.num_blocks)
    assert blocks[0] > 0 and blocks[1] == blocks[0]
