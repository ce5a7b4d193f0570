"""Input readers: JSONL, CSV and text become requests; each bad line becomes an error with its line number."""

import json

import pytest

from fdlite.jobs.job_input import InputFileError, JobRequest, LineError, check_input, read_requests
from fdlite.sampling_params import SamplingParams

DEFAULTS = SamplingParams(temperature=0, max_tokens=8)


def read(tmp_path, name, text, fmt, defaults=DEFAULTS):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return list(read_requests(str(path), fmt, defaults))


def test_jsonl_requests_ids_and_overrides(tmp_path):
    lines = [
        json.dumps({"id": "a", "prompt": "Hello"}),
        "",  # blank lines are skipped, but still count for line numbers
        json.dumps({"prompt": "no id: the line number is the id"}),
        json.dumps({"id": 7, "messages": [{"role": "user", "content": "hi"}], "sampling": {"max_tokens": 3}}),
    ]
    items = read(tmp_path, "in.jsonl", "\n".join(lines) + "\n", "jsonl")
    assert [type(i) for i in items] == [JobRequest] * 3
    a, b, c = items
    assert (a.line, a.id, a.prompt, a.messages) == (1, "a", "Hello", None)
    assert (b.line, b.id, b.key) == (3, 3, "3")
    assert (c.line, c.id, c.prompt, c.messages) == (4, 7, None, [{"role": "user", "content": "hi"}])
    assert a.sampling is DEFAULTS  # no override: the job's defaults, shared
    assert c.sampling.max_tokens == 3 and c.sampling.temperature == 0  # override on top of the defaults


BAD_JSONL = [
    ('{"id": "x", "prompt": "ok"}', None),
    ('{"id": "y", "prompt": "unterminated}', "invalid JSON: Unterminated string starting at (column 23)"),
    ('["not", "an", "object"]', "a line must be a JSON object, got an array"),
    ('{"id": "z"}', "missing 'prompt' (or 'messages')"),
    ('{"id": "w", "prompt": 5}', "'prompt' must be a string, got a number"),
    ('{"id": "v", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}',
     "give either 'prompt' or 'messages', not both"),
    ('{"id": "u", "messages": []}', "'messages' must be a non-empty list of objects with a string 'role' (and 'content')"),
    ('{"id": "t", "promt": "typo"}', "unknown key 'promt'; did you mean 'prompt'?"),
    ('{"id": "x", "prompt": "again"}', "duplicate id 'x' (first used on line 1)"),
    ('{"id": ["a"], "prompt": "p"}', "'id' must be a non-empty string or an int, got ['a']"),
    ('{"id": "s", "prompt": "p", "sampling": {"temperature": -1}}',
     "sampling: SamplingParams.temperature must be >= 0, got -1.0"),
    ('{"id": "r", "prompt": "p", "sampling": {"max_token": 4}}',
     "sampling: unknown option 'max_token'; did you mean 'max_tokens'?"),
    ('{"id": "q", "prompt": "p", "sampling": 3}', "sampling: must be an object of sampling options, got a number"),
]


def test_each_bad_jsonl_line_is_an_error_with_its_line_and_reading_goes_on(tmp_path):
    text = "\n".join(line for line, _ in BAD_JSONL) + "\n"
    items = read(tmp_path, "in.jsonl", text, "jsonl")
    assert len(items) == len(BAD_JSONL)
    for line_no, (item, (_, reason)) in enumerate(zip(items, BAD_JSONL), start=1):
        if reason is None:
            assert isinstance(item, JobRequest)
        else:
            assert isinstance(item, LineError) and (item.line, item.reason) == (line_no, reason)
    by_line = {i.line: i for i in items}
    assert by_line[2].id is None  # unreadable line: no id
    assert by_line[4].id == "z" and by_line[9].id == "x"


def test_invalid_utf8_line_is_an_error(tmp_path):
    items = read(tmp_path, "in.jsonl", b'{"prompt": "a"}\n{"prompt": "\xff"}\n{"prompt": "b"}\n', "jsonl")
    assert isinstance(items[1], LineError) and items[1].reason == "not valid UTF-8 (byte 13)"
    assert [i.prompt for i in (items[0], items[2])] == ["a", "b"]


def test_id_given_as_line_number_collides_with_default_id(tmp_path):
    items = read(tmp_path, "in.jsonl", '{"prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "jsonl")
    assert items[0].id == 1
    assert items[1].reason == "duplicate id 1 (first used on line 1)"


def test_csv_rows(tmp_path):
    text = ('id,prompt,sampling\n'
            'a,Hello,\n'
            'b,"two\nlines",{"max_tokens": 2}\n'
            ',no id,\n'
            'c,p,{bad json\n'
            'd,,\n'
            'e,p,,extra\n')
    items = read(tmp_path, "in.csv", text, "csv")
    a, b, noid, bad, empty, extra = items
    assert (a.line, a.id, a.prompt) == (2, "a", "Hello")
    assert (b.line, b.prompt, b.sampling.max_tokens) == (3, "two\nlines", 2)
    assert (noid.line, noid.id) == (5, 5)  # the quoted cell spanned lines 3-4
    assert (bad.line, bad.reason) == (6, "sampling: invalid JSON: Expecting property name enclosed in double quotes "
                                         "(column 2)")
    assert empty.prompt == ""  # the engine reports "prompt is empty" for it, like an empty JSONL prompt
    assert (extra.line, extra.reason) == (8, "the row has 4 cells; the header has 3")


def test_text_lines(tmp_path):
    items = read(tmp_path, "in.txt", "first prompt\r\n\n  second, with spaces  \n", "text")
    assert [(i.line, i.id, i.prompt) for i in items] == [(1, 1, "first prompt"), (3, 3, "  second, with spaces  ")]


def test_whole_file_problems_raise(tmp_path):
    with pytest.raises(InputFileError, match="file not found"):
        check_input(str(tmp_path / "nope.jsonl"), "jsonl")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(InputFileError, match=r"empty.csv:1: empty CSV file"):
        check_input(str(tmp_path / "empty.csv"), "csv")
