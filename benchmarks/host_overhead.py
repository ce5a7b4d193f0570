"""Host overhead per decode step: the engine's own cost around a model whose forward is negligible.

Why: on a GPU a small model decodes a batch of 256 in a few milliseconds per step, so everything the
host does per step (scheduling, building inputs, sampling, detokenizing, stop checks) must cost far
less than that. This measures it on CPU with a Qwen2-shaped model of hidden size 32 and one layer
(random weights, HF layout, written by transformers as the tests do, with the real Qwen3 tokenizer so
output processing runs as for a user): `max_num_seqs=256`, N prompts of 16 tokens, `ignore_eos`;

    ms per decode step = (time to generate LONG tokens - time to generate SHORT tokens) / (LONG - SHORT)

with LONG=72, SHORT=8 for the greedy cases at vocabulary 500 (batch 1, 32, 256), and fewer tokens for
the cases at Qwen3's 151,936-token vocabulary (greedy and `temperature=0.8, top_p=0.9`, batch 64; `logprobs`
adds logprobs=5 to the latter), where
the pre-redesign sampler takes seconds per step. Each repeat times a (short, long) pair; the best
repeat counts. Cheap perf_counter timers around the phase functions (about a microsecond per call, a
few calls per step) give its per-phase breakdown, differenced the same way. Phase times are exclusive
(a timed phase called inside another is counted once, in its own row); "other" is what no timer
covered (the `LLM` loop), so the row sums to the total.

`--ref GIT_REF` also measures an older commit in the same sitting: `git archive` of the ref into a
temporary folder, this same script run there in a subprocess with PYTHONPATH (and `--source`) pointing
at it, on the same model files; both tables are printed with the ratio ref / current.

    python benchmarks/host_overhead.py                     # current tree
    python benchmarks/host_overhead.py --ref c1f31ec       # and the pre-redesign code beside it
    python benchmarks/host_overhead.py --batches 256 --large-vocab-batches --json out.json
    python benchmarks/host_overhead.py --batches 256 --large-vocab-modes --async-scheduling

With `--async-scheduling` the forward runs in a worker thread while the next step is scheduled, so
phase times (per thread) overlap and can add up to more than the step: "other" goes negative by
the overlap. The "host" column is the step minus the forward.

`--stub-forward` replaces the model's forward with fixed random logits (in a `--ref` run too): the
step then is the engine's host work alone, as a GPU would see it beside an asynchronous forward,
without the CPU forward's effect on caches (which makes the same host code slower after it).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# phase -> candidate functions, "Class.method" or "function", found in the loaded fdlite modules; the first
# that exists is timed, names that do not exist are skipped. The first candidate is the name in the code
# since the step became prepare / execute / commit (the worker), the next ones the names before it
# (cb8af1a, then c1f31ec). Now "schedule" is the scheduler alone, "inputs" the worker's prepare (the
# scheduler's diff applied to the persistent batch, then the inputs built), "output" the worker's commit,
# the output processor and the scheduler's update. At cb8af1a "schedule" also applied the diff and
# "output" was `Engine._take_tokens`. Before the redesign output processing (detokenization, stop checks)
# is inlined in Engine.step, so its exclusive time (the step minus the phases timed inside it) is the
# output-processing row there. "forward" is the runner's execute without the sampler inside it (the forward
# and the LM head), or its forward where there is no execute.
PHASES: dict[str, list[str]] = {
    "schedule": ["Engine._schedule", "Scheduler.schedule"],
    "inputs": ["Worker.prepare", "InputBatch.prepare_inputs", "build_inputs"],
    "forward": ["ModelRunner.execute", "ModelRunner.forward"],  # execute's own time: the forward and LM head
    "sample": ["Sampler.__call__"],
    "output": ["Engine._postprocess", "Engine._take_tokens", "Engine.step"],
}

SAMPLED = dict(temperature=0.8, top_p=0.9)
PROMPT_LEN = 16
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048)
# The GPU kernels take head_dim 64 / 128 / 256 only (TINY's is 8): hidden 128 as two heads of 64, one KV head.
TINY_GPU = dict(TINY, hidden_size=128, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)


@dataclass
class Case:
    vocab: int
    batch: int
    sampling: str  # "greedy", "sampled" (temperature=0.8, top_p=0.9) or "logprobs" (sampled, with logprobs=5)
    short: int     # output tokens of the short run
    long: int      # output tokens of the long run

    @property
    def label(self) -> str:
        return f"vocab {self.vocab}, batch {self.batch}, {self.sampling}"


@dataclass
class CaseResult:
    case: Case
    ms_per_step: float                 # best of the clean repeats
    runs_ms: list[float]               # every clean repeat
    phases_ms: dict[str, float]        # per decode step, of the best repeat; they sum to its ms_per_step
    timed: dict[str, str] = field(default_factory=dict)  # phase -> the function timed


# ---- phase timers ---------------------------------------------------------------------------------


class PhaseTimers:
    """perf_counter timers wrapped around functions; exclusive time per phase."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        # Time spent in timed callees, per open call, per thread (async scheduling runs the forward in a worker).
        self._local = threading.local()
        self._undo: list[tuple[object, str, object]] = []

    def _wrap(self, phase: str, fn):
        timers = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            children = timers._children()
            t0 = time.perf_counter()
            children.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                inner = children.pop()
                timers.totals[phase] = timers.totals.get(phase, 0.0) + dt - inner
                if children:
                    children[-1] += dt

        return timed

    def _children(self) -> list[float]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def _patch(self, owner: object, name: str, phase: str) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        self._undo.append((owner, name, original))
        setattr(owner, name, self._wrap(phase, original))

    def install(self, table: dict[str, list[str]]) -> dict[str, str]:
        """Wrap the first existing candidate of each phase; return phase -> name timed."""
        timed = {}
        for phase, names in table.items():
            for name in names:
                targets = _find(name)
                if targets:
                    for owner, attr in targets:
                        self._patch(owner, attr, phase)
                    timed[phase] = name
                    break
        return timed

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)


def _fdlite_modules() -> list:
    return [m for n, m in list(sys.modules.items()) if m is not None and (n == "fdlite" or n.startswith("fdlite."))]


def _find(name: str) -> list[tuple[object, str]]:
    """(owner, attribute) pairs to patch for `name` in the loaded fdlite modules: the class defining the
    method, or every module holding the function under that name."""
    modules = _fdlite_modules()
    if "." in name:
        cls_name, method = name.split(".", 1)
        classes = {id(c): c for m in modules for c in [getattr(m, cls_name, None)]
                   if isinstance(c, type) and c.__module__.startswith("fdlite")}
        return [(c, method) for c in classes.values() if method in c.__dict__]
    fns = {id(f): f for m in modules for f in [getattr(m, name, None)]
           if callable(f) and getattr(f, "__module__", "").startswith("fdlite")}
    return [(m, name) for m in modules if id(getattr(m, name, None)) in fns]


# ---- the measurement ------------------------------------------------------------------------------


def write_models(model_dir: str, vocabs: list[int], shapes: dict = TINY) -> None:
    """Random Qwen2-shaped models (`shapes`: TINY or TINY_GPU, 1 layer) with the real Qwen3 tokenizer, HF layout,
    one per vocabulary.

    Written in a subprocess (transformers and torch), so the measuring processes import only fdlite and Paddle.
    """
    todo = [v for v in vocabs if not os.path.isfile(os.path.join(model_dir, f"vocab{v}", "config.json"))]
    if not todo:
        return
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from hf_models import add_qwen3_tokenizer, "
            "write_random_model\n"
            "for v in sys.argv[4:]:\n"
            "    add_qwen3_tokenizer(write_random_model(os.path.join(sys.argv[2], 'vocab' + v), 'qwen2', "
            "vocab_size=int(v), **eval(sys.argv[3])))")
    subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "tests"), model_dir, repr(shapes), *map(str, todo)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _prompts(batch: int, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(batch)
    return [rng.integers(3, min(vocab, 500), size=PROMPT_LEN).tolist() for _ in range(batch)]


def _params(case: Case, max_tokens: int):
    from fdlite import SamplingParams

    extra = {"sampled": SAMPLED, "logprobs": {**SAMPLED, "logprobs": 5}}.get(case.sampling, dict(temperature=0.0))
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **extra)


def _timed_generate(llm, prompts, params) -> float:
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t


def measure(llm, case: Case, repeats: int) -> CaseResult:
    prompts = _prompts(case.batch, case.vocab)
    steps = case.long - case.short
    llm.generate(prompts, _params(case, 2), use_tqdm=False)  # warm-up: first calls of every path
    timers = PhaseTimers()
    timed = timers.install(PHASES)
    runs: list[tuple[float, dict[str, float]]] = []
    try:
        for _ in range(repeats):
            timers.totals.clear()
            t_short = _timed_generate(llm, prompts, _params(case, case.short))
            short = timers.snapshot()
            t_long = _timed_generate(llm, prompts, _params(case, case.long))
            long = {p: t - short.get(p, 0.0) for p, t in timers.snapshot().items()}
            total = (t_long - t_short) / steps * 1e3
            # The long run's phase time minus the short run's, per decode step.
            phases = {p: (long.get(p, 0.0) - short.get(p, 0.0)) / steps * 1e3 for p in PHASES}
            phases["other"] = total - sum(phases.values())
            runs.append((total, phases))
    finally:
        timers.uninstall()
    best_total, best_phases = min(runs, key=lambda r: r[0])
    return CaseResult(case, best_total, [r[0] for r in runs], best_phases, timed)


def stub_forward(llm) -> None:
    """Replace the model's forward with fixed random logits for the rows that sample: what is left is
    the engine's host work alone, without the CPU forward's effect on caches and the allocator."""
    import paddle

    logits = paddle.randn([llm.config.max_num_seqs, llm.model_config.vocab_size])

    def forward(flat, use_graphs=True):
        n = len(flat.logits_indices)
        return logits[:n] if n else None

    llm.runner.forward = forward  # the step's forward up to cb8af1a and at 33a11e1
    # Since prompt logprobs the step takes the hidden states, then the LM head: the "hidden states" here are the
    # flat batch itself, and the LM head the fixed logits of its sampling rows.
    llm.runner.forward_hidden = lambda flat, use_graphs=True, patch=None: (flat, None)  # (patch: async scheduling)
    llm.runner.model.compute_logits = lambda flat, indices: logits[: len(flat.logits_indices)]


def cases_from(args) -> list[Case]:
    cases = [Case(args.vocab, b, "greedy", *args.tokens) for b in args.batches]
    for mode in args.large_vocab_modes:
        cases += [Case(args.large_vocab, b, mode, *args.large_vocab_tokens) for b in args.large_vocab_batches]
    return cases


def run_here(args, model_dir: str) -> dict:
    """Measure every case with the fdlite found first on sys.path; the JSON-able result."""
    import logging

    import fdlite
    from fdlite import LLM

    logging.getLogger("fdlite").setLevel(logging.WARNING)  # no per-generate log lines between the tables
    results, llms = [], {}
    for case in cases_from(args):
        if case.vocab not in llms:
            llms.clear()  # one model alive at a time
            path = os.path.join(model_dir, f"vocab{case.vocab}")
            extra = {"async_scheduling": True} if args.async_scheduling else {}
            llms[case.vocab] = LLM(path, max_num_seqs=args.max_num_seqs, max_model_len=128, seed=0, **extra)
            if args.stub_forward:
                stub_forward(llms[case.vocab])
        r = measure(llms[case.vocab], case, args.repeats)
        print(f"  {case.label}: {r.ms_per_step:.2f} ms per decode step", file=sys.stderr, flush=True)
        results.append(asdict(r))
    return {"source": os.path.dirname(os.path.dirname(os.path.abspath(fdlite.__file__))),
            "commit": _commit(args.source), "results": results}


def _commit(source: str) -> str:
    stamp = os.path.join(source, ".fdlite_ref")
    if os.path.isfile(stamp):
        with open(stamp, encoding="utf-8") as f:
            return f.read().strip()
    out = subprocess.run(["git", "-C", source, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", source, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def run_ref(args, ref: str, model_dir: str) -> dict:
    """This script, run on `git archive REF` in a subprocess; its JSON."""
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", ref], capture_output=True, text=True,
                            check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix=f"fdlite-ref-{commit}-") as tree:
        archive = subprocess.run(["git", "-C", ROOT, "archive", commit], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        with open(os.path.join(tree, ".fdlite_ref"), "w", encoding="utf-8") as f:
            f.write(commit)
        out = os.path.join(tree, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--source", tree, "--model-dir", model_dir, "--json", out,
               *_case_args(args)]
        env = dict(os.environ, PYTHONPATH=tree)
        print(f"ref {ref} ({commit}): running in {tree}", file=sys.stderr, flush=True)
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def _case_args(args) -> list[str]:
    out = ["--repeats", str(args.repeats), "--max-num-seqs", str(args.max_num_seqs), "--vocab", str(args.vocab),
           "--large-vocab", str(args.large_vocab), "--tokens", *map(str, args.tokens),
           "--large-vocab-tokens", *map(str, args.large_vocab_tokens), "--batches", *map(str, args.batches),
           "--large-vocab-batches", *map(str, args.large_vocab_batches),
           "--large-vocab-modes", *args.large_vocab_modes]
    if args.async_scheduling:
        out.append("--async-scheduling")
    if args.stub_forward:
        out.append("--stub-forward")
    return out


# ---- output -------------------------------------------------------------------------------------

_COLS = ["schedule", "inputs", "forward", "sample", "output", "other"]


def table(run: dict, title: str) -> str:
    lines = [f"### {title}", "",
             "| case | ms per decode step (best) | all runs | host (all but forward) | " + " | ".join(_COLS) + " |",
             "|---" * (4 + len(_COLS)) + "|"]
    for r in run["results"]:
        c = Case(**r["case"])
        runs = ", ".join(f"{x:.2f}" for x in r["runs_ms"])
        host = r["ms_per_step"] - r["phases_ms"]["forward"]
        lines.append(f"| {c.label} | {r['ms_per_step']:.2f} | {runs} | {host:.2f} | "
                     + " | ".join(f"{r['phases_ms'][p]:.2f}" for p in _COLS) + " |")
    timed = {p: n for r in run["results"] for p, n in r["timed"].items()}
    lines += ["", "phases timed: " + ", ".join(f"{p} = {timed.get(p, '(none found)')}" for p in PHASES)]
    return "\n".join(lines)


def ratio_table(current: dict, ref: dict, ref_name: str) -> str:
    lines = ["### ratio " + ref_name + " / current", "", "| case | ms per step | " + " | ".join(_COLS) + " |",
             "|---" * (2 + len(_COLS)) + "|"]

    def div(a: float, b: float) -> str:
        return f"{a / b:.1f}x" if a >= 0.05 and b >= 0.05 else "-"  # below timer noise: no ratio

    for cur, old in zip(current["results"], ref["results"]):
        c = Case(**cur["case"])
        lines.append(f"| {c.label} | {div(old['ms_per_step'], cur['ms_per_step'])} | "
                     + " | ".join(div(old["phases_ms"][p], cur["phases_ms"][p]) for p in _COLS) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 32, 256], help="greedy cases at --vocab")
    ap.add_argument("--tokens", type=int, nargs=2, default=[8, 72], metavar=("SHORT", "LONG"))
    ap.add_argument("--vocab", type=int, default=500)
    ap.add_argument("--large-vocab", type=int, default=151936)
    ap.add_argument("--large-vocab-batches", type=int, nargs="*", default=[64])
    ap.add_argument("--large-vocab-tokens", type=int, nargs=2, default=[2, 6], metavar=("SHORT", "LONG"))
    ap.add_argument("--large-vocab-modes", nargs="*", default=["greedy", "sampled"], choices=["greedy", "sampled", "logprobs"])
    ap.add_argument("--repeats", type=int, default=3, help="clean (short, long) pairs per case; the best counts")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--ref", default=None, metavar="GIT_REF", help="also measure this commit, side by side")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results (and the ref's) as JSON")
    ap.add_argument("--model-dir", default=None, help="reuse the models written there (vocab<N>/ folders)")
    ap.add_argument("--source", default=ROOT, help="the fdlite source tree to measure (default: this checkout)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="run the current tree with async_scheduling=True (the ref runs without it)")
    ap.add_argument("--stub-forward", action="store_true",
                    help="replace the forward by fixed logits (current tree only): the host work alone")
    ap.add_argument("--gpu-shapes", action="store_true",
                    help="hidden 128 as two heads of 64 (the GPU kernels' head_dim) instead of hidden 32")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a --ref run: JSON only
    args = ap.parse_args()
    args.source = os.path.abspath(args.source)
    sys.path.insert(0, args.source)

    model_dir = args.model_dir or tempfile.mkdtemp(prefix="fdlite-host-overhead-")
    write_models(model_dir, sorted({c.vocab for c in cases_from(args)}), TINY_GPU if args.gpu_shapes else TINY)

    current = run_here(args, model_dir)
    out = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
           "date": time.strftime("%Y-%m-%d"), "current": current}
    ref = None
    if args.ref:
        ref = run_ref(args, args.ref, model_dir)
        out["ref"] = ref
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(current if args.child else out, f, indent=2)
    if args.child:
        return  # the parent prints
    print(f"machine: {out['machine']}; model: Qwen2-shaped, hidden {128 if args.gpu_shapes else 32}, 1 layer, random; "
          f"max_num_seqs={args.max_num_seqs}, {PROMPT_LEN}-token prompts, ignore_eos")
    print(table(current, f"current ({current['commit']}, {current['source']})"))
    if ref is not None:
        print()
        print(table(ref, f"ref {args.ref} ({ref['commit']})"))
        print()
        print(ratio_table(current, ref, args.ref))


if __name__ == "__main__":
    main()
