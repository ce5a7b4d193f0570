"""Data-parallel job throughput: the same `fdlite run` job with data_parallel_size 1 and 2 on CPU.

dp=1 is one process (`python -m fdlite run job.yaml`); dp=2 is two, started by Paddle's launcher
(`python -m paddle.distributed.launch --nproc_per_node 2 fdlite_cli.py run job.yaml`), each running half
of the prompts (balanced by length) on its own copy of the model. Both use the built-in model (random
weights, Qwen3's 151,936-row vocabulary, so the LM head dominates: model-bound) and greedy decoding
with a fixed output length. Prints a markdown table: output tokens/s of the generation phase (from the
job summary; for dp=2 rank 0's wall time from its first request to the merged output) and the whole
command's wall time, startup included.

    python benchmarks/data_parallel.py [--prompts 64] [--max-tokens 32] [--max-num-seqs 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_job(folder: str, n: int, max_tokens: int, max_num_seqs: int, dp: int) -> str:
    with open(os.path.join(folder, "prompts.jsonl"), "w") as f:
        for i in range(n):
            words = "alpha beta gamma delta " * (2 + i % 7)  # mixed lengths, 9 to 33 tokens
            f.write(json.dumps({"id": i, "prompt": f"Request {i}: {words}"}) + "\n")
    job = {"max_num_seqs": max_num_seqs, "max_model_len": 256, "data_parallel_size": dp,
           "sampling": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True},
           "input": "prompts.jsonl", "output": f"out/dp{dp}.jsonl"}
    path = os.path.join(folder, f"dp{dp}.yaml")
    with open(path, "w") as f:
        json.dump(job, f)
    return path


def run(folder: str, dp: int, job: str) -> tuple[dict, float, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    if dp == 1:
        cmd = [sys.executable, "-m", "fdlite", "run", job, "--no-progress"]
    else:
        with open(os.path.join(folder, "fdlite_cli.py"), "w") as f:
            f.write("from fdlite.cli import main\nraise SystemExit(main())\n")
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(dp),
               "--log_dir", os.path.join(folder, f"log{dp}"), "fdlite_cli.py", "run", job, "--no-progress"]
    t = time.perf_counter()
    subprocess.run(cmd, cwd=folder, env=env, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t
    with open(os.path.join(folder, "out", f"dp{dp}.summary.json")) as f:
        return json.load(f), wall, " ".join(c if c != sys.executable else "python" for c in cmd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for dp in (1, 2):
            job = write_job(folder, args.prompts, args.max_tokens, args.max_num_seqs, dp)
            s, wall, cmd = run(folder, dp, job)
            assert s["requests"]["done"] == args.prompts, s["requests"]
            rows.append((dp, s["output_tokens"], s["wall_time_s"], s["output_tokens_per_s"], wall, cmd))
        with open(os.path.join(folder, "out", "dp1.jsonl")) as f1, open(os.path.join(folder, "out", "dp2.jsonl")) as f2:
            same = [json.loads(a)["token_ids"] for a in f1] == [json.loads(b)["token_ids"] for b in f2]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; {args.prompts} prompts, "
          f"{args.max_tokens} output tokens each, max_num_seqs {args.max_num_seqs}; outputs identical: {same}\n")
    print("| data_parallel_size | output tokens | generation wall s | output tokens/s | command wall s |")
    print("|---|---|---|---|---|")
    for dp, tokens, gen_s, tps, wall, _ in rows:
        print(f"| {dp} | {tokens} | {gen_s:.2f} | {tps:.1f} | {wall:.1f} |")
    print(f"\nspeed-up (output tokens/s): {rows[1][3] / rows[0][3]:.2f}x; whole command: {rows[0][4] / rows[1][4]:.2f}x")
    for *_, cmd in rows:
        print(f"    {cmd}")


if __name__ == "__main__":
    main()
