"""kv_cache_dtype="fp8": e4m3 K/V with a float32 scale per token and KV head (fdlite/kvcache/fp8_cache.py).

- The store: each vector comes back within e4m3's rounding of its own scale; zero and huge vectors too.
- Sizing: the same byte budget holds 4d / (d + 4) times the blocks of a float32 cache.
- Quality, as issue 25 asks: the prefill logprob error against transformers fp32 (prompts in chunks, so later
  chunks read their prefix from the FP8 cache) next to what transformers' own bf16 gives against fp32
  (docs/benchmarks.md, "FP8 KV cache"); and the same logprobs as transformers fp32 whose attention reads K / V
  rounded as the FP8 cache stores them (`hf_models.FP8_KV_ATTENTION`): the error is the format's, none is added.
- Bookkeeping: preemption (recompute), prefix-cache hits and poisoned free blocks give the FP8 engine's own
  tokens exactly; bad values are refused with the option's name; FastDeploy's kv_cache_quant_type is accepted.
- The GPU path (emulated: the kernels' contracts in numpy) gives the CPU FP8 engine's tokens.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

import gpu_emulator
from fdlite import LLM, SamplingParams
from fdlite.config import EngineConfig
from fdlite.kvcache.cache_tensors import bytes_per_block
from fdlite.kvcache.fp8_cache import E4M3_MAX, Fp8Cache
from hf_models import fp8_kv_reference_logprobs, prompt_logprob_errors

COMMON = dict(skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_model_len=256, device="cpu")


def test_vectors_come_back_within_e4m3_rounding_of_their_own_scale():
    rng = np.random.default_rng(0)
    cache = Fp8Cache([5, 2, 4, 32])  # 40 slots x 32 dims
    vals = rng.standard_normal((6, 32)).astype(np.float32) * np.array([[1], [1e-3], [1e4], [0], [7], [1]], np.float32)
    vals[5, 3] = 300.0  # one outlier: only its own vector's scale grows
    rows = np.array([0, 7, 13, 21, 38, 39], np.int64)
    cache.write(paddle.to_tensor(rows), paddle.to_tensor(vals))
    got = cache.read(paddle.to_tensor(rows[::-1].copy())).numpy()[::-1]
    scale = np.abs(vals).max(axis=1, keepdims=True) / E4M3_MAX
    bound = np.abs(vals) * 2.0**-4 + scale * 2.0**-9  # half a step of e4m3: 3 mantissa bits, subnormals below 2^-6
    assert np.all(np.abs(got - vals) <= bound + 1e-30)
    assert np.all(got[3] == 0)
    np.testing.assert_allclose(cache.scale.numpy().reshape(-1)[rows[:3]], scale[:3, 0], rtol=1e-6)
    assert np.abs(got[0] - vals[0]).max() > 0  # it is really stored in 8 bits
    # rows never written read as zeros (scale 0)
    assert np.all(cache.read(paddle.to_tensor(np.array([1, 2], np.int64))).numpy() == 0)


def test_the_same_budget_holds_4d_over_d_plus_4_times_the_blocks(model_dirs):
    budget = 1 << 22
    auto = LLM(model_dirs["qwen3"], kv_cache_memory_bytes=budget, **COMMON)
    fp8 = LLM(model_dirs["qwen3"], kv_cache_memory_bytes=budget, kv_cache_dtype="fp8", **COMMON)
    c = fp8.model_config
    per = bytes_per_block(c.num_hidden_layers, 16, c.num_key_value_heads, c.head_dim, "float32", "fp8")
    assert per == 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * (c.head_dim + 4)
    assert fp8.num_blocks == budget // per
    assert fp8.num_blocks / auto.num_blocks == pytest.approx(4 * c.head_dim / (c.head_dim + 4), rel=0.01)
    assert isinstance(fp8.runner.kv_cache.caches[0][0], Fp8Cache)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_prefill_logprob_error_next_to_transformers_bf16(model_dirs, family):
    rng = np.random.default_rng({"qwen3": 5, "llama": 6}[family])
    prompts = [rng.integers(3, 250, n).tolist() for n in (70, 45, 23)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    # 32 tokens a step: the 70-token prompt is prefilled in three chunks, reading its prefix from the cache.
    fp8 = LLM(model_dirs[family], kv_cache_dtype="fp8", max_num_batched_tokens=32, **COMMON)
    outs = fp8.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours, theirs = prompt_logprob_errors(model_dirs[family], prompts, [o.prompt_logprobs for o in outs])
    # An FP8 cache under a float32 model: its error is the cache's alone. e4m3 keeps 3 mantissa bits to bf16's 8;
    # on these random models it was 3.3-4.1x transformers' bf16 error (0.08-0.14 vs 0.02-0.04). A misread scale or
    # row would be off by whole units.
    assert 0 < max(ours) <= 6 * max(theirs), (ours, theirs)
    exact = LLM(model_dirs[family], max_num_batched_tokens=32, **COMMON).generate(
        [{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
    assert max(prompt_logprob_errors(model_dirs[family], prompts[:1], [exact.prompt_logprobs])[0]) < 1e-3  # exact


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_prefill_logprobs_equal_transformers_with_e4m3_kv(model_dirs, family):
    """fdlite's FP8 cache against transformers fp32 whose K / V are rounded as that cache stores them (e4m3, a scale
    amax / 448 per token and KV head): the same logprobs to float32 rounding, chunked prefill or not, while both are
    whole percents away from the fp32 model (so the rounding is there, and it is the same rounding)."""
    rng = np.random.default_rng({"qwen3": 5, "llama": 6}[family])
    prompts = [rng.integers(3, 250, n).tolist() for n in (70, 45, 23)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    ref8 = fp8_kv_reference_logprobs(model_dirs[family], prompts)
    for step_tokens in (32, 256):  # the 70-token prompt in three chunks (its prefix read back from the cache), or one
        fp8 = LLM(model_dirs[family], kv_cache_dtype="fp8", max_num_batched_tokens=step_tokens, **COMMON)
        outs = fp8.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        diff = [abs(o.prompt_logprobs[i][p[i]].logprob - r[i - 1])
                for p, o, r in zip(prompts, outs, ref8) for i in range(1, len(p))]
        # float32 rounding apart, except where a K / V value that differs from transformers' in its last bits sits
        # at an e4m3 rounding boundary and rounds the other way (one 2^-4 step of one element): rare, and small
        assert np.percentile(diff, 90) < 1e-5 and np.mean(diff) < 5e-4 and max(diff) < 1e-2, (step_tokens, max(diff))
        fp8.close()
    ours, _ = prompt_logprob_errors(model_dirs[family], prompts, [o.prompt_logprobs for o in outs])
    assert np.mean(ours) > 1e-2 and max(ours) > 2e-2  # the e4m3 rounding itself, against fp32


def test_fp8_cache_steps_run_the_cpp_attention_op(model_dirs, monkeypatch):
    """The CPU engine's FP8 cache takes the C++ attention op (it reads e4m3 rows in place), as float32 caches do, not
    the Paddle-op reference, whose gathers copy every step's context."""
    from fdlite.kernels import cpu_attention  # noqa: PLC0415

    if not cpu_attention.available():
        pytest.skip("the C++ attention op cannot be built here")
    calls = []
    real = cpu_attention.paged_attention

    def counting(q, k_cache, *args, **kwargs):
        calls.append(isinstance(k_cache, Fp8Cache))
        return real(q, k_cache, *args, **kwargs)
    monkeypatch.setattr(cpu_attention, "paged_attention", counting)
    llm = LLM(model_dirs["qwen2"], kv_cache_dtype="fp8", **COMMON)
    calls.clear()  # the profiling run aside
    llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(temperature=0, max_tokens=4),
                 use_tqdm=False)
    assert calls and all(calls), calls


def test_preemption_prefix_hits_and_poisoned_blocks_give_the_same_tokens(model_dirs, monkeypatch):
    rng = np.random.default_rng(9)
    shared = rng.integers(3, 250, 40).tolist()
    prompts = [shared + rng.integers(3, 250, n).tolist() for n in (5, 30, 12, 20)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ps = [{"prompt_token_ids": p} for p in prompts]
    want = LLM(model_dirs["qwen2"], kv_cache_dtype="fp8", enable_prefix_caching=False, **COMMON).generate(
        ps, params, use_tqdm=False)
    monkeypatch.setenv("FDLITE_DEBUG_POISON_FREED_BLOCKS", "1")
    # 14 blocks of 16 tokens for 4 rows of up to 94 tokens: rows are preempted and recomputed.
    small = LLM(model_dirs["qwen2"], kv_cache_dtype="fp8", num_gpu_blocks_override=14, **{**COMMON, "max_model_len": 128})
    got = small.generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = small.last_generate_stats
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0


def test_bad_values_are_refused_and_fastdeploys_name_is_accepted():
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or fp8"):
        EngineConfig(kv_cache_dtype="int4")
    for alias in ("fp8", "FP8_E4M3", "float8_e4m3fn"):
        assert EngineConfig(kv_cache_dtype=alias).kv_cache_dtype == "fp8"
    assert EngineConfig(kv_cache_quant_type="float8_e4m3fn").kv_cache_dtype == "fp8"
    assert EngineConfig(kv_cache_quant_type="none").kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_quant_type must be float8_e4m3fn"):
        EngineConfig(kv_cache_quant_type="int8")
    with pytest.raises(ValueError, match="disagree"):
        EngineConfig(kv_cache_dtype="fp8", kv_cache_quant_type="none")


@pytest.mark.parametrize("graphs", [False, True])
def test_emulated_gpu_path_writes_and_reads_the_fp8_cache_as_the_cpu_does(model_dirs, graphs, monkeypatch):
    """The GPU path's FP8 cache write and attention (their contracts in numpy: tests/gpu_emulator.py) give the CPU
    FP8 engine's tokens, with chunked prefill, preemption and prefix hits; with graphs, through the capture path."""
    ps = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((5, 40, 77, 93))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    small = {**COMMON, "max_model_len": 128, "num_gpu_blocks_override": 14, "max_num_batched_tokens": 32}
    want = LLM(model_dirs["qwen3"], kv_cache_dtype="fp8", **small).generate(ps, params, use_tqdm=False)
    if graphs:
        monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    calls = gpu_emulator.install_engine(monkeypatch)
    llm = LLM(model_dirs["qwen3"], kv_cache_dtype="fp8", use_cudagraph=graphs, async_scheduling=False,
              **{**small, "device": None})
    got = llm.generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert calls["rope_qk_norm_cache_fp8"] > 0 and calls["paged_attention_fp8"] > 0
    assert calls["rope_qk_norm_cache"] == 0 and calls["paged_attention"] == 0
    assert llm.last_generate_stats["num_preemptions"] > 0


def test_fdlite_imports_where_paddle_has_no_float8():
    """Paddle 2.6 (the GPU host framework) has no float8 dtype: importing the engine must not need one."""
    import subprocess
    import sys

    code = ("import paddle\n"
            "del paddle.float8_e4m3fn\n"
            "paddle.__all__ = [n for n in paddle.__all__ if n != 'float8_e4m3fn']\n"
            "import fdlite.llm, fdlite.kvcache.fp8_cache as f\n"
            "print('ok', hasattr(paddle, 'float8_e4m3fn'))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-2:] == ["ok", "False"]
