"""Text <-> token ids for fdlite: a thin `Tokenizer` over the HF `tokenizers` package plus a jinja2 chat template.

Why hand-written: the engine only needs encode/decode, the special-token ids and chat templates, and the
`tokenizers` Rust library already does the real work from a model folder's `tokenizer.json`. Pulling in
`transformers` (or paddlenlp) just for that would add seconds of import time and a large dependency to a small
Paddle runtime. What transformers adds on top (reading `tokenizer_config.json`, the special tokens, the
eos ids of `generation_config.json`, and its jinja2 sandbox for chat templates) is re-done here in a few lines,
and the tests check the results against `transformers.AutoTokenizer` token for token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer

# Older names some callers use for a message's reasoning; chat templates (Qwen3's included) read the first one.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _token_content(token: Any) -> str | None:
    """A special token in tokenizer_config.json is either a plain string or a serialized AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_id_list(value: Any) -> list[int]:
    """`eos_token_id` in config/generation_config may be an int, a list of ints, or absent."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _pick_template(template: Any) -> str | None:
    """tokenizer_config.json's chat_template is a string, or (older HF layout) a list of named templates."""
    if template is None or isinstance(template, str):
        return template
    named = {t["name"]: t["template"] for t in template}
    return named.get("default", next(iter(named.values()), None))


class _GenerationTag(jinja2.ext.Extension):
    """Accept HF's `{% generation %}...{% endgeneration %}` block (used for assistant masks) and render its body.

    transformers registers an extension for this tag; without one, templates that use it fail to parse.
    """

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Same as transformers' filter: jinja's built-in `tojson` HTML-escapes characters like '<', which would
    # change tool schemas rendered into the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    from datetime import datetime

    return datetime.now().strftime(fmt)


_template_cache: dict[str, jinja2.Template] = {}


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox set up like transformers' (templates come from model folders: untrusted)."""
    template = _template_cache.get(source)
    if template is None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        template = _template_cache[source] = env.from_string(source)
    return template


def _prepare_messages(conversation: Iterable[dict]) -> list[dict]:
    """Copy the messages the way transformers does before rendering, so both render the same text.

    Keys whose value is None are dropped (OpenAI-style `content=None` would otherwise render as "None"), and a
    message's reasoning given as `thinking`/`reasoning` is also exposed as `reasoning_content`.
    """
    messages = []
    for message in conversation:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        messages.append(message)
    return messages


class Tokenizer:
    """A model folder's tokenizer: encode/decode, special-token ids and the chat template.

    Build it with `Tokenizer.from_pretrained(model_dir)`.
    """

    def __init__(
        self,
        hf_tokenizer: _HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        name_or_path: str | None = None,
    ):
        self._tok = hf_tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.add_bos_token = add_bos_token  # informational only: tokenizer.json's post-processor decides
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        self._extra_eos_ids = [i for i in extra_eos_token_ids]

    # ----------------------------------------------------------------------------------------------- loading

    @classmethod
    def from_pretrained(cls, path: str) -> Tokenizer:
        """Load the tokenizer of an HF-layout model folder.

        Reads `tokenizer.json` (required), and when present `tokenizer_config.json` (special tokens, added
        tokens, chat template), `chat_template.jinja` (newer layout; wins over the config's template), and
        `generation_config.json` / `config.json` for extra end-of-sequence ids.
        """
        path = os.fspath(path)
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(
                f"tokenizer.json not found in model folder {path!r}: fdlite needs the fast-tokenizer file "
                f"'tokenizer.json' (missing: {tokenizer_file})"
            )
        hf = _HFTokenizer.from_file(tokenizer_file)
        config = _read_json(os.path.join(path, "tokenizer_config.json")) or {}

        # Added tokens listed only in tokenizer_config.json (rare, but HF honours them) must exist in the vocab.
        added = config.get("added_tokens_decoder") or {}
        for _id, tok in sorted(added.items(), key=lambda kv: int(kv[0])):
            content = _token_content(tok)
            if content is None or hf.token_to_id(content) is not None:
                continue
            special = bool(tok.get("special", False)) if isinstance(tok, dict) else False
            added_token = AddedToken(
                content,
                single_word=tok.get("single_word", False) if isinstance(tok, dict) else False,
                lstrip=tok.get("lstrip", False) if isinstance(tok, dict) else False,
                rstrip=tok.get("rstrip", False) if isinstance(tok, dict) else False,
                normalized=tok.get("normalized", not special) if isinstance(tok, dict) else True,
                special=special,
            )
            (hf.add_special_tokens if special else hf.add_tokens)([added_token])

        chat_template = _pick_template(config.get("chat_template"))
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                chat_template = f.read()

        # generation_config.json is what generation actually stops on (Qwen lists both <|im_end|> and
        # <|endoftext|> there), so its ids join the tokenizer's own eos token.
        extra_eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            data = _read_json(os.path.join(path, name)) or {}
            extra_eos += _as_id_list(data.get("eos_token_id"))

        return cls(
            hf,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            unk_token=_token_content(config.get("unk_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=chat_template,
            extra_eos_token_ids=extra_eos,
            name_or_path=path,
        )

    # ------------------------------------------------------------------------------------ special token ids

    def token_to_id(self, token: str | None) -> int | None:
        """Id of a token string, or None when it is not in the vocabulary."""
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's eos token id; falls back to the first eos id of generation_config/config."""
        eos = self.token_to_id(self.eos_token)
        if eos is None and self._extra_eos_ids:
            eos = self._extra_eos_ids[0]
        return eos

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: the tokenizer's eos plus generation_config.json/config.json eos ids."""
        ids = set(self._extra_eos_ids)
        eos = self.token_to_id(self.eos_token)
        if eos is not None:
            ids.add(eos)
        return ids

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self.token_to_id(self.unk_token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the special tokens: added tokens marked special plus bos/eos/pad/unk, sorted."""
        ids = {i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special}
        for i in (self.bos_token_id, self.token_to_id(self.eos_token), self.pad_token_id, self.unk_token_id):
            if i is not None:
                ids.add(i)
        return sorted(ids)

    # ------------------------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, as `transformers.AutoTokenizer(...)(text)["input_ids"]` gives them.

        Special tokens (e.g. Llama's BOS) come only from tokenizer.json's post-processor. Like transformers 5,
        which drops `add_bos_token` from tokenizer_config.json whenever a tokenizer.json exists, the config flag
        is not applied on top, so BOS is never doubled.
        """
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Note that transformers 5 defaults to `skip_special_tokens=False`; fdlite, like vLLM,
        skips them by default. For the same flag both give the same text."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_str(self) -> str:
        """The tokenizer as `tokenizer.json` text, added tokens included (structured outputs build their
        token-level grammar matcher from it)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (byte-level form, e.g. 'Ġhello') of one id, or None when out of range."""
        return self._tok.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    # ------------------------------------------------------------------------------------------ chat template

    def apply_chat_template(
        self,
        conversation: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation ([{"role": ..., "content": ...}, ...]) with the model's chat template.

        Extra keyword arguments reach the template (e.g. `enable_thinking=False` for Qwen3, `tools=[...]`).
        Returns the prompt text, or its token ids with `tokenize=True` (encoded without adding special tokens,
        since the template already wrote them). Unlike transformers, `add_generation_prompt` defaults to True:
        an inference engine nearly always wants the assistant turn opened.
        """
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ValueError(
                f"the model folder {self.name_or_path!r} has no chat template (no chat_template in "
                "tokenizer_config.json and no chat_template.jinja); pass chat_template=... or send plain prompts"
            )
        # transformers passes its special tokens by name; unset ones stay undefined (renders as ""), not "None".
        context: dict[str, Any] = {
            name: value
            for name, value in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("pad_token", self.pad_token),
                ("unk_token", self.unk_token),
            )
            if value is not None
        }
        context.setdefault("tools", None)
        context.setdefault("documents", None)
        context.update(template_kwargs)
        text = _compile_template(source).render(
            messages=_prepare_messages(conversation), add_generation_prompt=add_generation_prompt, **context
        )
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size})"
