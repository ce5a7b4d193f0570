"""An FP8 KV cache (`kv_cache_dtype="fp8"`) beside the model-dtype cache: prefill logprob error against
transformers fp32, next to transformers' own bf16 against fp32 and transformers fp32 with its K / V rounded as an FP8
cache holds them (e4m3, a scale per token and KV head: the format's own error), greedy agreement, and the blocks a
byte budget holds. CPU, float32 models, so the FP8 cache is the only rounding on fdlite's side.

For each model family: random-weight models written by transformers (the tests' shapes by default, or
`--hidden`/`--layers`/`--heads` for larger ones), 8 prompts of 64-400 random tokens, prefilled 128 tokens a step
(later chunks read their prefix from the cache), `prompt_logprobs=0`; then 32 greedy tokens each, compared with the
model-dtype cache's.

Run: python benchmarks/fp8_kv_quality.py [--families qwen3 llama qwen2] [--hidden 256 --layers 4 --heads 8]
(needs torch and transformers: the test extras).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from fdlite import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["qwen3", "llama", "qwen2"])
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None, help="query heads (KV heads: a quarter)")
    ap.add_argument("--prompts", type=int, default=8)
    args = ap.parse_args()
    from hf_models import fp8_kv_reference_errors, fp32_prompt_logprobs, prompt_logprob_errors, write_random_model

    print(f"# fp8 KV quality, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"command: python benchmarks/fp8_kv_quality.py {' '.join(sys.argv[1:])}")
    print("| family | head_dim | fp8 prefill logprob err (max / mean) | transformers bf16 (max / mean) | transformers "
          "fp32, e4m3 K / V (max / mean) | ours / e4m3 reference, max | greedy tokens equal to the model-dtype cache "
          "| blocks, same budget |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for fam in args.families:
        over = {}
        if args.hidden:
            over.update(hidden_size=args.hidden, intermediate_size=args.hidden * 3)
        if args.layers:
            over.update(num_hidden_layers=args.layers)
        if args.heads:
            over.update(num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 4),
                        head_dim=(args.hidden or 64) // args.heads)
        with tempfile.TemporaryDirectory() as d:
            path = write_random_model(os.path.join(d, fam), fam, seed=11, **over)
            rng = np.random.default_rng(3)
            prompts = [rng.integers(3, 250, int(n)).tolist() for n in rng.integers(64, 400, args.prompts)]
            common = dict(skip_tokenizer_init=True, device="cpu", max_num_seqs=8, block_size=16, max_model_len=512,
                          max_num_batched_tokens=128, kv_cache_memory_bytes=1 << 26)
            ps = [{"prompt_token_ids": p} for p in prompts]
            lp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
            greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
            auto, fp8 = LLM(path, **common), LLM(path, kv_cache_dtype="fp8", **common)
            outs = fp8.generate(ps, lp, use_tqdm=False)
            ga, gf = auto.generate(ps, greedy, use_tqdm=False), fp8.generate(ps, greedy, use_tqdm=False)
            same = sum(x == y for a, b in zip(ga, gf) for x, y in zip(a.outputs[0].token_ids, b.outputs[0].token_ids))
            fp32 = fp32_prompt_logprobs(path, prompts)  # the reference of both error lists, run once
            ours, theirs = prompt_logprob_errors(path, prompts, [o.prompt_logprobs for o in outs], fp32)
            e4m3 = fp8_kv_reference_errors(path, prompts, fp32)
            hd = fp8.model_config.head_dim
            print(f"| {fam} | {hd} | {max(ours):.4f} / {np.mean(ours):.4f} | {max(theirs):.4f} / {np.mean(theirs):.4f} "
                  f"| {max(e4m3):.4f} / {np.mean(e4m3):.4f} | {max(ours) / max(e4m3):.2f} | {same} / {32 * len(prompts)} "
                  f"| {fp8.num_blocks} vs {auto.num_blocks} |")
            auto.close()
            fp8.close()


if __name__ == "__main__":
    main()
