"""Paddle's CPU GEMM with and without MKL's AMD fast path (`MKL_DEBUG_CPU_TYPE=5`, set by `import fdlite`).

Each measurement runs in a fresh subprocess (MKL reads the variable once, at its first GEMM), with
the variable removed from the environment unless the row says otherwise:

- paddle as shipped: `import paddle`, no fdlite;
- paddle after `import fdlite`: what an fdlite user gets (fdlite sets the variable on AMD CPUs with AVX2);
- paddle with MKL_DEBUG_CPU_TYPE=5 set by hand; torch and numpy for reference.

`--check-outputs MODEL` also generates greedily on MODEL (an HF-layout folder) with MKL on its
shipped path (a Paddle matmul runs before `import fdlite`, so the setting comes too late) and on the
fast path, and compares the tokens.

    python benchmarks/cpu_gemm.py [--threads 1] [--m 1024 --k 1024 --n 3072] [--check-outputs PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VAR = "MKL_DEBUG_CPU_TYPE"

_TIMER = """
import json, sys, time
m, k, n, reps = {m}, {k}, {n}, {reps}
{setup}
best = float("inf")
for i in range(reps + 3):
    t = time.perf_counter(); mm(); dt = time.perf_counter() - t
    if i >= 3: best = min(best, dt)
print(json.dumps({{"gflops": 2 * m * k * n / best / 1e9, "var": __import__("os").environ.get("{var}")}}))
"""

_SETUPS = {
    "paddle": "import paddle\na, b = paddle.randn([m, k]), paddle.randn([k, n])\nmm = lambda: paddle.matmul(a, b)",
    "torch": "import torch\na, b = torch.randn(m, k), torch.randn(k, n)\nmm = lambda: a @ b",
    "numpy": "import numpy as np\na, b = np.random.rand(m, k).astype(np.float32), np.random.rand(k, n).astype(np.float32)\nmm = lambda: a @ b",
}

# (row label, setup key, code run first, extra environment)
_ROWS = [
    ("paddle, as shipped", "paddle", "", {}),
    ("paddle after `import fdlite`", "paddle", "import fdlite", {}),
    (f"paddle, {VAR}=5 by hand", "paddle", "", {VAR: "5"}),
    ("torch", "torch", "", {}),
    ("numpy", "numpy", "", {}),
]

_GREEDY = """
import json, sys
{first}
from fdlite import LLM, SamplingParams
llm = LLM(sys.argv[1], max_num_seqs=8, max_model_len=256, skip_tokenizer_init=True)
import numpy as np
rng = np.random.default_rng(0)
vocab = llm.model_config.vocab_size
prompts = [rng.integers(3, vocab, size=int(n)).tolist() for n in rng.integers(8, 64, size=8)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
print(json.dumps({{"tokens": [o.outputs[0].token_ids for o in outs], "var": __import__("os").environ.get("{var}")}}))
"""

# A Paddle matmul before fdlite is imported: MKL picks its (slow) path then, the variable comes too late.
_SLOW_FIRST = "import paddle\npaddle.matmul(paddle.ones([8, 8]), paddle.ones([8, 8])).numpy()"


def _env(threads: int, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != VAR}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONPATH=ROOT, **extra)
    return env


def _run(code: str, env: dict[str, str], *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def gemm_rows(args) -> list[tuple[str, float, str | None]]:
    rows = []
    for label, key, first, extra in _ROWS:
        setup = f"{first}\n{_SETUPS[key]}" if first else _SETUPS[key]
        code = _TIMER.format(m=args.m, k=args.k, n=args.n, reps=args.reps, setup=setup, var=VAR)
        r = _run(code, _env(args.threads, extra))
        rows.append((label, r["gflops"], r["var"]))
    return rows


def check_outputs(model: str, threads: int) -> bool:
    slow = _run(_GREEDY.format(first=_SLOW_FIRST, var=VAR), _env(threads, {}), model)
    fast = _run(_GREEDY.format(first="", var=VAR), _env(threads, {}), model)
    same = slow["tokens"] == fast["tokens"]
    n = sum(len(t) for t in fast["tokens"])
    print(f"greedy tokens, shipped path vs fast path ({VAR}={fast['var']}): "
          f"{'identical' if same else 'DIFFERENT'} ({len(fast['tokens'])} sequences, {n} tokens)")
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--m", type=int, default=1024)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions (best is reported), after 3 warm-ups")
    ap.add_argument("--check-outputs", metavar="MODEL", default=None)
    args = ap.parse_args()

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; float32 [{args.m}, {args.k}] x [{args.k}, {args.n}], "
          f"{args.threads} thread(s), best of {args.reps}")
    print(f"| library | GFLOP/s | {VAR} |\n|---|---|---|")
    for label, gflops, var in gemm_rows(args):
        print(f"| {label} | {gflops:.1f} | {var if var is not None else 'unset'} |")
    if args.check_outputs and not check_outputs(args.check_outputs, args.threads):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
