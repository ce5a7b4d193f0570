"""The job's JSONL files: append-as-you-go writing, and the resume scan that repairs a crash's torn line.

Crash safety rests on three rules. Each result is one `write` of one whole line, to a file opened in
append mode, so a killed process leaves at most its last line torn, never an interleaving. The rerun
scans the file first and cuts a torn last line away (no trailing newline, or not a JSON object with an
`id`), so that request is simply run again: nothing is lost and nothing appears twice. A bad line
anywhere but the end is not something a crash produces; it is reported instead of silently dropped.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from fdlite.jobs.job_input import id_key
from fdlite.outputs import RequestOutput

# Every line reaches the OS at once (enough to survive a killed process); fsync, which protects against
# a power cut, costs milliseconds on some disks, so it runs at most this often and at close.
FSYNC_INTERVAL_S = 1.0


class OutputFileError(ValueError):
    """An existing output file that cannot be resumed safely."""


@dataclass
class ResumeState:
    """What an existing output file already holds."""

    done: set[str] = field(default_factory=set)  # id keys (see `id_key`)
    lines: int = 0  # complete result lines kept
    torn_bytes: int = 0  # bytes of a torn last line (cut away when repairing)
    duplicates: list[str] = field(default_factory=list)  # ids seen twice (a sign the file was edited)
    good_bytes: int = 0  # length of the kept, whole lines (where a reader following the file goes on)
    offsets: dict[str, tuple[int, int]] = field(default_factory=dict)  # id key -> (start, length) of its first line


def _parse_result(raw: bytes, key: str) -> tuple[dict | None, str]:
    if not raw.endswith(b"\n"):
        return None, "no line end"
    try:
        rec = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, "not valid JSON"
    if not isinstance(rec, dict) or key not in rec:
        return None, f"not a result object with an '{key}'"
    return rec, ""


def scan_output(path: str, repair: bool = True, key: str = "id", keep=None) -> ResumeState:
    """Collect the ids `path` already holds; with `repair`, truncate a torn last line away.

    `key` is the field holding the id ("custom_id" in OpenAI batch output); lines for which `keep(record)`
    is false (OpenAI error lines, rewritten by every merge) are valid but not results. A missing file is
    an empty state. Raises `OutputFileError` for a bad line that is not the last.
    """
    state = ResumeState()
    if not os.path.exists(path):
        return state
    if not os.path.isfile(path):
        raise OutputFileError(f"{path}: the output path is not a file")
    good_end = 0
    bad: tuple[int, str] | None = None
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if bad is not None:
                raise OutputFileError(
                    f"{path}:{bad[0]}: {bad[1]}; a crash can only tear the last line, so the file was changed "
                    "by something else: fix or delete that line, then rerun"
                )
            rec, why = _parse_result(raw, key)
            if rec is None:
                bad = (line_no, why)
                continue
            if keep is None or keep(rec):
                k = id_key(rec[key])
                if k in state.done:
                    state.duplicates.append(k)
                else:
                    state.offsets[k] = (good_end, len(raw))
                state.done.add(k)
                state.lines += 1
            good_end += len(raw)
    size = os.path.getsize(path)
    state.torn_bytes = size - good_end
    state.good_bytes = good_end
    if repair and state.torn_bytes:
        with open(path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return state


class JsonlAppender:
    """Append one JSON object per line; each line is written whole and handed to the OS at once.

    With `lazy`, the file is created by the first `append` (an errors file that only exists when needed).
    """

    def __init__(self, path: str, truncate: bool = False, lazy: bool = False):
        self.path = path
        self._truncate = truncate
        self._fd: int | None = None
        self._last_sync = time.monotonic()
        self.lines_written = 0
        if not lazy:
            self._open()

    def _open(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if self._truncate else 0)
        self._fd = os.open(self.path, flags, 0o644)
        self._truncate = False  # a reopen after close must not wipe what was written

    def append(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            self._open()
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:  # os.write may write less than asked (signals, odd filesystems): finish the line
            n = os.write(self._fd, view)
            view = view[n:]
        self.lines_written += 1
        now = time.monotonic()
        if now - self._last_sync >= FSYNC_INTERVAL_S:
            os.fsync(self._fd)
            self._last_sync = now

    def close(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_json_atomic(path: str, data: Any) -> None:
    """Write a JSON file so that readers see the old or the new content, never half of it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def result_record(request_id: str | int, out: RequestOutput) -> dict[str, Any]:
    """One output line: the input id, text, token counts, finish reason and this request's timing.

    The first completion's fields are at the top level; with `n` > 1 every completion is also listed
    under "outputs". `ttft_s` and `latency_s` count from when the request was handed to the engine.
    """
    first = out.outputs[0]
    m = out.metrics or {}
    arrival, first_tok, finish = m.get("arrival_time"), m.get("first_token_time"), m.get("finish_time")
    rec: dict[str, Any] = {
        "id": request_id,
        "text": first.text,
        "reasoning_content": first.reasoning_content,  # with a reasoning_parser: the <think> part, else null
        "token_ids": first.token_ids,
        "finish_reason": first.finish_reason,
        "stop_reason": first.stop_reason,
        "prompt_tokens": len(out.prompt_token_ids),
        "output_tokens": sum(len(c.token_ids) for c in out.outputs),
        "ttft_s": round(first_tok - arrival, 6) if first_tok is not None and arrival is not None else None,
        "latency_s": round(finish - arrival, 6) if finish is not None and arrival is not None else None,
        # Engine times are perf_counter() readings; turn the finish into wall-clock time for the reader.
        "finished_at": _wall_clock(finish),
    }
    if len(out.outputs) > 1:
        rec["outputs"] = [
            {"text": c.text, "reasoning_content": c.reasoning_content, "token_ids": c.token_ids, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for c in out.outputs
        ]
    return rec


def _wall_clock(perf_t: float | None) -> str | None:
    if perf_t is None:
        return None
    t = time.time() - (time.perf_counter() - perf_t)
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")
