"""The device choice and the CPU/GPU dispatch seam, on a CPU machine.

The GPU path runs here with fdlite's GPU op wrappers replaced by numpy versions of their contracts
(`gpu_emulator.py`): what is checked is the wiring (which implementation each op picked, the
arguments the model passes, in-place contracts, graph-mode views, the GPU sampler's host round
trips) and that no Paddle built-in computing op runs on that path. The kernels themselves are
checked on the GPU (tools/gpu/ops_harness.py, tools/gpu/e2e_harness.py).
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import gpu_emulator
from fdlite import LLM, SamplingParams
from fdlite.config import EngineConfig
from fdlite.graph import static_graph
from fdlite.kernels import platform
from fdlite.layers.norm import RMSNorm

COMMON = dict(skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_model_len=256,
              max_num_batched_tokens=96, kv_cache_memory_bytes=1 << 22)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def prompts(n: int = 7, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 500, 40).tolist()  # a prefix longer than two blocks: prefix-cache hits
    lengths = [1, 15, 16, 17, 33, 120, 150][:n]  # across block edges; 120 and 150 are chunked (budget 96)
    out = [rng.integers(3, 500, k).tolist() for k in lengths]
    for i in (3, 4):
        if i < n:
            out[i] = shared + out[i]
    return [{"prompt_token_ids": p} for p in out]


_emulate_gpu = gpu_emulator.install_engine


def _forbid_builtin_compute(monkeypatch) -> None:
    """Make Paddle's computing ops raise: on the Hopper GPUs each would silently do nothing."""
    def refuse(name):
        def f(*a, **k):
            raise AssertionError(f"Paddle built-in {name} ran on the GPU path")
        return f

    for mod, names in ((paddle, ("matmul", "gather", "scatter_", "split", "chunk", "concat", "where", "full", "zeros",
                                 "arange", "rsqrt", "take_along_axis")),
                       (F, ("embedding", "silu", "softmax"))):
        for name in names:
            monkeypatch.setattr(mod, name, refuse(f"{mod.__name__}.{name}"))
    for name in ("astype", "__add__", "__radd__", "__sub__", "__mul__", "__rmul__"):  # y + shared: an add kernel
        monkeypatch.setattr(paddle.Tensor, name, refuse(f"Tensor.{name}"))


# ---- the device option ------------------------------------------------------------------------

def test_device_option_is_validated_and_normalised():
    assert EngineConfig(device="GPU:1").device == "gpu:1"
    assert EngineConfig().device is None
    with pytest.raises(ValueError, match="device must be 'cpu', 'gpu' or 'gpu:N'"):
        EngineConfig(device="cuda")


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="checks the refusal of a CPU-only Paddle build")
def test_gpu_on_a_cpu_build_is_a_clear_error(model_dirs):
    with pytest.raises(ValueError, match="needs a CUDA build of Paddle"):
        LLM(model_dirs["qwen3"], device="gpu", **COMMON)


def test_cpu_choice_is_honoured_and_ops_pick_cpu(model_dirs):
    llm = LLM(model_dirs["qwen3"], device="cpu", **COMMON)
    assert llm.runner.device == "cpu" and platform.current_device() == "cpu"
    picked = {type(m).__name__: m._forward_method.__name__ for m in llm.runner.model.sublayers()
              if hasattr(m, "_forward_method")}
    assert set(picked.values()) == {"forward_cpu"}
    assert {"ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "RMSNorm", "LogitsProcessor",
            "SiluAndMul", "Attention"} <= set(picked)


def test_ops_choose_their_implementation_once_at_construction(monkeypatch):
    cpu_norm = RMSNorm(8)
    gpu_emulator.install(monkeypatch)
    gpu_norm = RMSNorm(8)
    assert cpu_norm._forward_method.__name__ == "forward_cpu"
    assert gpu_norm._forward_method.__name__ == "forward_gpu"
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32))
    np.testing.assert_allclose(gpu_norm(x).numpy(), cpu_norm(x).numpy(), rtol=1e-5, atol=1e-6)
    res_cpu, res_gpu = x * 0.5, x * 0.5
    out_cpu, sum_cpu = cpu_norm(x.clone(), res_cpu)
    xg = x.clone()
    out_gpu, sum_gpu = gpu_norm(xg, res_gpu)
    assert out_gpu is xg and sum_gpu is res_gpu  # the fused GPU form works in place
    np.testing.assert_allclose(out_gpu.numpy(), out_cpu.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sum_gpu.numpy(), sum_cpu.numpy(), rtol=1e-6)


# ---- the GPU path, emulated ----------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_emulated_gpu_path_gives_the_cpu_tokens(model_dirs, family, monkeypatch):
    want = LLM(model_dirs[family], device="cpu", **COMMON).generate(prompts(), GREEDY, use_tqdm=False)
    calls = _emulate_gpu(monkeypatch)
    llm = LLM(model_dirs[family], **COMMON)
    _forbid_builtin_compute(monkeypatch)
    got = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = llm.last_generate_stats
    assert stats["prefix_cache_hit_tokens"] >= 32, stats  # the shared prefix was reused on this path too
    for op in ("embedding", "linear", "rope_qk_norm_cache", "paged_attention", "fused_add_rms_norm_",
               "silu_and_mul", "lm_head_logits", "argmax"):
        assert calls[op] > 0, op


def test_emulated_gpu_path_stores_linear_weights_out_in_from_either_checkpoint_layout(model_dirs, tmp_path,
                                                                                     monkeypatch):
    """The GPU's Linear weights are [out, in] (the decode GEMV reads rows); the loader fills them from a
    Hugging Face ([out, in]) and a Paddle ([in, out], fused names) checkpoint alike, with the CPU's tokens."""
    from hf_models import save_paddle_layout

    from fdlite.layers.linear import Linear

    paddle_dir = save_paddle_layout(model_dirs["ernie45"], str(tmp_path / "paddle"), "ernie.")
    want = LLM(model_dirs["ernie45"], device="cpu", **COMMON).generate(prompts(), GREEDY, use_tqdm=False)
    cpu_llm = LLM(model_dirs["qwen2"], device="cpu", **COMMON)  # kept: a deleted LLM releases its model
    cpu_shapes = {n: list(l.weight.shape) for n, l in cpu_llm.runner.model.named_sublayers() if isinstance(l, Linear)}
    _emulate_gpu(monkeypatch)
    for path in (model_dirs["ernie45"], paddle_dir):
        llm = LLM(path, **COMMON)
        got = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want], path
    gpu_llm = LLM(model_dirs["qwen2"], **COMMON)
    gpu = {n: l for n, l in gpu_llm.runner.model.named_sublayers() if isinstance(l, Linear)}
    assert gpu and set(gpu) == set(cpu_shapes)
    for name, layer in gpu.items():
        assert layer.weight_out_in and list(layer.weight.shape) == cpu_shapes[name][::-1], name


def test_emulated_gpu_graphs_replay_padded_batches(model_dirs, monkeypatch):
    monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    want = LLM(model_dirs["qwen3"], device="cpu", use_cudagraph=False, **COMMON).generate(prompts(), GREEDY, use_tqdm=False)
    calls = _emulate_gpu(monkeypatch)
    # synchronous steps: async scheduling may prepare one step more than it runs (covered in test_async_early_prepare)
    llm = LLM(model_dirs["qwen3"], use_cudagraph=True, async_scheduling=False, **COMMON)
    before = calls["copy_from_host_many"], calls["copy_from_host"]
    got = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = llm.last_generate_stats
    assert stats["cudagraph_replays"] > 0
    assert stats["cudagraph_padded_replays"] > 0
    # every step's inputs (eager and graph steps alike) reach the device in one batched copy call
    assert (calls["copy_from_host_many"] - before[0], calls["copy_from_host"] - before[1]) == (stats["num_steps"], 0)


def test_emulated_gpu_eager_steps_plan_attention_as_their_graphs(model_dirs, monkeypatch):
    """Graphs = eager, bitwise, needs each row's attention kernel and KV split count to be the same in an eager step
    and in the graph it would replay in: an eager step (graphs off) passes the attention op that graph's plan (its
    padded size, max_q_len and max_model_len's tables) instead of its own row count, max_q_len and table width. The
    same jobs on both engines: every attention call's plan inputs agree, step by step. The jobs have decode steps
    padded to a larger graph, and a prompt's last chunk of 2 tokens beside a decode (eagerly, by its own max_q_len,
    the per-token kernel would take it; in its mixed graph the tile kernel does)."""
    monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    _emulate_gpu(monkeypatch)
    rng = np.random.default_rng(4)
    # the second job: 10 + 86 tokens fill the first step's budget of 96, then a decode, 2 tokens and a 1-token prompt
    jobs = [prompts(), [{"prompt_token_ids": rng.integers(3, 500, k).tolist()} for k in (10, 88, 1)]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    plans, outs, steps = [], [], []
    for graphs in (False, True):
        llm = LLM(model_dirs["qwen3"], use_cudagraph=graphs, async_scheduling=False, **COMMON)
        write = llm.runner.buffers.write

        def recording(flat, caches, patch=None, graph=None, write=write):
            steps.append((flat.num_rows, flat.num_decodes, flat.max_q_len, graph))
            return write(flat, caches, patch, graph)

        llm.runner.buffers.write = recording
        gpu_emulator.ATTENTION_PLANS.clear()
        outs.append([])
        for job in jobs:
            outs[-1].append([o.outputs[0].token_ids for o in llm.generate(job, params, use_tqdm=False)])
            stats = llm.last_generate_stats
            assert stats["cudagraph_replays"] == (stats["num_steps"] if graphs else 0)
        plans.append(list(gpu_emulator.ATTENTION_PLANS))
    assert outs[0] == outs[1] and plans[0] == plans[1] and len(plans[0]) > 0
    assert steps and all(graph is not None for *_, graph in steps)  # the eager engine's steps, each with its graph
    decode_sizes = llm.runner.graph_sizes[0]
    assert any(d == rows and rows not in decode_sizes for rows, d, _, _ in steps)  # a padded decode step
    assert any(2 <= q <= 4 and not g[1] for _, _, q, g in steps)  # a short chunk planned as its mixed graph


def test_emulated_gpu_sampler_applies_penalties_and_bans_on_the_device(model_dirs, monkeypatch):
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=False, min_tokens=4, repetition_penalty=1.8,
                             logprobs=3),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, presence_penalty=1.5,
                             frequency_penalty=0.7)]
    ps = prompts(3, seed=5)
    want = LLM(model_dirs["qwen2"], device="cpu", **COMMON).generate(ps, params, use_tqdm=False)
    calls = _emulate_gpu(monkeypatch)
    got = LLM(model_dirs["qwen2"], **COMMON).generate(ps, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert (g.outputs[0].logprobs is None) == (w.outputs[0].logprobs is None)
        for lg, lw in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or []):
            assert lg.keys() == lw.keys()
            assert all(abs(lg[t].logprob - lw[t].logprob) < 1e-4 and lg[t].rank == lw[t].rank for t in lg)
    # Penalties and bans by the device kernels; only the logprob rows' raw logits go to the host, nothing back.
    assert calls["apply_penalties_"] > 0 and calls["scatter_"] > 0
    # (The embedding and the LM head gather rows too: the gathers beyond theirs are the logprob rows'.)
    assert calls["gather_rows"] > calls["lm_head_logits"] + calls["embedding"] and calls["copy_from_host"] == 0


def test_emulated_gpu_sampler_applies_logit_bias_and_allowed_ids_on_the_device(model_dirs, monkeypatch):
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={7: 3.0, 40: -100.0}),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=[3, 9, 27, 81]),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    ps = prompts(3, seed=6)
    want = LLM(model_dirs["qwen2"], device="cpu", **COMMON).generate(ps, params, use_tqdm=False)
    calls = _emulate_gpu(monkeypatch)
    got = LLM(model_dirs["qwen2"], **COMMON).generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert set(want[1].outputs[0].token_ids) <= {3, 9, 27, 81}
    assert calls["scatter_"] > 0 and calls["apply_bitmask_"] > 0 and calls["copy_from_host"] == 0


def test_emulated_gpu_seeded_sampling_follows_the_kernel_rule(model_dirs, monkeypatch):
    """Seeded sampling on the GPU path draws with the kernel's rule (sampling_ref) from (seed, position):
    the same tokens whatever else shares the batch."""
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=5, ignore_eos=True)
    calls = _emulate_gpu(monkeypatch)
    llm = LLM(model_dirs["qwen3"], **COMMON)
    ps = prompts(5, seed=9)
    alone = llm.generate(ps[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    together = llm.generate(ps, [params] + [SamplingParams(temperature=1.0, seed=i, max_tokens=5) for i in range(4)],
                            use_tqdm=False)[0].outputs[0].token_ids
    assert alone == together and len(alone) == 5
    # The rows' sampling parameters reach the device through `upload` (an async copy): Paddle 2.6's to_tensor
    # would wait for the GPU to drain, stalling a step launched ahead.
    assert calls["upload"] >= 6 * 5


# ---- graph_opt_level without SOT ---------------------------------------------------------------

def test_graph_opt_level_without_sot_names_the_reason(monkeypatch):
    class _Sys:
        version_info = (3, 12, 3)

    monkeypatch.setattr(static_graph, "sys", _Sys)
    monkeypatch.setattr(paddle, "__version__", "2.6.2")
    with pytest.raises(ValueError, match=r"graph_opt_level=1 needs SOT, but paddlepaddle 2\.6\.2 translates with SOT "
                                         r"only on Python <= 3\.11, and this is Python 3\.12"):
        static_graph.check_graph_opt_level(1)
    static_graph.check_graph_opt_level(0)  # level 0 needs nothing


# ---- bfloat16 checkpoints where Paddle has no core.frombuffer (Paddle 2.6) -----------------------

def test_bf16_checkpoint_loads_without_frombuffer(tmp_path, monkeypatch):
    """safetensors reads bfloat16 through numpy when Paddle lacks `core.frombuffer` and fails there; fdlite then
    reads the tensor's uint16 bits itself. Both ways must give the same weights, so the same tokens."""
    import torch
    import transformers

    from hf_models import write_random_model

    path = write_random_model(str(tmp_path / "m"), "qwen2", seed=3)
    transformers.AutoModelForCausalLM.from_pretrained(path).to(torch.bfloat16).save_pretrained(path)
    want = LLM(path, device="cpu", **COMMON).generate(prompts(3), GREEDY, use_tqdm=False)
    if hasattr(paddle.base.core, "frombuffer"):
        monkeypatch.delattr(paddle.base.core, "frombuffer")
    got = LLM(path, device="cpu", **COMMON).generate(prompts(3), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_emulated_gpu_sampler_applies_grammar_masks_on_the_device(monkeypatch):
    """Constrained rows (structured outputs) get their bitmask applied by a device kernel, no logits to the host:
    the same tokens as on CPU."""
    from fdlite.sampling_params import StructuredOutputsParams

    common = dict(max_num_seqs=4, max_model_len=128, kv_cache_memory_bytes=1 << 24)
    params = [SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-c]{3}-[0-9]{2}")),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["up", "down"])),
              # min_tokens bans EOS, but a complete grammar allows nothing else: the grammar wins, as on CPU.
              SamplingParams(temperature=0, max_tokens=12, min_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=["up", "down"]))]
    ps = ["one", "two", "three", "four"]
    want = LLM(device="cpu", **common).generate(ps, params, use_tqdm=False)
    calls = _emulate_gpu(monkeypatch)
    got = LLM(**common, async_scheduling=True).generate(ps, params, use_tqdm=False)  # (the GPU default)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    calls.clear()
    # synchronous steps, to count gathers: async scheduling adds its token patch's
    got = LLM(**common, async_scheduling=False).generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert want[0].outputs[0].text[:4] and want[2].outputs[0].text in ("up", "down")
    assert want[3].outputs[0].text in ("up", "down") and want[3].outputs[0].finish_reason == "stop"
    assert calls["apply_bitmask_"] > 0 and calls["copy_from_host"] == 0
    # The embedding's and the LM head's own gathers only: no logits to the host.
    assert calls["gather_rows"] == calls["lm_head_logits"] + calls["embedding"]


def test_async_scheduling_defaults_on_for_a_gpu_and_off_on_cpu(model_dirs, monkeypatch):
    """Unset, `async_scheduling` follows the device: on for a GPU (the host work hides behind the device's
    forward), off on CPU; an explicit value is kept on either. The GPU default gives the CPU's tokens."""
    cpu = LLM(model_dirs["qwen3"], device="cpu", **COMMON)
    assert cpu.config.async_scheduling is False
    want = cpu.generate(prompts(), GREEDY, use_tqdm=False)
    assert LLM(model_dirs["qwen3"], device="cpu", async_scheduling=True, **COMMON).config.async_scheduling is True
    _emulate_gpu(monkeypatch)
    gpu = LLM(model_dirs["qwen3"], **COMMON)
    assert gpu.config.async_scheduling is True
    got = gpu.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert gpu.engine.num_early_prepares > 0
    assert LLM(model_dirs["qwen3"], async_scheduling=False, **COMMON).config.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling must be a bool or None"):
        LLM(model_dirs["qwen3"], async_scheduling="yes", **COMMON)
