"""Summarise run_profile_step.sh's Nsight Compute CSV: the profiled step's kernels, each kernel name's count and
total microseconds, and their sum beside the step's wall time recorded by e2e_harness.py's `profile` section.

    python tools/gpu/profile_report.py ncu.csv profile.json
"""

from __future__ import annotations

import csv
import json
import re
import sys
from collections import defaultdict


def short(name: str) -> str:
    """A kernel's name without its template arguments and parameter list."""
    name = re.sub(r"\(.*$", "", name)
    depth, out = 0, []
    for ch in name:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">"
    return "".join(out).replace("void ", "").strip().split("::")[-1]


def read_kernels(path: str) -> list[tuple[str, float]]:
    """(kernel name, microseconds) in launch order."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    rows = list(csv.DictReader(lines))
    out = []
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "nsecond")
        us = v / 1e3 if unit.startswith("n") else v if unit.startswith("u") else v * 1e3
        out.append((r["Kernel Name"], us))
    return out


def main() -> None:
    kernels = read_kernels(sys.argv[1])
    meta = json.load(open(sys.argv[2])).get("results", {}).get("profiled_steps", {}).get("steps", {})
    order = sorted(meta.items(), key=lambda kv: kv[1]["order"])
    steps = [kernels]
    for i, ks in enumerate(steps):
        info = order[i][1] if i < len(order) else {}
        kind = order[i][0] if i < len(order) else "?"
        total = sum(us for _, us in ks)
        print(f"\n== step {i}: {kind} {json.dumps(info)}: {len(ks)} kernels, {total:.0f} us of kernel time")
        groups = defaultdict(lambda: [0, 0.0])
        for name, us in ks:
            g = groups[short(name)]
            g[0] += 1
            g[1] += us
        for name, (n, us) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
            print(f"  {us:9.1f} us  {100 * us / total:5.1f}%  x{n:<4d} {name}")


if __name__ == "__main__":
    main()
