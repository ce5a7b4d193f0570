"""fdlite.tokenizer.Tokenizer against transformers.AutoTokenizer on the default model's real Qwen3 tokenizer."""

import json
import os

import jinja2
import pytest
from env_patch import EnvMonkeyPatch

from fdlite.default_model import default_model_path
from fdlite.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "你好，世界！这是一个分词测试。",
    "emoji 😀👍🏽🇨🇳 and accents: café naïve",
    "def square(x):\n    return x ** 2  # 平方\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "<think>\nreasoning\n</think>\n\nanswer",
    "",
]

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is 2+2?"}],
    "with_system": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
    "multi_turn_with_thinking": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "你好"},
        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\n你好！"},
        {"role": "user", "content": "Tell me a joke 😀"},
    ],
    "reasoning_field_and_none": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "the user greets", "tool_calls": None},
        {"role": "user", "content": "again"},
    ],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    with EnvMonkeyPatch.context() as mp:
        mp.setenv("FDLITE_CACHE", str(tmp_path_factory.mktemp("fdlite_cache")))
        return default_model_path()


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def _folder_with(tmp_path, model_dir, config_edit=None, files=None):
    """A tokenizer folder sharing the default model's tokenizer.json, with an edited config / extra files."""
    os.symlink(os.path.join(model_dir, "tokenizer.json"), tmp_path / "tokenizer.json")
    if config_edit is not None:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        config_edit(config)
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    return str(tmp_path)


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, hf, text, add_special_tokens):
    expected = hf(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert tok.encode(text, add_special_tokens=add_special_tokens) == expected


def test_special_tokens_are_single_ids(tok):
    assert tok.encode("<|im_start|>user<|im_end|>") == [151644, 872, 151645]
    assert tok.encode("<think></think>") == [151667, 151668]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tok, hf, skip_special_tokens):
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens) == hf.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_round_trip_and_special_skipping(tok):
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    ids = tok.encode("<|im_start|>assistant\nok<|im_end|><think>x</think>")
    # <|im_*|> are special and skipped; <think> is an added but non-special token and stays (as in HF).
    assert tok.decode(ids) == "assistant\nok<think>x</think>"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nok<|im_end|><think>x</think>"


def test_token_strings_and_ids(tok, hf):
    ids = tok.encode("Hello world 你好")
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert tok.id_to_token(ids[1]) == "Ġworld"
    assert tok.eos_token_id == hf.eos_token_id == 151645
    assert tok.pad_token_id == hf.pad_token_id == 151643
    assert tok.bos_token_id is None and hf.bos_token_id is None  # Qwen has no BOS token
    assert tok.eos_token_ids == {151645, 151643}  # <|im_end|> plus generation_config's <|endoftext|>
    assert tok.vocab_size == len(hf) == 151669
    assert tok.all_special_ids == sorted(hf.all_special_ids)
    assert 151667 not in tok.all_special_ids  # <think> is not special


@pytest.mark.parametrize(
    "kwargs",
    [
        {"add_generation_prompt": True},
        {"add_generation_prompt": False},
        {"add_generation_prompt": True, "enable_thinking": False},
        {"add_generation_prompt": True, "enable_thinking": True},
    ],
    ids=["gen", "nogen", "no_thinking", "thinking"],
)
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_chat_template_matches_transformers(tok, hf, name, kwargs):
    conversation = CONVERSATIONS[name]
    expected = hf.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert tok.apply_chat_template(conversation, **kwargs) == expected


def test_chat_template_known_text(tok):
    text = tok.apply_chat_template(CONVERSATIONS["with_system"], enable_thinking=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_chat_template_with_tools_matches_transformers(tok, hf):
    # Exercises the `tojson` filter: jinja's own would HTML-escape the '<' and '&' below.
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Find <b>things</b> & stuff, 中文 too",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
            },
        }
    ]
    conversation = [
        {"role": "user", "content": "find cats"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "cats"}}}],
        },
        {"role": "tool", "content": '{"found": 3}'},
    ]
    expected = hf.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True)
    got = tok.apply_chat_template(conversation, tools=tools)
    assert got == expected
    assert "Find <b>things</b> & stuff, 中文 too" in got


def test_chat_template_tokenize(tok, hf):
    conversation = CONVERSATIONS["multi_turn_with_thinking"]
    ids = tok.apply_chat_template(conversation, tokenize=True)
    text = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 151644 and ids[-3:] == tok.encode("<|im_start|>assistant\n")


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        Tokenizer.from_pretrained(str(tmp_path))
    assert "tokenizer.json" in str(info.value) and str(tmp_path) in str(info.value)


def test_no_chat_template(tmp_path, model_dir):
    tok = Tokenizer.from_pretrained(_folder_with(tmp_path, model_dir))
    assert tok.encode("hi") == [6023]
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    # An explicit template still works.
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="{{ messages[0].content }}") == "hi"


def test_chat_template_jinja_file_wins(tmp_path, model_dir, hf):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ eos_token }}"
    folder = _folder_with(tmp_path, model_dir, config_edit=lambda c: None, files={"chat_template.jinja": template})
    conversation = CONVERSATIONS["with_system"]
    got = Tokenizer.from_pretrained(folder).apply_chat_template(conversation)
    assert got == "[system] You are a helpful assistant.\n[user] Write a haiku about the sea.\n<|im_end|>"
    transformers = pytest.importorskip("transformers")
    assert got == transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(conversation, tokenize=False)


def test_bos_and_add_bos_token_like_transformers(tmp_path, model_dir):
    """A template that writes bos_token, in a config asking add_bos_token: BOS appears exactly once."""

    def edit(config):
        config["bos_token"] = "<|endoftext|>"
        config["add_bos_token"] = True
        config["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"

    folder = _folder_with(tmp_path, model_dir, config_edit=edit)
    tok = Tokenizer.from_pretrained(folder)
    conversation = [{"role": "user", "content": "hi"}]
    assert tok.bos_token_id == 151643
    assert tok.apply_chat_template(conversation, tokenize=True) == [151643, 6023]
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    # transformers 5 ignores add_bos_token when tokenizer.json exists; its post-processor decides. So do we.
    assert tok.encode("hi") == hf("hi")["input_ids"] == [6023]
    assert tok.apply_chat_template(conversation, tokenize=False) == hf.apply_chat_template(conversation, tokenize=False)


def test_raise_exception_in_template(tok):
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template) == "ok"
    with pytest.raises(jinja2.exceptions.TemplateError, match="must be from the user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}], chat_template=template)


def test_template_is_sandboxed(tok):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=evil)
