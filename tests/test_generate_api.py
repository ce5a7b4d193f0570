"""`LLM.generate` / `LLM.chat` behaviour through the public API, on the built-in default model."""

import numpy as np
import pytest

from fdlite import LLM, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4, max_model_len=512)


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_text_prompts_in_order_with_text(llm):
    prompts = ["Hello, my name is", "The capital of France is", "你好", "def f(x):"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    tok = llm.get_tokenizer()
    for o in outs:
        assert isinstance(o, RequestOutput) and o.finished
        assert o.prompt_token_ids == tok.encode(o.prompt)
        c = o.outputs[0]
        assert len(c.token_ids) == 24 and c.finish_reason == "length"
        assert c.text == tok.decode(c.token_ids)
    # Same prompts alone give the same greedy text: batch composition does not leak.
    alone = llm.generate(prompts[2], GREEDY, use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == outs[2].outputs[0].token_ids


def test_stop_string_is_cut_out(llm):
    full = llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip(), full.text
    cut = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    kept = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                           include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_string_waits_for_min_tokens(llm):
    full = llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0]
    # A stop string made of the first token's text: without min_tokens it stops at once.
    stop = llm.get_tokenizer().decode(full.token_ids[:1])
    assert stop.strip(), full.text
    early = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                         use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) == 1 and early.text == ""
    late = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                           min_tokens=4), use_tqdm=False)[0].outputs[0]
    # The text produced before min_tokens is kept; the stop string only counts from then on.
    assert len(late.token_ids) >= 4 and late.text.startswith(stop)
    assert late.token_ids == full.token_ids[: len(late.token_ids)]


def stop_string_cut(tok, ids, stop, min_tokens, include=False):
    """Where `stop` ends the greedy output `ids` (vLLM's rule, from full decodes): at the first token k >=
    min_tokens whose text completes an occurrence that does not lie wholly in the text before token k.
    Returns (k, text), or None when it never stops."""
    before = ""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        if k >= min_tokens:
            i = text.find(stop, max(len(before) - len(stop) + 1, 0))
            if i != -1:
                return k, text[: i + len(stop)] if include else text[:i]
        before = text
    return None


def test_stop_strings_after_min_tokens_cut_exactly(llm):
    tok = llm.get_tokenizer()
    full = llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0]
    assert full.text == tok.decode(full.token_ids)
    first = tok.decode(full.token_ids[:1])
    # A stop string spanning two tokens: the first one where the text changes (ends the k-th token's text).
    k = next(k for k in range(1, 24) if full.token_ids[k] != full.token_ids[k - 1])
    spanning = tok.decode(full.token_ids[k - 1:k + 1])
    assert first.strip() and spanning.strip() and tok.decode(full.token_ids[:k + 1]).endswith(spanning)
    cases = [(first, 3, False), (first, 4, True), (spanning, k + 1, False), (spanning, k + 1, True),
             (spanning, k + 2, False)]  # the last: the only match completes before min_tokens
    stopped = 0
    for stop, min_tokens, include in cases:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=min_tokens,
                                include_stop_str_in_output=include)
        out = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
        want = stop_string_cut(tok, full.token_ids, stop, min_tokens, include)
        case = (stop, min_tokens, include)
        if want is None:
            assert (out.finish_reason, out.stop_reason, out.token_ids, out.text) == \
                ("length", None, full.token_ids, full.text), case
        else:
            stopped += 1
            assert (out.finish_reason, out.stop_reason) == ("stop", stop), case
            assert (out.token_ids, out.text) == (full.token_ids[: want[0]], want[1]), case
    assert stopped == 4


@pytest.fixture(scope="module")
def ids_llm(model_dirs):
    """A random-weight model whose greedy outputs vary more than the built-in one's, for stop tokens."""
    return LLM(model_dirs["qwen3"], skip_tokenizer_init=True, max_num_seqs=4, max_model_len=256)


def first_repeated_token(ids):
    """(a, t): the first token t that appears at index a >= 1 for the first time and again later."""
    for a, t in enumerate(ids):
        if a >= 1 and ids.index(t) == a and t in ids[a + 1:]:
            return a, t
    raise AssertionError(f"test premise: no token repeats in {ids}")


@pytest.mark.parametrize("kind", ["stop_token_ids", "eos"])
def test_stop_tokens_after_min_tokens_cut_exactly(ids_llm, kind):
    prompt = np.random.default_rng(0).integers(3, 500, size=12).tolist()

    def gen(ids, **kw):
        return ids_llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, **kw),
                                use_tqdm=False)[0].outputs[0]

    full = gen(prompt, max_tokens=24, ignore_eos=True).token_ids
    a, t = first_repeated_token(full)
    stop = {"stop_token_ids": [t]} if kind == "stop_token_ids" else {}
    want_reason = t if kind == "stop_token_ids" else None
    if kind == "eos":
        ids_llm.engine.eos_token_ids.add(t)
    try:
        # min_tokens = a: a tokens are out when t comes, so it stops there, the (a + 1)-th token.
        out = gen(prompt, max_tokens=24, min_tokens=a, **stop)
        assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", want_reason, full[: a + 1])
        # min_tokens = a + 1: t is held back at index a, so the output goes another way; the reference is
        # the same request split in two: the first min_tokens tokens, then the rest from that longer
        # prompt with no min_tokens.
        m = a + 1
        head = gen(prompt, max_tokens=m, min_tokens=m, **stop)
        assert head.finish_reason == "length" and t not in head.token_ids and head.token_ids[:a] == full[:a]
        tail = gen(prompt + head.token_ids, max_tokens=24 - m, **stop)
        assert tail.finish_reason == "stop", "test premise: t comes again after min_tokens"
        out = gen(prompt, max_tokens=24, min_tokens=m, **stop)
        assert (out.finish_reason, out.stop_reason) == (tail.finish_reason, tail.stop_reason)
        assert out.token_ids == head.token_ids + tail.token_ids
    finally:
        ids_llm.engine.eos_token_ids.discard(t)


def test_stop_token_ids_and_min_tokens(llm):
    full = llm.generate("abc", GREEDY, use_tqdm=False)[0].outputs[0]
    stop_tok = full.token_ids[5]
    first = full.token_ids.index(stop_tok)
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == full.token_ids[: first + 1]
    late = llm.generate("abc", SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok],
                                              min_tokens=first + 1), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) > first + 1


def test_eos_stops_unless_ignored(llm):
    tok = llm.get_tokenizer()
    full = llm.generate("xyz", GREEDY, use_tqdm=False)[0].outputs[0]
    # Make the 4th greedy token an end-of-sequence token for this LLM, then generate again.
    eos = full.token_ids[3]
    llm.engine.eos_token_ids.add(eos)
    try:
        out = llm.generate("xyz", SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason is None
        assert out.token_ids == full.token_ids[: full.token_ids.index(eos) + 1]
        ignored = llm.generate("xyz", GREEDY, use_tqdm=False)[0].outputs[0]
        assert ignored.token_ids == full.token_ids
    finally:
        llm.engine.eos_token_ids.discard(eos)
    assert tok.eos_token_id in llm.engine.eos_token_ids


def test_max_model_len_caps_output(llm):
    prompt = list(range(1000, 1500))  # 500 tokens, max_model_len 512
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_chat_applies_template(llm):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = llm.chat(conv, GREEDY, use_tqdm=False)[0]
    assert out.prompt == llm.get_tokenizer().apply_chat_template(conv, add_generation_prompt=True)
    assert out.prompt.endswith("<|im_start|>assistant\n")
    two = llm.chat([conv, [{"role": "user", "content": "Yo"}]], GREEDY, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_progress_bar_reports_speed_and_can_be_silenced(llm, capsys):
    llm.generate(["a", "b"], SamplingParams(max_tokens=3), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "output:" in err and "toks/s" in err
    llm.generate(["a", "b"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert capsys.readouterr().err == ""
