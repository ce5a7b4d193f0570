"""reasoning_parser: the <think> part of an output in `reasoning_content`, as vLLM's qwen3 / ernie45 parsers split it."""

from __future__ import annotations

import json

import pytest

from fdlite import LLM, SamplingParams
from fdlite.reasoning import Ernie45ReasoningParser, Qwen3ReasoningParser, make_reasoning_parser
from fdlite.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
CHAT = [{"role": "user", "content": "Name three prime numbers."}]


class NoThinkTokens:
    """A tokenizer without <think> tokens: the prompt check falls back to the prompt's text."""

    def token_to_id(self, token):
        return None


# (output, reasoning, answer): the cases of vLLM's parser tests, non-streamed.
QWEN3_CASES = [
    ("<think>abc</think>def", "abc", "def"),
    ("abc</think>def", "abc", "def"),  # <think> in the prompt (newer templates)
    ("<think>abc</think>", "abc", None),
    ("<think>abc", "abc", None),  # stopped while thinking: all reasoning
    ("abc", "abc", None),
    ("<think>plan\n<tool_call>\n<function=f>x</function></tool_call>", "plan\n",
     "<tool_call>\n<function=f>x</function></tool_call>"),  # a tool call ends the reasoning
    ("<think>mentions <tool_call> only", "mentions <tool_call> only", None),
]
ERNIE_CASES = [
    ("abc</think>def", "abc", "def"),
    ("abc\n</think>\n\n<response>\ndef\n</response>\n", "abc\n", "\ndef\n"),
    ("<think>abc</think>\ndef", "abc", "\ndef"),
    ("abc", "abc", None),
    ("abc</think>", "abc", None),
]


@pytest.mark.parametrize("text, reasoning, answer", QWEN3_CASES)
def test_qwen3_split(text, reasoning, answer):
    assert Qwen3ReasoningParser(NoThinkTokens()).split(text) == (reasoning, answer)


@pytest.mark.parametrize("text, reasoning, answer", ERNIE_CASES)
def test_ernie45_split(text, reasoning, answer):
    assert Ernie45ReasoningParser(NoThinkTokens()).split(text) == (reasoning, answer)


def test_prompt_that_closed_the_think_block_makes_the_output_all_answer():
    p = Qwen3ReasoningParser(NoThinkTokens())
    off = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert p.extract("just the answer", [], off) == (None, "just the answer")
    assert p.extract("thinking", [], "<|im_start|>assistant\n") == ("thinking", "")
    assert p.extract("a</think>b", [], "<think>") == ("a", "b")


def test_unknown_parser_and_no_tokenizer_are_refused():
    with pytest.raises(ValueError, match="reasoning_parser must be qwen3, ernie45 or None, got 'deepseek'"):
        LLM(reasoning_parser="deepseek")
    with pytest.raises(ValueError, match="needs output text"):
        make_reasoning_parser("qwen3", None)


@pytest.fixture(scope="module")
def llms():
    """The built-in model (real Qwen3 tokenizer: <think> and </think> are single tokens), with and without a parser."""
    return LLM(max_num_seqs=4, max_model_len=256), LLM(max_num_seqs=4, max_model_len=256, reasoning_parser="qwen3")


def test_chat_thinking_on_and_off(llms):
    plain, parsed = llms
    tok: Tokenizer = parsed.get_tokenizer()
    assert tok.token_to_id("<think>") is not None and tok.token_to_id("</think>") is not None
    # Thinking on: Qwen3's template leaves the block open, so the whole (unterminated) output is reasoning.
    ref = plain.chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0]
    on = parsed.chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0]
    assert on.token_ids == ref.token_ids and ref.reasoning_content is None
    assert "</think>" not in ref.text and (on.reasoning_content, on.text) == (ref.text.partition("<think>")[2]
                                                                                or ref.text, "")
    # Thinking off: the template writes <think>\n\n</think> into the prompt; the output is all answer.
    off_kwargs = {"enable_thinking": False}
    ref_off = plain.chat(CHAT, GREEDY, use_tqdm=False, chat_template_kwargs=off_kwargs)[0]
    out_off = parsed.chat(CHAT, GREEDY, use_tqdm=False, chat_template_kwargs=off_kwargs)[0]
    assert "</think>" in out_off.prompt and "</think>" not in on_prompt(parsed)
    assert out_off.outputs[0].reasoning_content is None and out_off.outputs[0].text == ref_off.outputs[0].text


def on_prompt(llm):
    return llm.get_tokenizer().apply_chat_template(CHAT, add_generation_prompt=True)


def test_think_tokens_forced_through_the_prompt_split_the_output(llms):
    """A prompt ending in an open <think>, with a stop token: the decoded <think> of the prompt is not part of
    the output, so reasoning is the whole output; the same output with </think> appended by a stop
    token that is kept splits there."""
    _, parsed = llms
    tok = parsed.get_tokenizer()
    end = tok.token_to_id("</think>")
    prompt = on_prompt(parsed) + "<think>\n"
    out = parsed.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    first = out.outputs[0]
    assert first.reasoning_content and first.text == ""
    # The parser on output text that carries the end token (as a model that closes its thinking writes it).
    text = tok.decode(first.token_ids + [end] + first.token_ids, skip_special_tokens=True)
    reasoning, answer = parsed.reasoning_parser.extract(text, out.prompt_token_ids)
    assert (reasoning, answer) == (first.reasoning_content, first.reasoning_content)


def test_job_lines_carry_text_and_reasoning(tmp_path):
    from fdlite import cli

    records = [{"id": "on", "messages": CHAT}, {"id": "plain", "prompt": "hello"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for name, extra in (("on", ""), ("off", "chat_template_kwargs: {enable_thinking: false}\n")):
        (tmp_path / f"{name}.yaml").write_text(
            "max_num_seqs: 4\nmax_model_len: 256\nreasoning_parser: qwen3\n"
            "sampling: {temperature: 0, max_tokens: 5, ignore_eos: true}\n"
            f"input: in.jsonl\noutput: {name}.jsonl\n{extra}")
        assert cli.main(["run", str(tmp_path / f"{name}.yaml"), "--no-progress"]) == 0
    on = {r["id"]: r for r in map(json.loads, open(tmp_path / "on.jsonl"))}
    off = {r["id"]: r for r in map(json.loads, open(tmp_path / "off.jsonl"))}
    assert all("reasoning_content" in r and "text" in r for r in [*on.values(), *off.values()])
    assert on["on"]["reasoning_content"] and on["on"]["text"] == ""
    assert off["on"]["reasoning_content"] is None and off["on"]["text"]
