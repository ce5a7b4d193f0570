"""Read a job's prompts file (JSONL, CSV, plain text or an OpenAI batch file) into requests, one per line,
or per-line errors.

A nightly job over a million lines must not die on line 40,312: every problem a single line can have
(bad JSON, no prompt, an unknown key, a duplicate id, an invalid sampling override) becomes a `LineError`
with the line number and a reason, and reading goes on. Only a problem with the whole file (missing,
a CSV header without a `prompt` column) raises `InputFileError`, before any model is loaded.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fdlite.config import unknown_key_error
from fdlite.sampling_params import ALIASES, SamplingParams

FORMATS = ("jsonl", "csv", "text", "openai")
LINE_KEYS = ("id", "prompt", "messages", "sampling")  # keys of a JSONL object, columns of a CSV file
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".txt": "text"}


class InputFileError(ValueError):
    """The input file as a whole cannot be read; `line` is where (1-based) when one line is to blame."""

    def __init__(self, path: str, reason: str, line: int | None = None):
        self.path, self.reason, self.line = path, reason, line
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {reason}")


@dataclass
class JobRequest:
    """One prompt to run: exactly one of `prompt` and `messages` is set."""

    line: int  # 1-based line of the input file where the record starts
    id: str | int  # the line's "id", or its line number
    prompt: str | None
    messages: list[dict] | None
    sampling: SamplingParams  # the job's defaults with this line's overrides applied
    url: str | None = None  # OpenAI batch files: the endpoint ("/v1/chat/completions" or "/v1/completions")
    options: dict[str, Any] | None = None  # OpenAI batch files: what shapes the response (model, logprobs kind)

    @property
    def key(self) -> str:
        return id_key(self.id)


@dataclass
class LineError:
    """A line that cannot become a request."""

    line: int
    id: str | int | None  # None when the line has no readable id
    reason: str
    # OpenAI batch files: the error object's code and the body field at fault; `param` set means the
    # request body was at fault (an HTTP 400 response), unset means the batch line itself was.
    code: str | None = None
    param: str | None = None


def id_key(request_id: str | int) -> str:
    """The key ids are compared by (resume, duplicates): 7 and "7" are the same request."""
    return str(request_id)


def detect_format(path: str) -> str | None:
    """jsonl / csv / text from the file extension, or None when the extension says nothing.

    A JSON-lines file whose first lines are all OpenAI batch requests (`custom_id` and `body`) is "openai";
    one that mixes those with other objects is ambiguous: None.
    """
    fmt = _EXTENSIONS.get(os.path.splitext(path)[1].lower())
    if fmt != "jsonl" or not os.path.isfile(path):
        return fmt
    kinds = set()
    for _, row in itertools.islice(_jsonl_rows(path), 100):
        if isinstance(row, dict):
            kinds.add("openai" if "custom_id" in row and "body" in row else "jsonl")
    return kinds.pop() if len(kinds) == 1 else (None if kinds else "jsonl")


def check_input(path: str, fmt: str) -> None:
    """Fail early on what would make every line fail: a missing file or a CSV header without `prompt`."""
    if not os.path.isfile(path):
        raise InputFileError(path, "file not found" if not os.path.exists(path) else "not a file")
    if fmt == "csv":
        with open(path, encoding="utf-8-sig", newline="") as f:
            _csv_header(path, csv.reader(f))


def read_requests(path: str, fmt: str, defaults: SamplingParams) -> Iterator[JobRequest | LineError]:
    """Yield a `JobRequest` or a `LineError` for every non-blank record of `path`, in file order."""
    if fmt == "openai":
        from fdlite.jobs.openai_batch import read_batch_requests

        yield from read_batch_requests(_jsonl_rows(path), defaults)
        return
    rows = {"jsonl": _jsonl_rows, "csv": _csv_rows, "text": _text_rows}[fmt](path)
    base = defaults.to_dict()
    first_line: dict[str, int] = {}  # id key -> line that used it first
    for line, row in rows:
        if isinstance(row, LineError):
            yield row
            continue
        request_id = row.get("id", line)
        if isinstance(request_id, bool) or not isinstance(request_id, (str, int)) or request_id == "":
            yield LineError(line, None, f"'id' must be a non-empty string or an int, got {request_id!r}")
            continue
        key = id_key(request_id)
        if key in first_line:
            yield LineError(line, request_id, f"duplicate id {request_id!r} (first used on line {first_line[key]})")
            continue
        first_line[key] = line
        problem = _line_problem(row)
        if problem is not None:
            yield LineError(line, request_id, problem)
            continue
        try:
            params = _apply_overrides(defaults, base, row.get("sampling"))
        except ValueError as e:
            yield LineError(line, request_id, f"sampling: {e}")
            continue
        yield JobRequest(line, request_id, row.get("prompt"), row.get("messages"), params)


def _line_problem(row: dict) -> str | None:
    for key in row:
        if key not in LINE_KEYS:
            return str(unknown_key_error("key", key, list(LINE_KEYS)))
    if "prompt" in row and "messages" in row:
        return "give either 'prompt' or 'messages', not both"
    if "prompt" not in row and "messages" not in row:
        return "missing 'prompt' (or 'messages')"
    if "prompt" in row and not isinstance(row["prompt"], str):
        return f"'prompt' must be a string, got {_json_type(row['prompt'])}"
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs
        ):
            return "'messages' must be a non-empty list of objects with a string 'role' (and 'content')"
    return None


def _apply_overrides(defaults: SamplingParams, base: dict[str, Any], overrides: Any) -> SamplingParams:
    if overrides is None:
        return defaults
    if not isinstance(overrides, dict):
        raise ValueError(f"must be an object of sampling options, got {_json_type(overrides)}")
    known = list(base)
    for key in overrides:
        if key not in base and key not in ALIASES:
            raise unknown_key_error("option", key, known)
    return SamplingParams.from_dict(merge_sampling(base, overrides))


def merge_sampling(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` on top; a constraint given in `overrides` under any of its names
    (structured_outputs, guided_decoding, response_format) replaces the one in `base`."""
    names = ("structured_outputs", *ALIASES)
    if any(overrides.get(n) is not None for n in names):
        base = {k: v for k, v in base.items() if k not in names}
    return {**base, **overrides}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


# ---- readers: (line number, row dict or LineError) ------------------------------------------------------


def _decoded_lines(path: str) -> Iterator[tuple[int, str | LineError]]:
    # Binary, decoded line by line: one badly encoded line is that line's problem, not the whole file's.
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte-order mark, as some editors write
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield line_no, LineError(line_no, None, f"not valid UTF-8 (byte {e.start + 1})")
                continue
            if text.strip():
                yield line_no, text


def _jsonl_rows(path: str) -> Iterator[tuple[int, dict | LineError]]:
    for line_no, text in _decoded_lines(path):
        if isinstance(text, LineError):
            yield line_no, text
            continue
        try:
            row = json.loads(text.rstrip("\r\n"))
        except json.JSONDecodeError as e:
            yield line_no, LineError(line_no, None, f"invalid JSON: {e.msg} (column {e.colno})")
            continue
        if not isinstance(row, dict):
            yield line_no, LineError(line_no, None, f"a line must be a JSON object, got {_json_type(row)}")
            continue
        yield line_no, row


def _text_rows(path: str) -> Iterator[tuple[int, dict | LineError]]:
    for line_no, text in _decoded_lines(path):
        yield line_no, text if isinstance(text, LineError) else {"prompt": text.rstrip("\r\n")}


def _csv_header(path: str, reader) -> list[str]:
    try:
        header = next(reader)
    except StopIteration:
        raise InputFileError(path, "empty CSV file: expected a header row with a 'prompt' column", line=1) from None
    header = [h.strip() for h in header]
    for name in header:
        if name not in LINE_KEYS:
            raise InputFileError(path, str(unknown_key_error("CSV column", name, list(LINE_KEYS))), line=1)
    if "prompt" not in header:
        raise InputFileError(path, f"the CSV header has no 'prompt' column (columns: {', '.join(header)})", line=1)
    return header


def _csv_rows(path: str) -> Iterator[tuple[int, dict | LineError]]:
    # Prompts can be longer than csv's default 128 KiB field limit.
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f)
        header = _csv_header(path, reader)
        end = reader.line_num
        while True:
            start = end + 1  # a quoted cell may span lines: report the line where the record starts
            try:
                cells = next(reader)
            except StopIteration:
                return
            except UnicodeDecodeError as e:
                raise InputFileError(path, f"not valid UTF-8: {e.reason}", line=start) from None
            except csv.Error as e:
                end = reader.line_num
                yield start, LineError(start, None, f"invalid CSV: {e}")
                continue
            end = reader.line_num
            if not any(c.strip() for c in cells):
                continue
            if len(cells) > len(header):
                yield start, LineError(start, None, f"the row has {len(cells)} cells; the header has {len(header)}")
                continue
            row: dict[str, Any] = {}
            for name, cell in zip(header, cells):
                if name == "prompt":
                    row["prompt"] = cell
                elif name == "id" and cell.strip():
                    row["id"] = cell.strip()
                elif name == "sampling" and cell.strip():
                    try:
                        row["sampling"] = json.loads(cell)
                    except json.JSONDecodeError as e:
                        row = LineError(start, row.get("id"), f"sampling: invalid JSON: {e.msg} (column {e.colno})")
                        break
            yield start, row
