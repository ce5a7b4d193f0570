"""The package's shape: no import cycles between its packages, and the step as one call per phase."""

from __future__ import annotations

import ast
import collections
import inspect
import pathlib

import pytest

from fdlite import LLM, SamplingParams
from fdlite.runner.engine import Engine

PKG = pathlib.Path(__file__).resolve().parents[1] / "fdlite"


def _unit(module: str) -> str:
    """fdlite.runner.engine -> runner; fdlite.llm -> llm (a top-level module is a unit of its own)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fdlite"


def package_imports() -> dict[str, dict[str, set[str]]]:
    """{unit: {imported unit: files that import it}}, from every import statement (lazy ones included)."""
    edges: dict[str, dict[str, set[str]]] = collections.defaultdict(lambda: collections.defaultdict(set))
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        src = _unit(".".join(p for p in rel.parts if p != "__init__"))
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] if node.module != "fdlite" else [f"fdlite.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("fdlite.") and _unit(name) != src:
                    edges[src][_unit(name)].add(str(path.relative_to(PKG.parent)))
    return edges


def find_cycle(edges) -> list[str] | None:
    """One cycle of the unit graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(edges):
        if u not in state and (found := visit(u)):
            return found
    return None


def test_no_import_cycles_between_packages():
    edges = package_imports()
    assert {"layers", "kernels", "sample", "runner", "models"} <= set(edges), sorted(edges)
    cycle = find_cycle(edges)
    if cycle:
        where = [f"{a} -> {b}: {sorted(edges[a][b])}" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle between packages: " + " -> ".join(cycle) + "\n" + "\n".join(where))


def test_the_cycle_finder_finds_a_planted_cycle():
    edges = package_imports()
    edges["kernels"]["runner"].add("planted")
    assert find_cycle(edges) is not None


def test_engine_step_is_short():
    lines = [ln for ln in inspect.getsource(Engine.step).splitlines()[1:] if ln.strip() and not ln.strip().startswith(("#", '"""'))]
    assert len(lines) <= 15, "\n".join(lines)


class _Counting:
    """Forwards to `inner` and counts each method the engine takes from it (when taken, on the engine's
    thread: async scheduling calls `execute` on a worker thread)."""

    def __init__(self, inner, calls: collections.Counter, name: str):
        self._inner, self._calls, self._name = inner, calls, name

    def __getattr__(self, attr):
        value = getattr(self._inner, attr)
        if callable(value) and not isinstance(value, type):
            self._calls[f"{self._name}.{attr}"] += 1
        return value


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_call_per_phase_each_step(model_dirs, async_scheduling):
    """Per step the engine calls the scheduler's schedule and update_from_output, the worker's prepare,
    execute and commit, and the output processor's process, once each, and nothing else of theirs."""
    llm = LLM(model_dirs["qwen3"], skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_model_len=128,
              max_num_batched_tokens=64, async_scheduling=async_scheduling)
    engine = llm.engine
    calls: collections.Counter = collections.Counter()
    inner_step = engine.step
    steps = []

    def step():
        calls_before = collections.Counter(calls)
        engine.scheduler = _Counting(scheduler, calls, "scheduler")
        engine.worker = _Counting(worker, calls, "worker")
        engine.outputs = _Counting(outputs, calls, "outputs")
        try:
            return inner_step()
        finally:
            engine.scheduler, engine.worker, engine.outputs = scheduler, worker, outputs
            steps.append(calls - calls_before)

    scheduler, worker, outputs = engine.scheduler, engine.worker, engine.outputs
    engine.step = step
    prompts = [[3 + i, 5, 7, 11] * (3 + 5 * i) for i in range(7)]  # more requests than rows: joins mid-run
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(steps) > 5
    per_phase = {"scheduler.schedule", "scheduler.update_from_output", "worker.prepare", "worker.execute",
                 "worker.commit", "outputs.process"}
    allowed = per_phase | {"scheduler.has_unfinished"}  # async: whether to schedule ahead
    for k, c in enumerate(steps):
        assert set(c) <= allowed, (k, c)
    # Async: the first step also schedules and prepares the one it starts with, and the last schedules
    # nothing ahead; in between every phase runs once a step.
    middle = steps[1:-1] if async_scheduling else steps
    for k, c in enumerate(middle):
        assert all(c[name] == 1 for name in per_phase), (k, c)
