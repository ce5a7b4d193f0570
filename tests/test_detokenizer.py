"""fdlite.detokenizer.IncrementalDetokenizer: streaming text equals the full decode; stop strings."""

import pytest
from env_patch import EnvMonkeyPatch

from fdlite.default_model import default_model_path
from fdlite.detokenizer import IncrementalDetokenizer
from fdlite.tokenizer import Tokenizer


def detokenize(tokenizer, prompt_token_ids, output_ids, **kwargs) -> IncrementalDetokenizer:
    """Feed all of `output_ids` through an `IncrementalDetokenizer` (stops early at a stop string)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, **kwargs)
    for token_id in output_ids:
        if detok.append(token_id) is not None:
            break
    return detok

OUTPUTS = [
    "The quick brown fox jumps over the lazy dog.",
    "人工智能正在改变世界。我们一起学习深度学习吧！",
    "Emoji: 😀🎉👍🏽🇨🇳🧑‍💻 done",
    "混合 text 和 emoji 🐼🐉 以及 spaces   here",
    'def greet(name: str) -> str:\n    """Say hi."""\n    return f"你好, {name}!"  # 🙂\n',
    "  two leading spaces and trailing  ",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    with EnvMonkeyPatch.context() as mp:
        mp.setenv("FDLITE_CACHE", str(tmp_path_factory.mktemp("fdlite_cache")))
        return Tokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def chat_prompt(tok):
    return tok.apply_chat_template([{"role": "user", "content": "Say something."}], tokenize=True)


class RecordingDetokenizer(IncrementalDetokenizer):
    """Also keeps the ids it took in, `output_token_ids` (appends after a stop string are dropped)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.output_token_ids: list[int] = []

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        if self.stop_reason is None:
            self.output_token_ids.append(token_id)
        return super().append(token_id, check_stop)


def _stream(tok, prompt_ids, output_ids, **kwargs):
    detok = RecordingDetokenizer(tok, prompt_ids, **kwargs)
    snapshots = []
    for token_id in output_ids:
        detok.append(token_id)
        snapshots.append(detok.text)
    return detok, snapshots


def test_outputs_split_characters_over_tokens(tok):
    # Make sure the cases below really exercise the hard part: some single tokens are half a character.
    ids = tok.encode(OUTPUTS[2])
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("use_chat_prompt", [True, False], ids=["chat_prompt", "empty_prompt"])
@pytest.mark.parametrize("text", OUTPUTS)
def test_incremental_equals_full_decode(tok, chat_prompt, text, use_chat_prompt):
    prompt = chat_prompt if use_chat_prompt else []
    ids = tok.encode(text, add_special_tokens=False)
    detok, snapshots = _stream(tok, prompt, ids)
    assert detok.text == tok.decode(ids) == text
    previous = ""
    for snap in snapshots:
        assert "\ufffd" not in snap  # never emits half a character
        assert snap.startswith(previous)  # text only grows
        previous = snap
    assert detok.output_token_ids == ids and detok.stop_reason is None


def test_prompt_context_keeps_boundary_space(tok):
    # " world" after a prompt ending in "Hello" must come out with its leading space.
    prompt = tok.encode("Hello")
    detok, _ = _stream(tok, prompt, tok.encode(" world"))
    assert detok.text == " world"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_in_output(tok, skip):
    ids = tok.encode("<think>\nhmm\n</think>\n\n答案是 42。<|im_end|>")
    detok, _ = _stream(tok, [], ids, skip_special_tokens=skip)
    assert detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert detok.text.endswith("42。") if skip else detok.text.endswith("42。<|im_end|>")


def _spanning_stop(tok, text):
    """A stop string made of the end of one token and the start of the next (found in neither alone)."""
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    for k in range(len(pieces) - 1):
        a, b = pieces[k], pieces[k + 1]
        if len(a) >= 3 and len(b) >= 3 and "\ufffd" not in a + b:
            stop = a[-2:] + b[:2]
            if text.count(stop) == 1:
                return ids, k, stop
    raise AssertionError("no suitable token boundary")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary(tok, chat_prompt, include):
    text = "The weather today is wonderful, let us go outside and play football."
    ids, k, stop = _spanning_stop(tok, text)
    assert all(stop not in tok.decode([i]) for i in ids)
    detok = RecordingDetokenizer(tok, chat_prompt, stop=[stop], include_stop_str_in_output=include)
    results = [detok.append(i) for i in ids]
    # Nothing matches until the token that completes the stop string; later tokens are ignored.
    assert results[: k + 1] == [None] * (k + 1)
    assert results[k + 1] == stop
    assert results[k + 2 :] == [None] * (len(ids) - k - 2)
    cut = text.index(stop)
    assert detok.text == (text[: cut + len(stop)] if include else text[:cut])
    assert detok.stop_reason == stop and detok.finished
    assert detok.output_token_ids == ids[: k + 2]


def test_stop_string_inside_one_token_drops_the_rest(tok):
    ids = tok.encode("Hello world, goodbye world")
    detok = detokenize(tok, [], ids, stop=["orl"])
    assert detok.text == "Hello w" and detok.stop_reason == "orl"
    detok = detokenize(tok, [], ids, stop=["orl"], include_stop_str_in_output=True)
    assert detok.text == "Hello worl"


def test_earliest_stop_string_wins(tok):
    ids = tok.encode("alpha beta gamma")
    detok = detokenize(tok, [], ids, stop=["gamma", " beta gam"])
    assert detok.stop_reason == " beta gam" and detok.text == "alpha"


def test_multibyte_stop_string(tok):
    text = "我们一起学习深度学习吧！然后休息。"
    ids = tok.encode(text)
    detok = detokenize(tok, [], ids, stop=["学习吧"])
    assert detok.text == "我们一起学习深度" and detok.stop_reason == "学习吧"


def test_stop_in_prompt_is_ignored_and_no_match_keeps_full_text(tok):
    prompt = tok.encode("STOP here")
    ids = tok.encode(" nothing to see")
    detok = detokenize(tok, prompt, ids, stop=["STOP", "zzz"])
    assert detok.stop_reason is None and detok.text == " nothing to see"
