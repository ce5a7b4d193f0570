"""Prefix caching on vs off on a shared-prefix batch: time to finish and prefill tokens computed.

The batch is the offline job prefix caching is for: N requests that share one system prompt
(`--prefix-len` tokens) followed by distinct questions. Each configuration gets its own `LLM` in
this one process, is warmed up once, then the runs alternate (on, off, on, off, ...) so that a
noisy neighbour on a shared machine hits both alike; the table reports the median run and the
ratios of medians. CPU time (all threads of the process) is shown beside wall time: on a
machine shared with other jobs it moves less than wall time does. Outputs are checked to be
token-identical across configurations.

Run: python benchmarks/prefix_cache.py [--model PATH] [--num-requests 100] [--repeats 5]
Default model: the built-in random-weight Qwen3 (tiny: what this measures on it is mostly the
engine, not the matmuls; pass a real model folder for a model-bound number).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import numpy as np

from fdlite import LLM, SamplingParams

CONFIGS = {
    "prefix caching on (default)": dict(enable_prefix_caching=True),
    "prefix caching off": dict(enable_prefix_caching=False),
}


def shared_prefix_batch(num_requests: int, prefix_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(1000, vocab, size=prefix_len).tolist()
    return [prefix + rng.integers(1000, vocab, size=int(rng.integers(20, 61))).tolist() for _ in range(num_requests)]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Model folder (HF layout); default: the built-in model.")
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--prefix-len", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    common = dict(max_num_seqs=args.max_num_seqs, block_size=args.block_size, max_model_len=1024, seed=args.seed,
                  skip_tokenizer_init=True)  # prompts are token ids
    llms = {name: LLM(args.model, **common, **opts) for name, opts in CONFIGS.items()}
    vocab = min(next(iter(llms.values())).model_config.vocab_size, 151000)
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_batch(args.num_requests, args.prefix_len, vocab, args.seed)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    for llm in llms.values():  # warm-up: first-call kernel setup, not part of the job
        llm.generate(prompts[:2], params, use_tqdm=False)
    times = {name: [] for name in llms}
    cpu = {name: [] for name in llms}
    stats, tokens = {}, {}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            llm.reset_prefix_cache()  # each run starts cold: only the batch's own sharing counts
            t, c = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
            stats[name] = llm.last_generate_stats
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    names = list(llms)
    identical = all(tokens[n] == tokens[names[0]] for n in names)

    print(f"date: {datetime.date.today()}; cpu: {cpu_name()}; model: {args.model or 'built-in default (random Qwen3)'}")
    print(f"batch: {args.num_requests} requests = {args.prefix_len}-token shared prefix + 20..60 distinct tokens, "
          f"max_tokens={args.max_tokens}, greedy; max_num_seqs={args.max_num_seqs}, block_size={args.block_size}, "
          f"chunked prefill on; {args.repeats} alternating runs each, median shown\n")
    print("| configuration | time to finish (s) | CPU time (s) | prefill tokens computed | prefix-cache hit tokens "
          "| hits / shared-prefix tokens | steps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    med = {n: statistics.median(times[n]) for n in names}
    med_cpu = {n: statistics.median(cpu[n]) for n in names}
    shared = args.num_requests * args.prefix_len
    for n in names:
        s = stats[n]
        print(f"| {n} | {med[n]:.2f} | {med_cpu[n]:.2f} | {s['prefill_tokens_computed']} | "
              f"{s['prefix_cache_hit_tokens']} | {100 * s['prefix_cache_hit_tokens'] / shared:.1f}% | {s['num_steps']} |")
    on, off = names
    print(f"\nratios (off / on, medians): time to finish {med[off] / med[on]:.2f}x, CPU time "
          f"{med_cpu[off] / med_cpu[on]:.2f}x, prefill tokens computed "
          f"{stats[off]['prefill_tokens_computed'] / stats[on]['prefill_tokens_computed']:.2f}x")
    print(f"all runs (s): on {[round(t, 2) for t in times[on]]}, off {[round(t, 2) for t in times[off]]}; "
          f"outputs identical: {identical}")

if __name__ == "__main__":
    main()
