"""The end-of-job summary: counts, tokens, wall time, throughput and latency percentiles.

It is printed for the person watching and written as JSON next to the output for the scheduler or
dashboard that runs the nightly job. Counts describe the whole job (resumed requests included);
tokens, times and latencies describe this run, the only one whose timing this process saw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default); None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class JobStats:
    """Accumulates what the summary reports, one finished request at a time."""

    lines: int = 0  # non-blank input records
    resumed: int = 0  # done by an earlier run
    completed: int = 0  # done by this run
    errors: int = 0  # per-line problems found by this run
    input_tokens: int = 0
    output_tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    constrained: int = 0  # completed requests with structured_outputs
    constrained_length: int = 0  # of those, how many had a completion cut by length (its output is incomplete)
    engine: dict[str, int] = field(default_factory=dict)  # Engine.stats() counters over this run

    def add_result(self, prompt_tokens: int, output_tokens: int, latency_s: float | None,
                   ttft_s: float | None, constrained: bool = False, cut_by_length: bool = False) -> None:
        self.completed += 1
        if constrained:
            self.constrained += 1
            self.constrained_length += cut_by_length
        self.input_tokens += prompt_tokens
        self.output_tokens += output_tokens
        if latency_s is not None:
            self.latencies_s.append(latency_s)
        if ttft_s is not None:
            self.ttfts_s.append(ttft_s)

    def absorb(self, other: dict[str, Any]) -> None:
        """Add another group's numbers (a `dataclasses.asdict` of its stats) to these (data-parallel jobs)."""
        for name in ("resumed", "completed", "errors", "input_tokens", "output_tokens"):
            setattr(self, name, getattr(self, name) + other[name])
        self.latencies_s += other["latencies_s"]
        self.ttfts_s += other["ttfts_s"]
        for k, v in other["engine"].items():
            self.engine[k] = self.engine.get(k, 0) + v

    def summary(self, *, job: str | None, output: str, errors_file: str, startup_s: float, wall_time_s: float,
                exit_code: int) -> dict[str, Any]:
        """The summary as a JSON-ready dict."""
        def pcts(xs: list[float]) -> dict[str, float | None]:
            return {"p50": _round(percentile(xs, 50)), "p99": _round(percentile(xs, 99))}

        return {
            "job": job,
            "output": output,
            "errors_file": errors_file,
            "requests": {
                "lines": self.lines,
                "done": self.resumed + self.completed,
                "resumed": self.resumed,
                "this_run": self.completed,
                "errors": self.errors,
            },
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "startup_s": _round(startup_s),
            "wall_time_s": _round(wall_time_s),
            "output_tokens_per_s": _round(self.output_tokens / wall_time_s if wall_time_s > 0 else 0.0),
            "prefill_tokens_computed": self.engine.get("prefill_tokens_computed", 0),
            "prefix_cache": _prefix_cache(self.engine),
            "structured_outputs": {"requests": self.constrained, "ended_by_length": self.constrained_length},
            "latency_s": pcts(self.latencies_s),
            "ttft_s": pcts(self.ttfts_s),
            "exit_code": exit_code,
        }


def _prefix_cache(engine: dict[str, int]) -> dict[str, Any]:
    queried, hit = engine.get("prefix_cache_queried_tokens", 0), engine.get("prefix_cache_hit_tokens", 0)
    return {"queried_tokens": queried, "hit_tokens": hit, "hit_rate": _round(hit / queried if queried else 0.0)}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def format_summary(s: dict[str, Any], summary_path: str, label: str = "fdlite run") -> str:
    """A few human lines for the terminal, the first one starting with `label` (the command)."""
    r = s["requests"]

    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f} s"

    lines = [
        f"{label}: {r['done']}/{r['lines']} requests done ({r['resumed']} resumed, {r['this_run']} this run), "
        f"{r['errors']} error{'' if r['errors'] == 1 else 's'}",
        f"  tokens: {s['input_tokens']} input, {s['output_tokens']} output; wall time {s['wall_time_s']:.2f} s "
        f"(+ {s['startup_s']:.2f} s startup); {s['output_tokens_per_s']:.1f} output tokens/s",
        f"  prefill: {s['prefill_tokens_computed']} tokens computed; prefix cache hit {s['prefix_cache']['hit_tokens']} "
        f"of {s['prefix_cache']['queried_tokens']} tokens looked up ({100 * s['prefix_cache']['hit_rate']:.1f}%)",
        f"  latency p50 {sec(s['latency_s']['p50'])}, p99 {sec(s['latency_s']['p99'])}; "
        f"time to first token p50 {sec(s['ttft_s']['p50'])}, p99 {sec(s['ttft_s']['p99'])}",
        f"  output: {s['output']}",
    ]
    so = s["structured_outputs"]
    if so["requests"]:
        noun = "request" if so["requests"] == 1 else "requests"
        lines.append(f"  structured outputs: {so['requests']} constrained {noun}, {so['ended_by_length']} ended by "
                     "length (incomplete: raise max_tokens)")
    if r["errors"]:
        lines.append(f"  errors: {s['errors_file']}")
    lines.append(f"  summary: {summary_path}")
    return "\n".join(lines)
