"""The repository reads the same on any machine: no absolute paths of one particular machine in tracked
files, and docs/benchmarks.md opens with one screen of current numbers.

A machine path is an absolute path under a root that only exists on the machine that wrote it: the
work and root folders, a user's home (Linux or macOS), the temporary folder with a name under it, or
/opt with a name under it. Raw results keep their meaning with a placeholder instead
(`<repo>`, `<venv>`, `<cache>`, `<out>`, `<tmp>`). Not machine paths: URLs (the path part of a URL
follows a host name), relative paths (`shared/...`, `../...`), placeholders (`<tmp>/x`), `~/...`, and
system locations that are the same everywhere (`/usr/...`, `/proc/...`, `/dev/null`).
"""

from __future__ import annotations

import os
import re
import subprocess


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A path starts at a boundary: not after a word character (URL path segments, relative paths), a dot
# (./x, ../x), a slash (x//y, file://), a tilde or a placeholder's ">". Short options glued to their
# path (-I/x, -L/x, -o/x) are the exception: the path starts right after the letter.
_START = r"(?:(?<![\w.~/>])|(?<=-[A-Za-z]))"
_ROOTS = "|".join((
    r"work/",
    r"root/",
    r"home/[A-Za-z_][\w.-]*/",
    r"Users/[A-Za-z_][\w.-]*/",
    r"tmp/[\w.-]",
    r"opt/[\w.-]",
))
MACHINE_PATH = re.compile(_START + "/(?:" + _ROOTS + ")")

# Files that are not text, by name (the gzipped tokenizer asset, images); anything else holding a NUL
# byte or not decoding as UTF-8 is skipped as binary too.
BINARY_SUFFIXES = (".gz", ".png", ".jpg", ".jpeg", ".gif", ".pdf", ".so", ".o", ".whl", ".zst")


def tracked_files() -> list[str]:
    """git's tracked files; outside a git checkout (a copy of the tree, as tools/mutation_check.py makes) every
    file but hidden folders, caches and build outputs."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True, check=True).stdout
        return [p for p in out.decode("utf-8").split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("__pycache__", "build", "dist")
                       and not d.endswith(".egg-info")]
        files += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in filenames]
    return files


def text_of(path: str) -> str | None:
    if path.endswith(BINARY_SUFFIXES):
        return None
    full = os.path.join(ROOT, path)
    if not os.path.isfile(full):  # deleted in the work tree, or a submodule
        return None
    with open(full, "rb") as f:
        data = f.read()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def machine_paths(text: str) -> list[tuple[int, str]]:
    """(line number, the line, shortened) of every line naming a machine path."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        m = MACHINE_PATH.search(line)
        if m:
            start = max(0, m.start() - 40)
            hits.append((number, line[start:m.start() + 80].strip()))
    return hits


def test_the_pattern_flags_machine_paths_and_nothing_else():
    s = "/"  # the examples are assembled, so that this file names no machine path itself
    flagged = [s + "work/main/fdlite/llm.py", "cd " + s + "root/out", "python " + s + "home/alice/x.py",
               s + "Users/bob/src", '"source": "' + s + "tmp/fdlite-ref-1234", "-I" + s + "tmp/paddle_inc/include",
               s + "opt/torch/.venv/lib/python3.12", "PATH=" + s + "usr/bin:" + s + "opt/x/bin",
               "(" + s + "tmp/x)", "`" + s + "work/x`"]
    clean = ["https://github.com/PaddlePaddle/FastDeploy/tree/develop/docs", "http://host:8000/tmp/x",
             "shared/gpu-paddle/prepare.sh", "../shared/work/x", "<tmp>/qwen3-h512", "<repo>/.gpuwork/tools",
             "~/.cache/fdlite/ops", s + "usr/local/cuda/bin/nvcc", "#!" + s + "usr/bin/env bash",
             s + "proc/cpuinfo", "${TMPDIR:-" + s + "tmp}/fdl_out", "TMPDIR=" + s + "tmp", s + "home/",
             "src/tmp/x", "$OUT" + s + "tmp/x", "frameworks/optimization"]
    for text in flagged:
        assert MACHINE_PATH.search(text), text
    for text in clean:
        assert not MACHINE_PATH.search(text), text


def test_no_machine_paths_in_tracked_files():
    problems = []
    for path in tracked_files():
        text = text_of(path)
        if text is None:
            continue
        problems += [f"{path}:{n}: {line}" for n, line in machine_paths(text)]
    assert not problems, ("absolute paths of one machine (use a relative path, or a placeholder such as <repo>, "
                          "<venv>, <cache>, <out>, <tmp>):\n" + "\n".join(problems))


def test_benchmarks_page_opens_with_one_screen_of_current_numbers():
    """docs/benchmarks.md: everything before its second `## ` heading (title, the current-numbers table) fits
    a screen of under 60 lines, and holds a table."""
    path = os.path.join(ROOT, "docs", "benchmarks.md")
    assert os.path.exists(path), "docs/benchmarks.md is missing"
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    headings = [i for i, line in enumerate(lines) if line.startswith("## ")]
    assert len(headings) >= 2, "docs/benchmarks.md needs a current-numbers section and then one section per topic"
    first_screen = lines[:headings[1]]
    assert len(first_screen) < 60, f"the current-numbers part is {len(first_screen)} lines; keep it under 60"
    assert any(line.startswith("|") for line in first_screen[headings[0]:]), "the current numbers are a table"
