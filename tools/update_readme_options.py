"""Regenerate the options table in README.md from `EngineConfig` (the one copy of every help string)."""

from __future__ import annotations

import os
import re
import sys

START, END = "<!-- options:start -->", "<!-- options:end -->"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
sys.path.insert(0, ROOT)  # document this checkout's options, not an installed fdlite's


def options_table() -> str:
    from fdlite.config import EngineConfig

    rows = ["| option | default | help |", "|---|---|---|"]
    rows += [f"| `{name}` | `{default!r}` | {help_} |" for name, default, help_ in EngineConfig.help_table()]
    return "\n".join(rows)


def render(text: str) -> str:
    block = f"{START}\n{options_table()}\n{END}"
    return re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)


if __name__ == "__main__":
    with open(README, encoding="utf-8") as f:
        text = f.read()
    with open(README, "w", encoding="utf-8") as f:
        f.write(render(text))
