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


def _require() -> None:
    if _llg is None:
        raise ValueError("structured outputs need the llguidance package: pip install llguidance")


def constraint_key(kind: str, spec, disable_any_whitespace: bool) -> str:
    """A canonical string for a constraint: equal constraints (e.g. the same schema with keys in another
    order) share one compiled grammar."""
    return json.dumps([kind, spec, disable_any_whitespace], sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=256)
def compile_grammar(key: str) -> str:
    """llguidance grammar text for `constraint_key(...)`; `ValueError` with the backend's reason if invalid."""
    _require()
    kind, spec, compact = json.loads(key)
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else spec
        # Flexible whitespace is JSON's own rule (vLLM's default); compact JSON is vLLM's disable_any_whitespace.
        grammar = _llg.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": not compact})
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
