"""CPU throughput: fdlite vs Hugging Face transformers on the same workload, each in its own process.

A fixed set of prompts (seeded random token ids of mixed lengths) is generated greedily with a fixed
number of output tokens (EOS ignored), first by fdlite with continuous batching, then by
transformers' `generate` in padded batches of the same size. Both read the same model folder.
Each engine runs in a fresh process (interleaved rounds); transformers runs twice per round, as
installed and with the MKL setting fdlite applies to itself on AMD CPUs, and the ratio is taken against
the faster of the two. Prints output tokens/s of each and the ratio as a markdown table.

    python benchmarks/cpu_throughput.py                      # writes a random Qwen3-shaped model
    python benchmarks/cpu_throughput.py --model PATH         # any supported HF-layout model
    python benchmarks/cpu_throughput.py --ref cb8af1a        # and fdlite at that commit, interleaved

`--ref GIT_REF` adds a row for fdlite at an older commit (`git archive` into a temporary folder, its
worker run with PYTHONPATH pointing there), in the same interleaved rounds.

Needs the test extra (torch, transformers): pip install -e ".[cpu,test]".
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A small Qwen3 (GQA, q/k norm, tied embeddings) so a CPU run takes minutes, not hours.
BENCH_CONFIG = dict(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=2048,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0, bos_token_id=1,
                    eos_token_id=2)


def write_bench_model(path: str) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**BENCH_CONFIG)).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(k)).tolist() for k in rng.integers(min_len, max_len + 1, size=n)]


def run_fdlite(path: str, prompts: list[list[int]], max_tokens: int, batch: int) -> tuple[float, int]:
    from fdlite import LLM, SamplingParams

    llm = LLM(path, max_num_seqs=batch, max_model_len=1024, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def run_transformers(path: str, prompts: list[list[int]], max_tokens: int, batch: int) -> tuple[float, int]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = 0

    def gen(chunk: list[list[int]], new: int) -> int:
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                 min_new_tokens=new, eos_token_id=None, pad_token_id=pad)
        return (out.shape[1] - width) * len(chunk)

    gen(prompts[:2], 2)  # warm-up
    t = time.perf_counter()
    produced = sum(gen(prompts[i : i + batch], max_tokens) for i in range(0, len(prompts), batch))
    return time.perf_counter() - t, produced


def _worker(args) -> None:
    """One engine in this process; prints one JSON line (wall s, output tokens)."""
    import json

    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, _vocab(args.model), args.seed)
    if args.worker == "fdlite":
        import fdlite  # noqa: F401  (first: it sets up MKL before Paddle runs a matmul)
        import paddle

        paddle.set_device("cpu")
        dt, tok = run_fdlite(args.model, prompts, args.max_tokens, args.batch)
        version = f"Paddle {paddle.__version__}"
    else:
        import torch

        torch.set_num_threads(args.threads)
        dt, tok = run_transformers(args.model, prompts, args.max_tokens, args.batch)
        version = f"torch {torch.__version__}"
    print("RESULT " + json.dumps({"seconds": dt, "tokens": tok, "version": version}), flush=True)


def _vocab(path: str) -> int:
    import json

    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


# Each engine runs in a process of its own: torch and Paddle each bring an OpenMP runtime, and the one that
# runs second in a shared process was measured 4-10x slower on 2 cores, which made an in-process ratio unfair.
ENGINES = [  # (row label, worker, extra environment)
    ("fdlite (sets MKL_DEBUG_CPU_TYPE=5 itself on AMD)", "fdlite", {}),
    ("transformers, as installed", "transformers", {}),
    ("transformers, MKL_DEBUG_CPU_TYPE=5", "transformers", {"MKL_DEBUG_CPU_TYPE": "5"}),
]


def _spawn(args, worker: str, env_extra: dict[str, str]) -> dict:
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MKL_DEBUG_CPU_TYPE"}
    env.update(env_extra, OMP_NUM_THREADS=str(args.threads))
    if "PYTHONPATH" not in env_extra:  # this checkout, not an installed fdlite elsewhere
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--model", args.model,
           "--num-prompts", str(args.num_prompts), "--min-len", str(args.min_len), "--max-len", str(args.max_len),
           "--max-tokens", str(args.max_tokens), "--batch", str(args.batch), "--threads", str(args.threads),
           "--seed", str(args.seed)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{worker} worker failed (exit {out.returncode}):\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description="fdlite vs transformers output tokens/s on CPU, same workload.")
    ap.add_argument("--model", default=None, help="HF-layout model folder; default: a random Qwen3-shaped model.")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="fdlite max_num_seqs and the transformers batch size.")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads for both frameworks.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2,
                    help="Runs of each engine, interleaved; the table shows each engine's best.")
    ap.add_argument("--ref", default=None, metavar="GIT_REF", help="also run fdlite at this commit, interleaved")
    ap.add_argument("--worker", choices=["fdlite", "transformers"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args)

    args.model = args.model or write_bench_model(tempfile.mkdtemp(prefix="fdlite-bench-"))
    engines = list(ENGINES)
    if args.ref:
        import subprocess

        ref_tree = tempfile.mkdtemp(prefix=f"fdlite-ref-{args.ref}-")
        archive = subprocess.run(["git", "-C", ROOT, "archive", args.ref], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", ref_tree], input=archive, check=True)
        engines.insert(1, (f"fdlite at {args.ref}", "fdlite", {"PYTHONPATH": ref_tree}))
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for label, worker, env in engines:
            r = _spawn(args, worker, env)
            r["tps"] = r["tokens"] / r["seconds"]
            runs = best.setdefault(label, {"all": []})
            runs["all"].append(r["tps"])
            if r["tps"] >= runs.get("tps", 0):
                runs.update(r)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, threads={args.threads}")
    print(f"workload: {args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens, "
          f"{args.max_tokens} output tokens each, batch {args.batch}, greedy; each engine in its own process, "
          f"{args.rounds} interleaved rounds, best shown")
    print("| engine | wall s | output tokens | output tok/s (best) | all rounds tok/s |")
    print("|---|---|---|---|---|")
    for label, r in best.items():
        rounds = ", ".join(f"{x:.1f}" for x in r["all"])
        print(f"| {label} ({r['version']}) | {r['seconds']:.2f} | {r['tokens']} | {r['tps']:.1f} | {rounds} |")
    fd = best[ENGINES[0][0]]["tps"]
    hf = max(best[label]["tps"] for label, _, _ in ENGINES[1:])
    print(f"ratio fdlite / best transformers: {fd / hf:.2f}x")
    if args.ref:
        print(f"ratio fdlite / fdlite at {args.ref}: {fd / best[engines[1][0]]['tps']:.2f}x")


if __name__ == "__main__":
    main()
