"""A batch job with many more requests than rows: sequences join while others decode, so most steps mix prefill
chunks with decodes. Reports how many steps replayed a CUDA graph (and how many of those were token-count graphs
of steps with prefill tokens), output tokens/s, and the host time per step (the step's wall time outside the
worker's `execute`, which on the GPU waits for the device when the sampled ids come back).

The job (issue 24's): N requests, prompts of 100-1,024 random tokens, 32-256 output tokens each, `ignore_eos`,
temperature 0.6; `max_num_seqs=256`, `max_num_batched_tokens=8192`. `--compare` runs it twice in one process,
with token-count graphs and without (`cudagraph_mixed_capture_sizes=[]`: decode graphs only, the engine before
them), each `LLM` with the same `--blocks` KV blocks.

    python benchmarks/churn_job.py --model <folder> --requests 2048 --compare          # on a GPU
    python benchmarks/churn_job.py --requests 64 --max-num-seqs 8 --max-tokens-range 4 16   # CPU, built-in model
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def churn_requests(n: int, seed: int = 0, prompt_range=(100, 1024), output_range=(32, 256), vocab: int = 10000):
    """(prompts as token ids, output lengths) of the churn job."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    return prompts, [rng.randint(*output_range) for _ in range(n)]


def run_job(llm, prompts, outs) -> dict:
    """Generate the job once on `llm`; its numbers."""
    from fdlite import SamplingParams  # noqa: PLC0415

    worker = llm.engine.worker
    spent = {"execute_s": 0.0}
    real = worker.execute

    def timed(prepared):
        t = time.perf_counter()
        try:
            return real(prepared)
        finally:
            spent["execute_s"] += time.perf_counter() - t

    worker.execute = timed
    try:
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in outs]
        t = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t
    finally:
        worker.execute = real
    st = llm.last_generate_stats
    produced = sum(len(o.outputs[0].token_ids) for o in res)
    steps = st["num_steps"]
    return {"requests": len(prompts), "output_tokens": produced, "seconds": round(wall, 2),
            "output_tokens_per_s": round(produced / wall, 1),
            "all_tokens_per_s": round((produced + sum(map(len, prompts))) / wall, 1), "steps": steps,
            "cudagraph_replays": st["cudagraph_replays"], "mixed_replays": st["cudagraph_mixed_replays"],
            "replayed_share": round(st["cudagraph_replays"] / max(1, steps), 3),
            "host_ms_per_step": round((wall - spent["execute_s"]) / max(1, steps) * 1e3, 3),
            "execute_ms_per_step": round(spent["execute_s"] / max(1, steps) * 1e3, 3),
            "preemptions": st["num_preemptions"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    ap.add_argument("--requests", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--max-tokens-range", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--compare", action="store_true", help="also without token-count graphs, in this process")
    ap.add_argument("--blocks", type=int, default=4000, help="KV blocks of each LLM with --compare")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from fdlite import LLM  # noqa: PLC0415

    prompts, outs = churn_requests(args.requests, prompt_range=tuple(args.prompt_range),
                                   output_range=tuple(args.max_tokens_range))
    common = dict(skip_tokenizer_init=True, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    if args.compare:
        common["num_gpu_blocks_override"] = args.blocks
    variants = {"token-count graphs": {}}
    if args.compare:
        variants["decode graphs only"] = {"graph_optimization_config": {"cudagraph_mixed_capture_sizes": []}}
    results = {}
    for name, extra in variants.items():
        t = time.perf_counter()
        llm = LLM(args.model, **common, **extra)
        startup = time.perf_counter() - t
        run_job(llm, prompts[:8], outs[:8])  # warm-up
        results[name] = {"startup_s": round(startup, 2), **run_job(llm, prompts, outs)}
        print(name, json.dumps(results[name]), flush=True)
        del llm
    if args.compare:
        a, b = results["token-count graphs"], results["decode graphs only"]
        results["speedup"] = round(a["output_tokens_per_s"] / b["output_tokens_per_s"], 3)
        print("speedup (output tok/s):", results["speedup"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
