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
    # Logprobs to 1e-3: a different batch composition may change float rounding, never a token.
    return [[(c.token_ids, c.finish_reason, c.stop_reason,
              None if c.cumulative_logprob is None else round(c.cumulative_logprob, 3)) for c in o.outputs]
            for o in outs]


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
    assert _view(got) == _view(want)
    assert {c.finish_reason for o in want for c in o.outputs} == {"stop", "length"}
    if blocks is not None:
        assert stats_sync["num_preemptions"] > 0 and asyn.last_generate_stats["num_preemptions"] > 0
    assert asyn.last_generate_stats["prefix_cache_hit_tokens"] > 0
    # The engine is left empty: a second call on the same LLM works and agrees.
    again = asyn.generate(prompts[:5], params[:5], use_tqdm=False)
    assert _view(again) == _view(want[:5])


def test_closing_the_stream_early_leaves_the_engine_usable(model_dirs):
    llm = LLM(model_dirs["llama"], skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_model_len=256,
              async_scheduling=True)
    prompts, params = _requests(12, seed=1)
    stream = llm.generate_stream(prompts, params, use_tqdm=False)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished() and llm.engine.input_batch.num_running == 0
    assert len(llm.generate(prompts[:3], params[:3], use_tqdm=False)) == 3
