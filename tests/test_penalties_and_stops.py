"""End to end against independent references: repetition, presence and frequency penalties (transformers'
`RepetitionPenaltyLogitsProcessor`, and OpenAI's presence/frequency rule in a few lines of torch), stop ids
under `ignore_eos`, the children of a seeded `n > 1` request, and a prompt whose every block is cached."""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from fdlite import LLM, SamplingParams
from hf_models import load_reference

MAX_NEW = 10
PROMPTS = [[5, 9, 13, 17, 21, 9, 9], [100, 7, 3, 3, 3, 7], [42] * 9, list(range(3, 40))]


@torch.no_grad()
def reference_greedy(model, prompt: list[int], max_new: int, repetition=1.0, presence=0.0, frequency=0.0,
                     repeat_prompt=True, bias: dict[int, float] | None = None, allowed: list[int] | None = None):
    """Greedy decoding of transformers' fp32 logits, one token at a time, with fdlite's logits processors in its
    order written independently: penalties, logit_bias, allowed_token_ids. `repeat_prompt=False`: the
    repetition penalty counts output tokens only (to show a test tells them apart)."""
    ids, out = list(prompt), []
    repeat = RepetitionPenaltyLogitsProcessor(repetition)  # prompt and output tokens, as vLLM
    for _ in range(max_new):
        logits = model(torch.tensor([ids])).logits[:, -1].float()
        seen = ids if repeat_prompt else out
        if seen:
            logits = repeat(torch.tensor([seen]), logits)
        if out:  # OpenAI's rule: output tokens only
            counts = torch.bincount(torch.tensor(out), minlength=logits.shape[-1]).float()
            logits[0] -= frequency * counts + presence * (counts > 0).float()
        for t, b in (bias or {}).items():
            logits[0, t] += b
        if allowed is not None:
            keep = torch.full_like(logits, float("-inf"))
            keep[0, allowed] = logits[0, allowed]
            logits = keep
        token = int(logits.argmax())
        ids.append(token)
        out.append(token)
    return out


@pytest.fixture(scope="module")
def qwen3(model_dirs):
    llm = LLM(model_dirs["qwen3"], skip_tokenizer_init=True, max_num_seqs=8, block_size=16, max_model_len=256)
    return llm, load_reference(model_dirs["qwen3"])


@pytest.mark.parametrize("penalties", [dict(repetition=1.8), dict(presence=1.5), dict(frequency=2.0),
                                       dict(repetition=1.3, presence=0.7, frequency=0.9)])
def test_penalties_match_transformers(qwen3, penalties):
    llm, ref = qwen3
    # A prompt that ends the way the model goes on: its greedy continuation repeats prompt tokens, which only
    # a repetition penalty over the prompt too (vLLM's and transformers' rule) pushes away from.
    prompts = PROMPTS + [PROMPTS[0] + reference_greedy(ref, PROMPTS[0], 3)]
    if "repetition" in penalties:
        assert reference_greedy(ref, prompts[-1], MAX_NEW, **penalties) != reference_greedy(
            ref, prompts[-1], MAX_NEW, **penalties, repeat_prompt=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                            repetition_penalty=penalties.get("repetition", 1.0),
                            presence_penalty=penalties.get("presence", 0.0),
                            frequency_penalty=penalties.get("frequency", 0.0))
    # Each prompt beside an unpenalized request, so a row's penalties are shown to stay its own.
    plain = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts for _ in (0, 1)], [params, plain] * len(prompts),
                        use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs[0::2]]
    want = [reference_greedy(ref, p, MAX_NEW, **penalties) for p in prompts]
    assert got == want
    assert [o.outputs[0].token_ids for o in outs[1::2]] == [reference_greedy(ref, p, MAX_NEW) for p in prompts]
    assert got != [o.outputs[0].token_ids for o in outs[1::2]]  # the penalties changed something


def test_stop_token_ids_still_stop_with_ignore_eos(qwen3):
    """vLLM: ignore_eos ignores EOS only; a stop id still ends the output."""
    llm, _ = qwen3
    free = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    # A prompt whose greedy output has a token first seen after the first two (min_tokens=2 bans stop ids
    # there, which would change those two tokens).
    prompt, tokens, first = next((p, o.outputs[0].token_ids, i) for p, o in zip(PROMPTS, free)
                                 for i, t in enumerate(o.outputs[0].token_ids)
                                 if i >= 2 and t not in o.outputs[0].token_ids[:i])
    stop_at = tokens[first]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[stop_at],
                                      min_tokens=2), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == tokens[: first + 1]


def test_seeded_children_draw_different_tokens_and_repeat(qwen3):
    llm, _ = qwen3
    params = SamplingParams(temperature=1.0, n=4, seed=7, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0]
    children = [c.token_ids for c in first.outputs]
    assert len({tuple(c) for c in children}) == 4, children  # each child its own draw
    again = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == children  # the same seed, the same children


def test_a_prompt_whose_every_block_is_cached_still_computes_its_last_token(qwen3):
    llm, ref = qwen3
    prompt = list(range(50, 82))  # 32 tokens: exactly two blocks of 16
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    want = reference_greedy(ref, prompt, MAX_NEW)
    assert llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids == want
    again = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    st = llm.last_generate_stats
    assert again[0].outputs[0].token_ids == want
    # The first block comes from the cache; the second holds the last token, whose logits pick the next one.
    assert st["prefix_cache_hit_tokens"] == 16 and st["prefill_tokens_computed"] == 16


def test_logit_bias_and_allowed_token_ids_match_a_reference(qwen3):
    llm, ref = qwen3
    bias = {7: 4.0, 11: -100.0, 300: 2.5}
    allowed = [5, 9, 40, 41, 42, 500]
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logit_bias=bias),
              SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, allowed_token_ids=allowed),
              SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == reference_greedy(ref, PROMPTS[0], MAX_NEW, bias=bias)
    assert outs[1].outputs[0].token_ids == reference_greedy(ref, PROMPTS[1], MAX_NEW, allowed=allowed)
    assert set(outs[1].outputs[0].token_ids) <= set(allowed)
    assert outs[2].outputs[0].token_ids == reference_greedy(ref, PROMPTS[2], MAX_NEW)  # its neighbours' rules stay theirs
    forced = llm.generate([{"prompt_token_ids": PROMPTS[3]}], SamplingParams(
        temperature=1.0, seed=1, max_tokens=MAX_NEW, ignore_eos=True, logit_bias={"123": 100}), use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [123] * MAX_NEW  # OpenAI's string keys; +100 decides


def test_bad_logit_bias_and_allowed_ids(qwen3):
    llm, _ = qwen3
    with pytest.raises(ValueError, match=r"logit_bias\[5\] must be <= 100"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2,
                        [SamplingParams(max_tokens=2, allowed_token_ids=[10**7]), SamplingParams(max_tokens=2)],
                        use_tqdm=False)
    assert "allowed_token_ids: token id 10000000 is outside the vocabulary" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 2


@pytest.fixture(scope="module")
def with_tokenizer():
    return LLM(max_num_seqs=4, max_model_len=128)  # the built-in model: random weights, the real tokenizer


def _round_trips(tok, ids: list[int]) -> str | None:
    """The text of `ids` when it encodes back to exactly them (and is a plain word), else None."""
    text = tok.decode(ids)
    ok = text.strip().isalpha() and tok.encode(text, add_special_tokens=False) == ids
    return text if ok else None


def test_bad_words_are_never_generated(with_tokenizer):
    llm = with_tokenizer
    tok = llm.get_tokenizer()
    params = dict(temperature=0, max_tokens=24, ignore_eos=True)
    free = llm.generate(["Once upon a time"], SamplingParams(**params), use_tqdm=False)[0].outputs[0].token_ids
    # One token, banned wherever it would come: the greedy output then never holds it.
    i, word = next((i, w) for i, t in enumerate(free) if (w := _round_trips(tok, [t])) is not None)
    out = llm.generate(["Once upon a time"], SamplingParams(bad_words=[word], **params), use_tqdm=False)[0]
    assert free[i] not in out.outputs[0].token_ids and out.outputs[0].token_ids[:i] == free[:i]
    # Two tokens a, b: b is banned right after a, and only there (vLLM's rule, on the output). Sampling among
    # a and b alone (allowed_token_ids), a seed whose free output has "a b" somewhere never has it with the ban.
    word = next(w for w in ("Hello world", "zebra", "pineapple") if len(tok.encode(w, add_special_tokens=False)) == 2)
    a, b = tok.encode(word, add_special_tokens=False)

    def has_pair(ids):
        return any(x == a and y == b for x, y in zip(ids, ids[1:]))

    sampled = dict(temperature=1.0, max_tokens=24, ignore_eos=True, allowed_token_ids=[a, b])
    seed = next(s for s in range(50) if has_pair(llm.generate(["Once upon a time"], SamplingParams(
        seed=s, **sampled), use_tqdm=False)[0].outputs[0].token_ids))
    got = llm.generate(["Once upon a time"], SamplingParams(seed=seed, bad_words=[word], **sampled),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert not has_pair(got) and a in got[:-1]  # a still comes; b just never right after it


def test_bad_words_need_a_tokenizer(qwen3):
    llm, _ = qwen3
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2, bad_words=["x"]),
                       use_tqdm=False)[0]
    assert "bad_words need a tokenizer" in out.error
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[""])
