"""Structured outputs on the built-in default model (random weights): the grammar, not the model, gives the shape.

Outputs are checked with independent checkers (`jsonschema`, `re.fullmatch`, a small parser written here),
never with the backend's own; every output that ends with finish_reason "stop" must pass.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from fdlite import LLM, SamplingParams
from fdlite.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from fdlite.structured.grammar import FLEXIBLE_WHITESPACE

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8},
                           "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "address"],
    "additionalProperties": False,
}
DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]
LARK = 'start: expr\nexpr: term (OP term)~0..2\nterm: NUM | "(" NUM OP NUM ")"\nOP: "+" | "*"\nNUM: /[0-9]{1,3}/'
EBNF = 'root ::= answer " " num\nanswer ::= "yes" | "no"\nnum ::= [0-9] [0-9]?'


def _is_expr(text: str) -> bool:
    """`LARK`'s language, by a tokenizer and a hand-written parser."""
    parts = re.findall(r"[0-9]+|[-+*()]|.", text)
    if "".join(parts) != text:
        return False
    pos = 0

    def take(pred) -> bool:
        nonlocal pos
        if pos < len(parts) and pred(parts[pos]):
            pos += 1
            return True
        return False

    num = lambda p: p.isdigit() and len(p) <= 3  # noqa: E731
    op = lambda p: p in ("+", "*")  # noqa: E731

    def term() -> bool:
        if take(num):
            return True
        return take(lambda p: p == "(") and take(num) and take(op) and take(num) and take(lambda p: p == ")")

    if not term():
        return False
    for _ in range(2):
        if pos < len(parts) and not (take(op) and term()):
            return False
    return pos == len(parts)


def _check_json_schema(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def _check_json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


KINDS = [  # (constraint, checker of a finished output's text)
    (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), _check_json_schema),
    (StructuredOutputsParams(regex=DATE), lambda t: re.fullmatch(DATE, t) or pytest.fail(f"not a date: {t!r}")),
    (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES or pytest.fail(f"not a choice: {t!r}")),
    (StructuredOutputsParams(grammar=LARK), lambda t: _is_expr(t) or pytest.fail(f"not an expression: {t!r}")),
    (StructuredOutputsParams(json_object=True, disable_any_whitespace=True), _check_json_object),
    (StructuredOutputsParams(grammar=EBNF), lambda t: re.fullmatch(r"(yes|no) [0-9]{1,2}", t) or pytest.fail(t)),
]
# JSON's flexible whitespace (vLLM's default): a random model spends many tokens on whitespace, so it is
# only in the smaller tests.
FLEXIBLE = (StructuredOutputsParams(json=SCHEMA, whitespace_pattern=FLEXIBLE_WHITESPACE), _check_json_schema)
# A second schema of bounded size: every string has a maxLength, no additional properties.
SETTINGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
                   "ok": {"type": "boolean"}},
    "required": ["city", "tags", "ok"],
    "additionalProperties": False,
}


def _requests(num: int, max_tokens: int = 64, kinds=KINDS) -> list[SamplingParams]:
    """Every kind in turn; greedy and seeded sampling (with top-p / top-k) alternating."""
    out = []
    for i in range(num):
        so, _ = kinds[i % len(kinds)]
        turn = i // len(kinds)  # every kind gets greedy and sampled turns
        sampling = dict(temperature=0) if turn % 2 == 0 else dict(temperature=1.0, top_p=0.95,
                                                                  top_k=[0, 50][turn % 4 // 2], seed=i)
        out.append(SamplingParams(max_tokens=max_tokens, structured_outputs=so, **sampling))
    return out


PROMPTS = ["Extract the fields as JSON:", "Date:", "Sentiment?", "1+2=", "JSON please", "你好"]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=64, max_model_len=256)


def _check(outs, params) -> dict[str, list[int]]:
    """Check every output; returns kind -> [stopped, length] counts."""
    counts: dict[str, list[int]] = {}
    for out, p in zip(outs, params):
        assert out.error is None, out.error
        k, checker = next((k, c) for k, (so, c) in enumerate(KINDS + [FLEXIBLE]) if so is p.structured_outputs)
        for c in out.outputs:
            tally = counts.setdefault(f"{k}:{p.structured_outputs.kind}", [0, 0])
            if c.finish_reason == "stop":
                assert c.stop_reason is None  # ended by EOS: the grammar was complete
                checker(c.text)
                tally[0] += 1
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == p.max_tokens
                tally[1] += 1
    return counts


def test_200_constrained_requests_validate_and_repeat(llm):
    params = _requests(200)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(200)]
    first = llm.generate(prompts, params, use_tqdm=False)
    counts = _check(first, params)
    # Not vacuous: each kind finishes most of the time, but for any-JSON-object, where a random model
    # seldom picks the closing brace among all the keys it may still add.
    assert len(counts) == len(KINDS)
    for kind, (stopped, length) in counts.items():
        assert stopped >= (3 if kind.endswith("json_object") else 0.7 * (stopped + length)), counts
    print("stop/length per kind:", counts, "tokens:", sum(len(o.outputs[0].token_ids) for o in first),
          "steps:", llm.last_generate_stats["num_steps"], "s:", llm.last_generate_stats["elapsed_s"])
    # The whole run again, same seeds: every output identical (same seeds, same outputs).
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in first]
    assert llm.engine.structured.num_compiled == len(KINDS)  # one compiled matcher per distinct constraint


def test_json_with_the_default_whitespace_finishes_on_a_random_model(llm):
    """64 JSON requests on the built-in (random-weight) model, greedy and sampled: with JSON's own whitespace
    rule every one ran to max_tokens on spaces and newlines; with the default bound each ends with a
    complete, valid object well within max_tokens=200."""
    schemas = [SCHEMA, SETTINGS]
    params = [SamplingParams(max_tokens=200, structured_outputs={"json": schemas[i % 2]},
                             **(dict(temperature=0) if i % 4 < 2 else dict(temperature=1.0, top_p=0.95, seed=i)))
              for i in range(64)]
    outs = llm.generate([f"JSON number {i}:" for i in range(64)], params, use_tqdm=False)
    for i, out in enumerate(outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (i, c.text[:300])
        jsonschema.validate(json.loads(c.text), schemas[i % 2])
        # At most one newline in a row, and an indentation of at most 24 after it.
        assert "\n\n" not in c.text and not re.search(r"\n[ \t]{25}", c.text), repr(c.text)
    assert max(len(o.outputs[0].token_ids) for o in outs) < 200


def test_mixed_batch_leaves_unconstrained_rows_alone(llm):
    plain = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=1.0, top_k=40, seed=12, max_tokens=20, logprobs=2)]
    plain_prompts = ["Once upon a time", "def main():", "The weather"]
    alone = llm.generate(plain_prompts, plain, use_tqdm=False)
    constrained = _requests(12, max_tokens=40, kinds=KINDS + [FLEXIBLE])
    mixed = llm.generate(plain_prompts + PROMPTS * 2, plain + constrained, use_tqdm=False)
    for a, m in zip(alone, mixed[:3]):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
        assert m.outputs[0].finish_reason == a.outputs[0].finish_reason
    _check(mixed[3:], constrained)
    # The constrained ones are not free text: a JSON row starts with "{".
    assert mixed[3].outputs[0].text.startswith("{")


def test_n_stop_strings_and_length(llm):
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    outs = llm.generate(["a", "b"], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=96, structured_outputs=so),
                        use_tqdm=False)
    for c in (c for o in outs for c in o.outputs):
        if c.finish_reason == "stop":
            _check_json_schema(c.text)
    assert len({tuple(c.token_ids) for o in outs for c in o.outputs}) == 6  # the children sample apart
    # Cut by length: reported as "length", never as a success.
    cut = llm.generate("a", SamplingParams(temperature=0, max_tokens=5, structured_outputs=so), use_tqdm=False)[0]
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 5
    # A stop string still ends a constrained output (its text is cut there, so it is not the grammar's).
    stopped = llm.generate("a", SamplingParams(temperature=0, max_tokens=96, stop=['"age"'], structured_outputs=so),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"age"' and stopped.text.startswith("{")


def test_min_tokens_does_not_break_a_complete_grammar(llm):
    # The choice is complete after a token or two; min_tokens holds EOS back, the grammar allows only EOS:
    # the grammar wins, and the text is still the choice.
    out = llm.generate("x", SamplingParams(temperature=0, max_tokens=8, min_tokens=4,
                                           structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no")


@pytest.mark.parametrize("options", [dict(async_scheduling=True),
                                     dict(num_gpu_blocks_override=12, max_model_len=128)])
def test_same_outputs_with_async_scheduling_and_under_preemption(llm, options):
    params = _requests(12, max_tokens=48)
    prompts = [PROMPTS[i % 3] * 12 for i in range(12)]  # shared prefixes of more than a block: prefix-cache hits
    want = llm.generate(prompts, params, use_tqdm=False)
    other = LLM(**{"max_model_len": 256, "max_num_seqs": 64, "block_size": 16, **options})
    got = other.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    if "num_gpu_blocks_override" in options:
        assert other.last_generate_stats["num_preemptions"] > 0
    assert other.last_generate_stats["prefix_cache_hit_tokens"] > 0


# ---- validation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, match", [
    (dict(json={"type": "nonsense"}), r"structured_outputs\.json: invalid JSON schema: .*nonsense"),
    (dict(json={"type": "array", "uniqueItems": True}), r"structured_outputs\.json: .*uniqueItems"),
    (dict(json="{not json"), r"structured_outputs\.json must be a JSON schema \(invalid JSON text"),
    (dict(regex="[0-9"), r"structured_outputs\.regex: invalid regex: .*unclosed character class"),
    (dict(grammar="start: missing_rule"), r"structured_outputs\.grammar: invalid grammar: .*missing_rule"),
    (dict(choice=[]), r"structured_outputs\.choice must be a non-empty list"),
    (dict(choice=["a", 3]), r"structured_outputs\.choice must be a non-empty list"),
    (dict(), r"exactly one of json, regex, choice, grammar, json_object"),
    (dict(regex="a", choice=["a"]), r"exactly one of"),
    (dict(json_object="yes"), r"structured_outputs\.json_object must be true"),
])
def test_bad_constraints_raise_naming_the_field_and_reason(bad, match):
    with pytest.raises(ValueError, match="(?s)" + match):  # the backend's reasons span lines
        SamplingParams(structured_outputs=bad)


def test_aliases_and_spellings():
    gd = SamplingParams(guided_decoding=GuidedDecodingParams(regex=DATE)).structured_outputs
    assert gd.regex == DATE and gd.kind == "regex"
    rf = SamplingParams(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    assert rf.structured_outputs.json == SCHEMA
    assert SamplingParams(response_format={"type": "json_object"}).structured_outputs.json_object is True
    assert SamplingParams(response_format={"type": "text"}).structured_outputs is None
    from_json = SamplingParams.from_dict({"structured_outputs": json.dumps({"choice": ["a", "b"]})})
    assert from_json.structured_outputs.choice == ["a", "b"]
    # Same content, keys in another order: one key, so one compiled grammar.
    reordered = dict(reversed(list(SCHEMA.items())))
    assert StructuredOutputsParams(json=reordered).key == StructuredOutputsParams(json=SCHEMA).key
    with pytest.raises(ValueError, match="give one of structured_outputs and response_format"):
        SamplingParams(structured_outputs={"regex": "a"}, response_format={"type": "json_object"})
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with structured_outputs"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="unknown key 'schema'"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="response_format"):
        SamplingParams(response_format={"type": "xml"})
    assert SamplingParams(structured_outputs={"regex": "a"}).clone().structured_outputs.key


def test_without_a_tokenizer_the_request_fails_alone():
    llm = LLM(skip_tokenizer_init=True, max_num_seqs=2, max_model_len=64)
    outs = llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=3, structured_outputs={"regex": "a+"}),
                                              SamplingParams(max_tokens=3)], use_tqdm=False)
    assert outs[0].error and "need a tokenizer" in outs[0].error and outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 3


def test_bitmask_is_applied_to_its_rows_only():
    from fdlite.sample.sampler import apply_token_bitmask

    x = np.zeros((2, 70), np.float32)
    mask = np.zeros((2, 3), np.int32)
    mask[0, 0] = 1 << 3  # token 3
    mask[1, 2] = 1 << 5  # token 69
    apply_token_bitmask(x, mask)
    assert np.isfinite(x[0]).nonzero()[0].tolist() == [3] and np.isfinite(x[1]).nonzero()[0].tolist() == [69]


# ---- batch jobs ----------------------------------------------------------------------------------------------


def test_job_defaults_line_overrides_per_line_errors_and_summary(tmp_path):
    from fdlite import cli

    records = [
        {"id": "default", "prompt": "Mood?"},
        {"id": "schema", "prompt": "Person:", "sampling": {"response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}},
        {"id": "date", "prompt": "When?", "sampling": {"structured_outputs": {"regex": DATE}}},
        {"id": "old", "prompt": "Yes?", "sampling": {"guided_decoding": {"choice": ["yes", "no"]}}},
        {"id": "cut", "prompt": "Person:", "sampling": {"max_tokens": 3, "structured_outputs": {"json": SCHEMA}}},
        {"id": "free", "prompt": "Anything", "sampling": {"structured_outputs": None, "max_tokens": 4}},
        {"id": "bad-regex", "prompt": "x", "sampling": {"structured_outputs": {"regex": "([0-9]"}}},
        {"id": "bad-schema", "prompt": "x", "sampling": {"response_format": {
            "type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}}}},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    job = {"max_num_seqs": 8, "max_model_len": 256, "input": "in.jsonl", "output": "out.jsonl",
           "sampling": {"temperature": 0, "max_tokens": 64,
                        "structured_outputs": {"choice": CHOICES}}}
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    assert cli.main(["run", str(tmp_path / "job.yaml")]) == 1  # the job ran; two lines had errors
    rows = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert rows["default"]["text"] in CHOICES
    if rows["schema"]["finish_reason"] == "stop":
        _check_json_schema(rows["schema"]["text"])
    assert re.fullmatch(DATE, rows["date"]["text"]) and rows["old"]["text"] in ("yes", "no")
    assert rows["cut"]["finish_reason"] == "length" and rows["free"]["finish_reason"] == "length"
    errors = {e["id"]: e["error"] for e in map(json.loads, (tmp_path / "out.errors.jsonl").read_text().splitlines())}
    assert set(errors) == {"bad-regex", "bad-schema"}
    assert "structured_outputs.regex: invalid regex" in errors["bad-regex"]
    assert "uniqueItems" in errors["bad-schema"]
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    cut = sum(rows[i]["finish_reason"] == "length" for i in ("default", "schema", "date", "old", "cut"))
    assert summary["structured_outputs"] == {"requests": 5, "ended_by_length": cut} and cut >= 1


def test_job_file_errors_name_the_key(tmp_path):
    from fdlite.jobs.job_config import JobConfigError, load_job

    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    job = {"input": "in.jsonl", "output": "out.jsonl", "sampling": {"structured_outputs": {"regex": "("}}}
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    with pytest.raises(JobConfigError, match="sampling.structured_outputs: .*invalid regex"):
        load_job(str(tmp_path / "job.yaml"))
    job["sampling"] = {"response_format": {"type": "json_object"}}
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    assert load_job(str(tmp_path / "job.yaml")).sampling.structured_outputs.json_object is True
