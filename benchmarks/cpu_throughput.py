"""CPU throughput: fdlite vs Hugging Face transformers on the same workload, in one process.

A fixed set of prompts (seeded random token ids of mixed lengths) is generated greedily with a fixed
number of output tokens (EOS ignored), first by fdlite with continuous batching, then by
transformers' `generate` in padded batches of the same size. Both read the same model folder.
Prints output tokens/s of each and their ratio as a markdown table.

    python benchmarks/cpu_throughput.py                      # writes a random Qwen3-shaped model
    python benchmarks/cpu_throughput.py --model PATH         # any supported HF-layout model

Needs the test extra (torch, transformers): pip install -e ".[cpu,test]".
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

import numpy as np

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
    args = ap.parse_args()

    import paddle
    import torch

    torch.set_num_threads(args.threads)
    paddle.set_device("cpu")
    path = args.model or write_bench_model(tempfile.mkdtemp(prefix="fdlite-bench-"))
    import json

    vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, vocab, args.seed)
    fd_s, fd_tok = run_fdlite(path, prompts, args.max_tokens, args.batch)
    hf_s, hf_tok = run_transformers(path, prompts, args.max_tokens, args.batch)
    fd_tps, hf_tps = fd_tok / fd_s, hf_tok / hf_s
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, threads={args.threads}")
    print(f"workload: {args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens, "
          f"{args.max_tokens} output tokens each, batch {args.batch}, greedy")
    print("| engine | wall s | output tokens | output tok/s |")
    print("|---|---|---|---|")
    print(f"| fdlite (Paddle {paddle.__version__}) | {fd_s:.2f} | {fd_tok} | {fd_tps:.1f} |")
    print(f"| transformers (torch {torch.__version__}) | {hf_s:.2f} | {hf_tok} | {hf_tps:.1f} |")
    print(f"ratio fdlite / transformers: {fd_tps / hf_tps:.2f}x")


if __name__ == "__main__":
    main()
