"""Text is produced apart from the step loop: lazy (decoded once at the end) and incremental
(token by token) give the same outputs, across joins, leaves and preemption."""

import numpy as np
import pytest

from fdlite import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    # A small cache forces preemption among 12 concurrent sequences.
    return LLM(max_num_seqs=12, max_model_len=256, block_size=16, num_gpu_blocks_override=24)


def _requests(llm, n=24):
    rng = np.random.default_rng(0)
    tok = llm.get_tokenizer()
    words = ["alpha", "beta", "你好", "emoji 🙂", "x = 1", "The end."]
    prompts = [" ".join(rng.choice(words, size=int(rng.integers(1, 8)))) for _ in range(n)]
    # Stop strings taken from what the model writes, so some requests really stop on them.
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    params = []
    for i, out in enumerate(greedy):
        text = out.outputs[0].text
        kind = i % 4
        if kind == 0 and len(text) > 8:
            params.append(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[text[5:8]]))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=int(rng.integers(5, 40)), logprobs=2))
        elif kind == 2 and len(text) > 8:
            params.append(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[text[2:5]],
                                         include_stop_str_in_output=True, min_tokens=3))
        else:
            params.append(SamplingParams(temperature=0.7, top_p=0.9, seed=100 + i, max_tokens=30, ignore_eos=True))
    return prompts, params, tok


def _view(outs):
    return [[(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def test_lazy_and_incremental_detokenization_agree(llm):
    prompts, params, tok = _requests(llm)
    llm.engine.outputs.incremental = False
    lazy = llm.generate(prompts, params, use_tqdm=False)
    assert llm.last_generate_stats["num_preemptions"] > 0  # sequences left and came back
    llm.engine.outputs.incremental = True
    try:
        incremental = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.outputs.incremental = False
    assert _view(lazy) == _view(incremental)
    stopped = [c for o in lazy for c in o.outputs if isinstance(c.stop_reason, str)]
    assert stopped, "no request ended on a stop string"
    for o, p in zip(lazy, params):
        c = o.outputs[0]
        if not isinstance(c.stop_reason, str):
            assert c.text == tok.decode(c.token_ids)  # decoded once, at the end
        elif p.include_stop_str_in_output:
            assert c.text.endswith(p.stop[0])
        else:
            assert p.stop[0] not in c.text
        if p.logprobs is not None:
            assert len(c.logprobs) == len(c.token_ids)
            assert all(lp.decoded_token is not None for entry in c.logprobs for lp in entry.values())
            assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids)),
                                                         abs=1e-3)
        else:
            assert c.cumulative_logprob is None
