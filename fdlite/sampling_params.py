"""Per-request sampling options, with vLLM's `SamplingParams` names, defaults and semantics.

Every field carries a one-line help string in its `metadata["help"]`; `SamplingParams.help()`
returns them so the CLI and the YAML job docs never drift from the code.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import numbers
from dataclasses import InitVar, dataclass, field, fields
from typing import Any, ClassVar

from fdlite.config import unknown_key_error

# Below this temperature a request is greedy (same threshold as vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


def _opt(default: Any, help: str) -> Any:
    """A dataclass field whose help text lives next to its default."""
    return field(default=default, metadata={"help": help})


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's `StructuredOutputsParams`): exactly one of `json` (a JSON
    schema, as a dict or JSON text), `regex`, `choice` (a list of strings), `grammar` (Lark, or GBNF/EBNF
    with `root ::= ...`) and `json_object=True` (any JSON object).

    Checked at construction: a schema, regex or grammar the backend (llguidance) rejects is a `ValueError`
    naming the field and the backend's reason, before any request runs. A mapping or JSON text with these
    keys is accepted wherever a `StructuredOutputsParams` is (YAML jobs, the command line).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without optional whitespace (vLLM's name)
    # JSON: a regex for each place whitespace may go (vLLM's name); None: at most one space, or one newline and
    # an indentation of up to 24 spaces or tabs (`structured/grammar.py`, BOUNDED_WHITESPACE).
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _fail("structured_outputs", "exactly one of json, regex, choice, grammar, json_object",
                        given or "none")
        if not isinstance(self.disable_any_whitespace, bool):
            raise _fail("structured_outputs.disable_any_whitespace", "a bool", self.disable_any_whitespace)
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern:
                raise _fail("structured_outputs.whitespace_pattern", "a non-empty regex string", self.whitespace_pattern)
            if self.disable_any_whitespace:
                raise ValueError("SamplingParams.structured_outputs: give disable_any_whitespace (compact JSON) or "
                                 "whitespace_pattern, not both")
        kind = given[0]
        spec = getattr(self, kind)
        if kind == "json":
            if isinstance(spec, str):
                try:
                    spec = self.json = json.loads(spec)
                except json.JSONDecodeError as e:
                    raise _fail("structured_outputs.json", f"a JSON schema (invalid JSON text: {e.msg})", spec) from None
            if not isinstance(spec, (dict, bool)):
                raise _fail("structured_outputs.json", "a JSON schema (an object)", spec)
        elif kind in ("regex", "grammar"):
            if not isinstance(spec, str) or not spec:
                raise _fail(f"structured_outputs.{kind}", "a non-empty string", spec)
        elif kind == "choice":
            if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(c, str) and c for c in spec):
                raise _fail("structured_outputs.choice", "a non-empty list of non-empty strings", spec)
            spec = self.choice = list(spec)
        elif spec is not True:
            raise _fail("structured_outputs.json_object", "true", spec)
        from fdlite.structured.grammar import compile_grammar, constraint_key  # noqa: PLC0415 (keeps import light)

        self._key = constraint_key(kind, spec, self.disable_any_whitespace, self.whitespace_pattern)
        try:
            compile_grammar(self._key)
        except ValueError as e:
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice list",
                    "json_object": "JSON object grammar"}[kind]
            raise ValueError(f"SamplingParams.structured_outputs.{kind}: invalid {what}: {e}") from None

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar or json_object."""
        return json.loads(self._key)[0]

    @property
    def key(self) -> str:
        """The constraint's content as one canonical string (equal constraints share a compiled grammar)."""
        return self._key

    @classmethod
    def coerce(cls, value: Any, name: str = "structured_outputs") -> StructuredOutputsParams | None:
        """`value` as a `StructuredOutputsParams`: the object itself, a mapping of its fields, JSON text of
        one, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise _fail(name, f"a mapping or JSON object (invalid JSON: {e.msg})", value) from None
        if not isinstance(value, dict):
            raise _fail(name, "a mapping with one of json, regex, choice, grammar, json_object", value)
        known = [f.name for f in fields(cls)]
        for k in value:
            if k not in known:
                raise ValueError(f"unknown key {k!r} in SamplingParams.{name}; known keys: {', '.join(known)}")
        return cls(**value)

    @classmethod
    def from_response_format(cls, value: Any) -> StructuredOutputsParams | None:
        """OpenAI's `response_format`: {"type": "json_schema", "json_schema": {"schema": ...}},
        {"type": "json_object"} or {"type": "text"} (no constraint)."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise _fail("response_format", f"a mapping or JSON object (invalid JSON: {e.msg})", value) from None
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            inner = value.get("json_schema")
            if not isinstance(inner, dict) or "schema" not in inner:
                raise _fail("response_format", 'a json_schema object with a "schema"', value)
            return cls(json=inner["schema"])
        raise _fail("response_format", 'an object with "type" text, json_object or json_schema', value)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


@dataclass
class SamplingParams:
    """How to pick the tokens of one request (vLLM-compatible).

    Invalid values raise `ValueError` naming the field, at construction time, so a bad YAML
    job fails before any model is loaded.
    """

    _set_fields: ClassVar[frozenset[str]] = frozenset()  # per instance: the fields its caller gave

    n: int = _opt(1, "Number of completions to generate for the prompt.")
    presence_penalty: float = _opt(
        0.0, "Subtracted from a token's logit if it already appears in the output; in [-2, 2]."
    )
    frequency_penalty: float = _opt(
        0.0, "Subtracted from a token's logit once per occurrence in the output; in [-2, 2]."
    )
    repetition_penalty: float = _opt(
        1.0, "Divides positive / multiplies negative logits of tokens seen in prompt or output; > 0, 1 = off."
    )
    temperature: float = _opt(1.0, "Softmax temperature; 0 means greedy decoding.")
    top_p: float = _opt(1.0, "Keep the smallest set of most likely tokens whose mass reaches top_p; in (0, 1].")
    top_k: int = _opt(0, "Keep only the top_k most likely tokens; 0 or -1 disables.")
    min_p: float = _opt(0.0, "Drop tokens less likely than min_p times the most likely one; in [0, 1].")
    seed: int | None = _opt(None, "Random seed for this request; the same seed gives the same tokens.")
    stop: str | list[str] | None = _opt(None, "String(s) that end generation when produced.")
    stop_token_ids: list[int] | None = _opt(None, "Token ids that end generation when sampled.")
    ignore_eos: bool = _opt(False, "Keep generating after the end-of-sequence token.")
    max_tokens: int | None = _opt(16, "Maximum number of tokens to generate; None = up to max_model_len.")
    min_tokens: int = _opt(0, "Minimum number of tokens before EOS or stop_token_ids may be sampled.")
    logit_bias: dict[int, float] | None = _opt(
        None, "Token id -> bias added to its logit before sampling (OpenAI's and vLLM's logit_bias); in [-100, 100].")
    allowed_token_ids: list[int] | None = _opt(
        None, "Sample only from these token ids (vLLM's allowed_token_ids); every other token is masked.")
    bad_words: list[str] | None = _opt(
        None, "Words never to generate (vLLM's bad_words): the last token of each word, with or without a leading "
        "space, is banned whenever the output ends with the tokens before it.")
    logprobs: int | None = _opt(
        None, "Number of top log-probabilities to return per generated token (plus the sampled one); raw values, "
        "the log-softmax of the model's logits before penalties, masks and temperature (vLLM's default)."
    )
    prompt_logprobs: int | None = _opt(
        None, "Number of top log-probabilities to return per prompt token (plus the prompt token itself); the first "
        "prompt token's entry is None. Such a prompt is computed in full, not read from the prefix cache (as in vLLM).")
    skip_special_tokens: bool = _opt(True, "Drop special tokens when detokenizing the output.")
    include_stop_str_in_output: bool = _opt(False, "Keep the matched stop string at the end of the text.")
    structured_outputs: StructuredOutputsParams | None = _opt(
        None, "Constrain the output: one of json (a JSON schema), regex, choice (list of strings), grammar "
              "(Lark or EBNF) or json_object: true, as a mapping or JSON; JSON whitespace is bounded unless "
              "whitespace_pattern says otherwise, disable_any_whitespace: true for compact JSON. Also accepted: "
              "guided_decoding (vLLM's older name) and response_format (OpenAI's)."
    )
    # Aliases for input only (not stored): vLLM's older spelling and OpenAI's response_format.
    guided_decoding: InitVar[Any] = None
    response_format: InitVar[Any] = None

    def __post_init__(self, guided_decoding: Any = None, response_format: Any = None) -> None:
        self.n = _int("n", self.n, minimum=1)
        self.presence_penalty = _float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        self.frequency_penalty = _float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        self.temperature = _float("temperature", self.temperature, lo=0.0)
        self.top_p = _float("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0)
        self.top_k = _int("top_k", self.top_k, minimum=-1)
        self.min_p = _float("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                self.bad_words = [self.bad_words]
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) and w.strip()
                                                                          for w in self.bad_words):
                raise _fail("bad_words", "a list of non-empty strings", self.bad_words)
            self.bad_words = list(self.bad_words) or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise _fail("allowed_token_ids", "a non-empty list of token ids", self.allowed_token_ids)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, minimum=1)
        self.min_tokens = _int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _bool("include_stop_str_in_output", self.include_stop_str_in_output)
        self.structured_outputs = _structured(self.structured_outputs, guided_decoding, response_format)
        if self.structured_outputs is not None and self.ignore_eos:
            raise ValueError("SamplingParams.ignore_eos cannot be combined with structured_outputs: a constrained "
                             "output ends with the end-of-sequence token once the grammar is complete")

    @property
    def is_greedy(self) -> bool:
        """True when decoding is argmax: temperature ~ 0 (top-k/top-p/min-p and seed are then moot)."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """True when any presence / frequency / repetition penalty changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def with_defaults(self, defaults: dict[str, Any]) -> SamplingParams:
        """This request with `defaults` (field -> value) for the fields its caller left unset (the model's
        generation_config.json, `fdlite/models/generation_config.py`); itself when none applies."""
        unset = {k: v for k, v in defaults.items() if k not in self._set_fields and getattr(self, k) != v}
        if not unset:
            return self
        merged = SamplingParams(**{**self.to_dict(), **unset})
        merged._set_fields = self._set_fields
        return merged

    def clone(self) -> SamplingParams:
        """A deep copy (lists such as `stop` are not shared)."""
        return copy.deepcopy(self)

    def to_dict(self) -> dict[str, Any]:
        """Field name -> value (a copy), the inverse of `from_dict`."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a mapping (e.g. a YAML job); unknown keys raise `ValueError` naming them."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling options must be a mapping, got {type(d).__name__}: {d!r}")
        known = {f.name for f in fields(cls)} | set(ALIASES)
        for key in d:
            if key not in known:
                raise ValueError(f"unknown sampling option {key!r}; known options: {', '.join(sorted(known))}")
        return cls(**d)

    @classmethod
    def help(cls) -> dict[str, str]:
        """Field name -> one-line help, in declaration order (for CLI / YAML documentation)."""
        return {f.name: f.metadata["help"] for f in fields(cls)}


# Keys `SamplingParams(...)` and `from_dict` accept besides its fields, each standing for structured_outputs.
ALIASES = ("guided_decoding", "response_format")


def _checked_init(cls):
    """`cls`'s dataclass `__init__`, but an unknown keyword is a TypeError with a "did you mean" (as LLM(), job
    files and the command line say), not Python's bare "unexpected keyword argument"."""
    init = cls.__init__
    known = [f.name for f in fields(cls)] + list(ALIASES)
    accepted = frozenset(known)

    names = [f.name for f in fields(cls)]

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not accepted.issuperset(kwargs):
            key = next(k for k in kwargs if k not in accepted)
            raise TypeError(f"{cls.__name__}: {unknown_key_error('keyword argument', key, known)}")
        init(self, *args, **kwargs)
        # The fields the caller gave (the rest may take the model's generation_config.json defaults).
        self._set_fields = frozenset(names[: len(args)]) | frozenset(
            "structured_outputs" if k in ALIASES else k for k in kwargs)

    cls.__init__ = __init__


_checked_init(SamplingParams)


# --- validation helpers: each error names the field and the bad value -----------------------


def _structured(value: Any, guided_decoding: Any, response_format: Any) -> StructuredOutputsParams | None:
    given = [n for n, v in (("structured_outputs", value), ("guided_decoding", guided_decoding),
                            ("response_format", response_format)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"SamplingParams: give one of {' and '.join(given)}; they are the same option")
    if response_format is not None:
        return StructuredOutputsParams.from_response_format(response_format)
    if guided_decoding is not None:
        return StructuredOutputsParams.coerce(guided_decoding, "guided_decoding")
    return StructuredOutputsParams.coerce(value)



def _fail(name: str, requirement: str, value: Any) -> ValueError:
    return ValueError(f"SamplingParams.{name} must be {requirement}, got {value!r}")


def _int(name: str, value: Any, minimum: int | None = None) -> int:
    # bool is an int subclass, but `n=True` is always a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(name, "an int", value)
    value = int(value)
    if minimum is not None and value < minimum:
        raise _fail(name, f">= {minimum}", value)
    return value


def _float(
    name: str, value: Any, lo: float | None = None, hi: float | None = None, lo_open: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, "a number", value)
    value = float(value)
    if not math.isfinite(value):
        raise _fail(name, "finite", value)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise _fail(name, f"{'>' if lo_open else '>='} {lo:g}", value)
    if hi is not None and value > hi:
        raise _fail(name, f"<= {hi:g}", value)
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, "a bool", value)
    return value


def _stop_strings(value: Any) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise _fail("stop", "a str or a list of str", value)
    for s in items:
        if not isinstance(s, str) or not s:
            raise _fail("stop", "non-empty strings", s)
    return list(items)


def _stop_token_ids(value: Any) -> list[int]:
    return [] if value is None else _token_ids("stop_token_ids", value)


def _token_ids(name: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise _fail(name, "a list of int", value)
    out = []
    for t in value:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise _fail(name, "ints >= 0", t)
        out.append(int(t))
    return out


def _logit_bias(value: Any) -> dict[int, float] | None:
    """{token id: bias}; keys may be digit strings (OpenAI's JSON bodies), values in [-100, 100]."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _fail("logit_bias", "a mapping of token id to bias", value)
    out = {}
    for k, v in value.items():
        key = int(k) if isinstance(k, str) and k.strip().isdigit() else k
        if isinstance(key, bool) or not isinstance(key, numbers.Integral) or key < 0:
            raise _fail("logit_bias", "token ids >= 0 as keys", k)
        out[int(key)] = _float(f"logit_bias[{k}]", v, lo=-100.0, hi=100.0)
    return out or None
