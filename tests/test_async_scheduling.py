"""Async scheduling (the next step scheduled while this one runs) gives the same outputs as without,
across joins, leaves (stops of every kind), preemption and prefix-cache hits."""

import numpy as np
import pytest

from fdlite import LLM, SamplingParams


def _requests(n=40, seed=0):
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 500, size=40).tolist()  # a common prefix: prefix-cache hits
    prompts, params = [], []
    for i in range(n):
        tail = rng.integers(3, 500, size=int(rng.integers(1, 60))).tolist()
        prompts.append({"prompt_token_ids": (shared if i % 3 == 0 else []) + tail})
        kind = i % 5
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 30)), ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.8, seed=i, max_tokens=25, ignore_eos=True,
                                         repetition_penalty=1.2))
        elif kind == 2:  # stop ids that greedy decoding of random weights hits often enough
            params.append(SamplingParams(temperature=0, max_tokens=30, stop_token_ids=list(range(3, 120)),
                                         min_tokens=2))
        elif kind == 3:
            params.append(SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=20, logprobs=1, n=2))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=1))
    return prompts, params


def _view(outs):
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _logprobs(outs):
    return np.array([np.nan if c.cumulative_logprob is None else c.cumulative_logprob for o in outs for c in o.outputs])


def _assert_same(got, want):
    assert _view(got) == _view(want)
    # Logprobs within 1e-3: a different batch composition may change float rounding, never a token.
    np.testing.assert_allclose(_logprobs(got), _logprobs(want), rtol=0, atol=1e-3, equal_nan=True)


@pytest.mark.parametrize("blocks", [None, 14])  # 14 blocks of 16 tokens: preemption
def test_async_scheduling_gives_the_same_outputs(model_dirs, blocks):
    prompts, params = _requests()
    common = dict(skip_tokenizer_init=True, max_num_seqs=8, block_size=16, max_model_len=160,
                  max_num_batched_tokens=128, num_gpu_blocks_override=blocks)
    sync = LLM(model_dirs["qwen3"], **common)
    want = sync.generate(prompts, params, use_tqdm=False)
    stats_sync = sync.last_generate_stats
    asyn = LLM(model_dirs["qwen3"], async_scheduling=True, **common)
    got = asyn.generate(prompts, params, use_tqdm=False)
    _assert_same(got, want)
    assert {c.finish_reason for o in want for c in o.outputs} == {"stop", "length"}
    if blocks is not None:
        assert stats_sync["num_preemptions"] > 0 and asyn.last_generate_stats["num_preemptions"] > 0
    assert asyn.last_generate_stats["prefix_cache_hit_tokens"] > 0
    # The engine is left empty: a second call on the same LLM works and agrees.
    again = asyn.generate(prompts[:5], params[:5], use_tqdm=False)
    _assert_same(again, want[:5])


def test_closing_the_stream_early_leaves_the_engine_usable(model_dirs):
    llm = LLM(model_dirs["llama"], skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_model_len=256,
              async_scheduling=True)
    prompts, params = _requests(12, seed=1)
    stream = llm.generate_stream(prompts, params, use_tqdm=False)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished() and llm.engine.input_batch.num_running == 0
    assert len(llm.generate(prompts[:3], params[:3], use_tqdm=False)) == 3


@pytest.mark.parametrize("gpu", [False, True])
def test_async_prefix_hits_never_read_unwritten_slots(model_dirs, monkeypatch, gpu):
    """Async scheduling registers a full block in the prefix cache when its tokens are known, while the step that
    writes its last slot may still be queued; a sequence can only hit it in a later step, which runs after that
    write. Checked with every block no one may read poisoned (NaN keys), preemption and shared prefixes, on CPU
    and on the emulated GPU path with graphs: the same outputs as the synchronous engine, nothing NaN."""
    import gpu_emulator

    prompts, params = _requests()
    common = dict(skip_tokenizer_init=True, max_num_seqs=8, block_size=16, max_model_len=160,
                  max_num_batched_tokens=128, num_gpu_blocks_override=14)
    if gpu:  # (the GPU sampler draws other random numbers than the CPU's: both engines on the same path)
        monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
        gpu_emulator.install_engine(monkeypatch)
    want = LLM(model_dirs["qwen3"], async_scheduling=False, **common).generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv("FDLITE_DEBUG_POISON_FREED_BLOCKS", "1")
    asyn = LLM(model_dirs["qwen3"], async_scheduling=True, **common)
    got = asyn.generate(prompts, params, use_tqdm=False)
    _assert_same(got, want)
    stats = asyn.last_generate_stats
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert asyn.engine.num_early_prepares > 0
