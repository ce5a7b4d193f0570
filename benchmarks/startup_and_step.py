"""Startup phase times (graph_opt_level 0 vs 1) and per-step decode time at several batch sizes, on CPU.

Uses a random-weight model with Qwen3-0.6B's shapes (28 layers, hidden 1024, 16/8 heads, head_dim 128,
vocab 151936), written once with transformers. Both levels run in this one process, side by side.

    python benchmarks/startup_and_step.py [--layers 28] [--batches 1 8 64] [--steps 8] [--levels 0 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

import numpy as np

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0, bos_token_id=151643,
                  eos_token_id=151645)


def write_model(path: str, layers: int) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": layers})
    transformers.Qwen3ForCausalLM(cfg).float().eval().save_pretrained(path, safe_serialization=True)
    return path


def decode_step_time(llm, batch: int, steps: int, ctx: int) -> float:
    """Mean seconds per decode step with `batch` sequences of about `ctx` tokens of context."""
    from fdlite import SamplingParams

    rng = np.random.default_rng(batch)
    prompts = [rng.integers(3, 150000, size=ctx).tolist() for _ in range(batch)]
    # Warm-up with the same shapes (SOT may translate a new prefill shape once), then time prefill plus 2
    # decode steps and prefill plus 2 + steps: the difference is `steps` pure decode steps.
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    times = []
    for extra in (2, 2 + steps):
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=extra, ignore_eos=True), use_tqdm=False)
        times.append(time.perf_counter() - t)
    return (times[1] - times[0]) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=64, help="prompt tokens per sequence")
    ap.add_argument("--model", default=None)
    ap.add_argument("--levels", type=int, nargs="+", default=[0, 1], help="graph_opt_level values to measure")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest of --batches")
    args = ap.parse_args()

    from fdlite import LLM

    path = args.model or write_model(tempfile.mkdtemp(prefix="fdlite-qwen3-0.6b-"), args.layers)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; model: Qwen3-0.6B shapes, {args.layers} layers, random")
    rows = []
    for level in args.levels:
        llm = LLM(path, max_num_seqs=args.max_num_seqs or max(args.batches), max_model_len=512, max_num_batched_tokens=1024,
                  skip_tokenizer_init=True, graph_optimization_config={"graph_opt_level": level})
        r = llm.startup_report
        steps = {b: decode_step_time(llm, b, args.steps, args.ctx) for b in args.batches}
        rows.append((level, r, steps))
        del llm
    print("| graph_opt_level | load_weights s | profile_run s | kv_cache s | sot_warmup s | SOT translations | total s | "
          + " | ".join(f"decode step, batch {b} (ms)" for b in args.batches) + " |")
    print("|---" * (7 + len(args.batches)) + "|")
    for level, r, steps in rows:
        print(f"| {level} | {r['load_weights_s']:.2f} | {r['profile_run_s']:.2f} | {r['kv_cache_s']:.2f} | "
              f"{r.get('sot_warmup_s', 0.0):.2f} | {r['sot_translations']} | {r['total_s']:.2f} | "
              + " | ".join(f"{steps[b] * 1e3:.1f}" for b in args.batches) + " |")


if __name__ == "__main__":
    main()
