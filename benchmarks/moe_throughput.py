"""CPU throughput of a mixture-of-experts model beside a dense model with the same active parameters.

Two random Qwen3-shaped models that differ only in their MLPs: the MoE one has `--experts` experts of
width `--moe-inter`, `--top-k` per token (Qwen3-MoE's routing); the dense one has one MLP of width
top_k * moe_inter, so each token multiplies by the same number of MLP weights in both. Both are
generated greedily on the same prompts with fdlite; the script prints output tokens/s and where the
time goes (the MLPs' share of the forward, and inside the MoE layer: routing, grouping, expert matmuls,
combining), measured by wrapping the layers' forward methods.

    python benchmarks/moe_throughput.py                 # writes both models to a temporary folder

Weights are written with numpy (no torch needed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections import defaultdict

import numpy as np


def write_model(path: str, cfg: dict) -> str:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    h, layers, hd = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(np.float32)

    t = {"model.embed_tokens.weight": w(cfg["vocab_size"], h), "model.norm.weight": np.ones(h, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": np.ones(h, np.float32),
                  p + "post_attention_layernorm.weight": np.ones(h, np.float32),
                  p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                  p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                  p + "self_attn.q_norm.weight": np.ones(hd, np.float32),
                  p + "self_attn.k_norm.weight": np.ones(hd, np.float32)})
        if cfg.get("num_experts"):
            m, e_inter = p + "mlp.", cfg["moe_intermediate_size"]
            t[m + "gate.weight"] = w(cfg["num_experts"], h)
            for e in range(cfg["num_experts"]):
                t.update({f"{m}experts.{e}.gate_proj.weight": w(e_inter, h),
                          f"{m}experts.{e}.up_proj.weight": w(e_inter, h),
                          f"{m}experts.{e}.down_proj.weight": w(h, e_inter)})
        else:
            inter = cfg["intermediate_size"]
            t.update({p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                      p + "mlp.down_proj.weight": w(h, inter)})
    os.makedirs(path, exist_ok=True)
    save_file(t, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


class Timers:
    """Wall time of wrapped callables, by label."""

    def __init__(self):
        self.s = defaultdict(float)

    def wrap(self, owner, name, label):
        fn = getattr(owner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[label] += time.perf_counter() - t0

        setattr(owner, name, timed)


def run(path: str, prompts, max_tokens: int, max_num_seqs: int) -> dict:
    from fdlite import LLM, SamplingParams  # first: fdlite sets MKL's CPU type before Paddle loads it
    from fdlite.models.decoder import DecoderMLP, DecoderModel
    from fdlite.layers import moe

    import paddle

    llm = LLM(path, skip_tokenizer_init=True, max_num_seqs=max_num_seqs, max_model_len=1024,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
    timers = Timers()
    timers.wrap(DecoderModel, "forward", "forward")
    timers.wrap(DecoderMLP, "forward", "dense MLP")
    # An op's implementation was bound when it was built (CustomOp): wrap each instance's.
    ops = [op for op in llm.runner.model.sublayers() if isinstance(op, moe.FusedMoE)]
    inside = {"moe": False, "route": False}

    def flagged(fn, key):  # fn, with inside[key] True while it runs
        def run(x):
            inside[key] = True
            try:
                return fn(x)
            finally:
                inside[key] = False
        return run

    for op in ops:
        op.route = flagged(op.route, "route")  # the router's matmul is routing, not expert work
        timers.wrap(op, "route", "MoE: routing")
        op._forward_method = flagged(op._forward_method, "moe")
        timers.wrap(op, "_forward_method", "MoE layer")
    real_matmul = paddle.matmul

    def matmul(*a, **kw):  # the expert matmuls: every matmul the MoE layer runs outside its router
        if not inside["moe"] or inside["route"]:
            return real_matmul(*a, **kw)
        t0 = time.perf_counter()
        try:
            return real_matmul(*a, **kw)
        finally:
            timers.s["MoE: expert matmuls"] += time.perf_counter() - t0

    paddle.matmul = matmul
    try:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    finally:
        paddle.matmul = real_matmul
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": tokens, "elapsed_s": elapsed, "tok_s": tokens / elapsed, **timers.s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-inter", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    args = ap.parse_args()
    base = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=8192, hidden_size=512,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                intermediate_size=args.top_k * args.moe_inter, torch_dtype="float32", eos_token_id=2)
    moe_cfg = {**base, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
               "num_experts": args.experts, "num_experts_per_tok": args.top_k,
               "moe_intermediate_size": args.moe_inter, "norm_topk_prob": True}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 8192, size=int(n)).tolist() for n in rng.integers(16, 256, size=args.prompts)]
    with tempfile.TemporaryDirectory() as root:
        results = {name: run(write_model(os.path.join(root, name), cfg), prompts, args.max_tokens,
                             args.max_num_seqs)
                   for name, cfg in (("dense", base), ("moe", moe_cfg))}
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"experts {args.experts}, top-k {args.top_k}, expert width {args.moe_inter}; dense width "
          f"{args.top_k * args.moe_inter}; {args.prompts} prompts of 16-255 tokens, {args.max_tokens} new tokens")
    print("| model | output tok/s | forward s | MLP layers s | of which: routing | expert matmuls | other (gather, sort, combine) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        mlp = r.get("MoE layer", 0.0) + r.get("dense MLP", 0.0)
        route, mm = r.get("MoE: routing", 0.0), r.get("MoE: expert matmuls", 0.0)
        other = r.get("MoE layer", 0.0) - route - mm
        cells = [f"{route:.2f}", f"{mm:.2f}", f"{other:.2f}"] if name == "moe" else ["", "", ""]
        print(f"| {name} | {r['tok_s']:.1f} | {r['forward']:.2f} | {mlp:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
