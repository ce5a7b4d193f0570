"""A structured-outputs constraint -> llguidance grammar text, checked without a tokenizer.

Why llguidance: it has no dependencies (xgrammar, the other backend vLLM and FastDeploy use, requires
torch, transformers and triton), builds its tokenizer straight from `tokenizer.json`, and compiles a
grammar lazily, so a new JSON schema costs milliseconds, not a vocabulary-wide precomputation.

Compilation is cached by the constraint's content: a job with a million lines sharing one schema
compiles and checks it once.
"""

from __future__ import annotations

import functools
import json

try:  # a declared dependency; the message below is for installs that skipped it
    import llguidance as _llg
except ImportError:  # pragma: no cover
    _llg = None

KINDS = ("json", "regex", "choice", "grammar", "json_object")

# JSON whitespace by default: at most one space or tab, or one newline and an indentation of up to 24 spaces or
# tabs, at each place JSON allows whitespace. JSON's own rule (any run of whitespace, vLLM's default with
# xgrammar) lets a weak model spend every token up to max_tokens on spaces and newlines inside an object: a
# random-weight model did so in 64 of 64 requests, and finished all 64 with this bound.
BOUNDED_WHITESPACE = r"[\x20\x09]|\x0A[\x20\x09]{0,24}"
FLEXIBLE_WHITESPACE = r"[\x20\x0A\x0D\x09]+"  # JSON's own rule, for `whitespace_pattern`


def _require() -> None:
    if _llg is None:
        raise ValueError("structured outputs need the llguidance package: pip install llguidance")


def constraint_key(kind: str, spec, disable_any_whitespace: bool, whitespace_pattern: str | None = None) -> str:
    """A canonical string for a constraint: equal constraints (e.g. the same schema with keys in another
    order) share one compiled grammar."""
    return json.dumps([kind, spec, disable_any_whitespace, whitespace_pattern], sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=256)
def compile_grammar(key: str) -> str:
    """llguidance grammar text for `constraint_key(...)`; `ValueError` with the backend's reason if invalid."""
    _require()
    kind, spec, compact, whitespace = json.loads(key)
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else spec
        # Compact JSON is vLLM's disable_any_whitespace; otherwise each place whitespace may go matches the
        # pattern at most once (llguidance's whitespace_pattern), bounded unless the request says otherwise.
        overrides = {"whitespace_flexible": False} if compact else {"whitespace_pattern": whitespace or BOUNDED_WHITESPACE}
        grammar = _llg.LLMatcher.grammar_from_json_schema(schema, overrides=overrides)
    elif kind == "regex":
        grammar = _llg.LLMatcher.grammar_from_regex(spec)
    elif kind == "choice":
        grammar = _llg.grammar_from("choice", spec)
    else:  # Lark, or GBNF/EBNF ("root ::= ..."), which llguidance converts to Lark
        try:
            grammar = _llg.grammar_from("grammar", spec)
        except ValueError as e:
            raise ValueError(str(e)) from None
    is_error, messages = _llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(messages[0].strip())
    return grammar
