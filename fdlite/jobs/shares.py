"""Data-parallel jobs: which requests each group runs, the part files it writes, and the merge into one output.

With `data_parallel_size: N` every group (a model copy of `tensor_parallel_size` processes) reads the whole
input and runs the share `assign_shares` gives it. The assignment depends only on the input file, so a
rerun gives every group the same share again and each resumes from its own part file, exactly as a
single-process job resumes from its output. Shares are balanced by estimated tokens (prompt length plus
the tokens asked for), not by count: one group must not get all the long prompts.

Files, all under `<output>.parts/` next to the output (so every node must see the output folder: a shared
filesystem, for several nodes):
- `share-K-of-N.jsonl`: group K's results, appended as they finish (crash-safe, like any job output);
- `share-K-of-N.errors.jsonl`: requests of group K that failed while running;
- `share-K-of-N.done.json`: written last, atomically, with group K's numbers: the share is complete.
When every marker is there, rank 0 writes the output in input order (temp file + rename) and removes the
folder. Parts of an earlier run with another N are read as done results and merged the same way.
"""

from __future__ import annotations

import glob
import heapq
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from typing import Any

from fdlite.jobs.job_input import JobRequest, LineError
from fdlite.jobs.job_output import ResumeState, scan_output

_PART = re.compile(r"share-(\d+)-of-(\d+)\.jsonl$")


def request_cost(req: JobRequest) -> int:
    """Estimated tokens of a request: prompt characters / 4 (a typical BPE ratio) plus the tokens asked for."""
    chars = len(req.prompt) if req.prompt is not None else sum(len(str(m.get("content") or "")) for m in req.messages)
    return (chars + 3) // 4 + (req.sampling.max_tokens or 0) * req.sampling.n


def assign_shares(costs: list[int], n: int) -> list[int]:
    """The share (0..n-1) of each request: largest first, each to the least-loaded share (ties: lowest index).

    Deterministic in `costs` alone, so every rank, and every rerun, computes the same assignment.
    """
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    loads = [(0, k) for k in range(n)]  # (load, share): a heap keeps the least-loaded share on top
    out = [0] * len(costs)
    for i in order:
        load, k = heapq.heappop(loads)
        out[i] = k
        heapq.heappush(loads, (load + costs[i], k))
    return out


class Parts:
    """Paths of the part files of a job whose output is `output`, split into `n` shares."""

    def __init__(self, output: str, n: int):
        self.output, self.n = output, n
        self.folder = output + ".parts"

    def part(self, k: int) -> str:
        return os.path.join(self.folder, f"share-{k}-of-{self.n}.jsonl")

    def errors(self, k: int) -> str:
        return os.path.join(self.folder, f"share-{k}-of-{self.n}.errors.jsonl")

    def marker(self, k: int) -> str:
        return os.path.join(self.folder, f"share-{k}-of-{self.n}.done.json")

    def all_parts(self) -> list[str]:
        """Every result part in the folder, this run's and those of an earlier run with another N."""
        return sorted(p for p in glob.glob(os.path.join(glob.escape(self.folder), "share-*-of-*.jsonl"))
                      if _PART.search(os.path.basename(p)))

    def stale_parts(self) -> list[str]:
        """Parts of an earlier run with another share count: done results nobody appends to any more."""
        return [p for p in self.all_parts() if int(_PART.search(os.path.basename(p)).group(2)) != self.n]

    def clear_markers(self) -> None:
        for path in glob.glob(os.path.join(glob.escape(self.folder), "share-*-of-*.done.json")):
            os.remove(path)

    def read_marker(self, k: int) -> dict[str, Any] | None:
        try:
            with open(self.marker(k), encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None


class PartTail:
    """Follows a part file another group appends to: new whole lines since the last look (rank 0's bar)."""

    def __init__(self, path: str, offset: int):
        self.path, self.offset = path, offset

    def poll(self, tokens: Callable[[dict], tuple[int, int]]) -> tuple[int, int, int]:
        """(new lines, their prompt tokens, their output tokens)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return 0, 0, 0
        whole = data[:data.rfind(b"\n") + 1]
        self.offset += len(whole)
        count = prompt = output = 0
        for raw in whole.splitlines():
            try:
                p, o = tokens(json.loads(raw))
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                continue
            count, prompt, output = count + 1, prompt + p, output + o
        return count, prompt, output


def merge_output(output: str, sources: list[tuple[str, ResumeState]], items: Iterable[JobRequest | LineError],
                 missing_line: Callable[[JobRequest], dict | None] | None = None,
                 error_line: Callable[[LineError], dict] | None = None) -> int:
    """Write `output` atomically: the result of every request of `items` (the input, re-read) in input order.

    `sources` are (file, its scan) pairs searched in order for a request's line. A request found nowhere
    gets `missing_line(req)` (an error object) or no line; a line error gets `error_line(err)` when given
    (OpenAI batch output lists them); results whose id is not in the input any more go last. Returns the
    number of lines written.
    """
    where: dict[str, tuple[str, int, int]] = {}
    for path, state in sources:
        for k, (start, length) in state.offsets.items():
            where.setdefault(k, (path, start, length))
    handles: dict[str, Any] = {}
    used: set[str] = set()
    tmp = f"{output}.tmp-{os.getpid()}"
    written = 0

    def copy(w, k: str) -> None:
        path, start, length = where[k]
        if path not in handles:
            handles[path] = open(path, "rb")
        f = handles[path]
        f.seek(start)
        w.write(f.read(length))

    try:
        with open(tmp, "wb") as w:
            for item in items:
                line = None
                if isinstance(item, LineError):
                    line = error_line(item) if error_line is not None else None
                elif item.key in where and item.key not in used:
                    copy(w, item.key)
                    used.add(item.key)
                    written += 1
                    continue
                elif missing_line is not None:
                    line = missing_line(item)
                if line is not None:
                    w.write((json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8"))
                    written += 1
            for k in where:  # results for ids no longer in the input: kept, as a plain job's output keeps them
                if k not in used:
                    copy(w, k)
                    written += 1
            w.flush()
            os.fsync(w.fileno())
    finally:
        for f in handles.values():
            f.close()
    os.replace(tmp, output)
    return written


def read_errors(paths: list[str]) -> list[dict[str, Any]]:
    """The per-request errors the groups wrote (whole lines only)."""
    out = []
    for path in paths:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    out.append(json.loads(raw))
                except (json.JSONDecodeError, UnicodeDecodeError):
                    pass  # a torn last line: that request is run again
    return out


def remove_parts(parts: Parts) -> None:
    shutil.rmtree(parts.folder, ignore_errors=True)


def scan_parts(paths: list[str], key: str) -> list[tuple[str, ResumeState]]:
    """Read-only scans of part files (other groups may be appending: their torn last lines are skipped)."""
    return [(p, scan_output(p, repair=False, key=key)) for p in paths]
