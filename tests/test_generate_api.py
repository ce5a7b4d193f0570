"""`LLM.generate` / `LLM.chat` behaviour through the public API, on the built-in default model."""

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
