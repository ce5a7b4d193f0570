"""Small random-weight models in the Hugging Face layout, and the transformers reference outputs.

transformers (PyTorch, CPU, float32) writes the folder and computes the reference, so the test
oracle shares no code with fdlite.
"""

from __future__ import annotations

import gzip
import os
import shutil

import numpy as np
import torch
import transformers

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    # GQA, untied, qkv bias
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False, rope_theta=10000.0)),
    # GQA, tied, q/k norm, head_dim != hidden / heads
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=32, rope_theta=1000000.0)),
    # GQA, untied, llama3 rope scaling
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # ERNIE-4.5-0.3B's shape: interleaved rope, tied; here with bias on every projection, head_dim != hidden / heads
    "ernie45": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(use_bias=True, head_dim=32, tie_word_embeddings=True)),
    # ERNIE-4.5-21B-A3B's: layers 0, 2 dense and 1, 3 MoE (start 1, interval 2); 3 of 8 experts per token,
    # a float32 router with a score-correction bias, 2 shared experts
    "ernie45_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        num_hidden_layers=4, moe_num_experts=8, moe_k=3, moe_intermediate_size=32, moe_num_shared_experts=2,
        moe_layer_start_index=1, moe_layer_interval=2, tie_word_embeddings=False)),
    # Qwen3-30B-A3B's: q/k norm, layer 0 dense (mlp_only_layers), 2 of 8 experts, renormalised weights
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[0], decoder_sparse_step=1, head_dim=32, tie_word_embeddings=False)),
}
MOE_FAMILIES = ("ernie45_moe", "qwen3_moe")


def write_random_model(path: str, family: str, seed: int = 0, **overrides) -> str:
    """Write config.json + model.safetensors of a random `family` model to `path`."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    kwargs = {**BASE, **extra, **overrides}
    config = getattr(transformers, cfg_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    # Random biases too (transformers zero-initialises them), so a dropped bias would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def add_qwen3_tokenizer(path: str) -> str:
    """Put fdlite's shipped Qwen3 tokenizer into a model folder, so `LLM(path)` needs no options (its ids cover
    any test vocabulary up to 151,643 as ordinary tokens)."""
    assets = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fdlite", "assets",
                          "qwen3_tokenizer")
    with gzip.open(os.path.join(assets, "tokenizer.json.gz"), "rb") as src, \
            open(os.path.join(path, "tokenizer.json"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.copyfile(os.path.join(assets, "tokenizer_config.json"), os.path.join(path, "tokenizer_config.json"))
    return path


def load_reference(path: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model


# transformers' attention with K and V stored as fdlite's FP8 cache stores them (`kv_cache_dtype="fp8"`): the error a
# model shows with an e4m3 cache and no other rounding, the bar for fdlite's FP8 cache (benchmarks/fp8_kv_quality.py,
# tools/gpu/e2e_harness.py section fp8).
FP8_KV_ATTENTION = "ref_fp8_kv_sdpa"


def e4m3_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] as e4m3 with a float32 scale amax / 448 per vector (fdlite/kvcache/fp8_cache.py's rule),
    read back in x's dtype."""
    scale = x.float().abs().amax(-1, keepdim=True) / 448.0
    bits = (x.float() / torch.where(scale > 0, scale, torch.ones_like(scale))).to(torch.float8_e4m3fn)
    return (bits.float() * scale).to(x.dtype)


def register_fp8_kv_attention() -> str:
    """Registers FP8_KV_ATTENTION with transformers (sdpa on K / V through `e4m3_round_trip`, sdpa's masks) and returns
    its name, for `from_pretrained(..., attn_implementation=...)`."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def fp8_kv(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, e4m3_round_trip(key), e4m3_round_trip(value), attention_mask,
                                      **kwargs)

    AttentionInterface.register(FP8_KV_ATTENTION, fp8_kv)
    AttentionMaskInterface.register(FP8_KV_ATTENTION, sdpa_mask)
    return FP8_KV_ATTENTION


@torch.no_grad()
def reference_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt alone (no padding), ignoring EOS."""
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                           min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    return outs


def _prompt_token_logprobs(model, prompts: list[list[int]]) -> list[np.ndarray]:
    """Per prompt: `model`'s log-probability (float64) of each prompt token after the first, given the tokens before."""
    out = []
    for p in prompts:
        lp = torch.log_softmax(model(torch.tensor([p])).logits[0].double(), -1).numpy()
        out.append(lp[np.arange(len(p) - 1), p[1:]])
    return out


@torch.no_grad()
def fp32_prompt_logprobs(path: str, prompts: list[list[int]]) -> list[np.ndarray]:
    """Per prompt: transformers fp32's log-probability of each prompt token after the first (the reference the error
    functions below compare with; pass it to them to run it once)."""
    return _prompt_token_logprobs(load_reference(path), prompts)


@torch.no_grad()
def prompt_logprob_errors(path: str, prompts: list[list[int]], prompt_logprobs: list,
                          fp32: list[np.ndarray] | None = None) -> tuple[list[float], list[float]]:
    """Per prompt token after the first: |fdlite's logprob (a RequestOutput's `prompt_logprobs`) - transformers
    fp32's| and |transformers bf16's - fp32's|, over all prompts (fp32 and bf16 copies of the model at `path`;
    `fp32`: `fp32_prompt_logprobs`' result, computed here when None)."""
    fp32 = fp32_prompt_logprobs(path, prompts) if fp32 is None else fp32
    low = _prompt_token_logprobs(load_reference(path).to(torch.bfloat16), prompts)
    ours, theirs = [], []
    for p, got, ref, half in zip(prompts, prompt_logprobs, fp32, low):
        ours += [abs(got[i][p[i]].logprob - ref[i - 1]) for i in range(1, len(p))]
        theirs += np.abs(half - ref).tolist()
    return ours, theirs


@torch.no_grad()
def fp8_kv_reference_logprobs(path: str, prompts: list[list[int]]) -> list[np.ndarray]:
    """Per prompt: transformers fp32's log-probability of each prompt token after the first, with K / V as an FP8 cache
    holds them (FP8_KV_ATTENTION)."""
    f8 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation=register_fp8_kv_attention()).eval()
    return _prompt_token_logprobs(f8, prompts)


@torch.no_grad()
def fp8_kv_reference_errors(path: str, prompts: list[list[int]], fp32: list[np.ndarray] | None = None) -> list[float]:
    """Per prompt token after the first: |transformers fp32 with K / V as an FP8 cache holds them (FP8_KV_ATTENTION)
    - transformers fp32| in the token's logprob: the error the FP8 cache's rounding alone gives (`fp32`: as in
    `prompt_logprob_errors`)."""
    fp32 = fp32_prompt_logprobs(path, prompts) if fp32 is None else fp32
    errs = []
    for low, ref in zip(fp8_kv_reference_logprobs(path, prompts), fp32):
        errs += np.abs(low - ref).tolist()
    return errs


@torch.no_grad()
def reference_last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].float()


def save_paddle_layout(src: str, dst: str, prefix: str, fuse: bool = True, architecture: str | None = None) -> str:
    """Rewrite the model folder `src` as a Paddle-layout checkpoint in `dst` (what `-Paddle` repositories hold):
    `prefix` in place of `model.`, every linear weight (projections, router, LM head) transposed to [in, out],
    and with `fuse`, q/k/v stacked into `qkv_proj` and gate/up into `up_gate_proj` (gate columns first)."""
    import json

    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(os.path.join(src, "model.safetensors"), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for name, t in tensors.items():
        if t.ndim == 2 and name.endswith(("_proj.weight", "mlp.gate.weight", "lm_head.weight")):
            t = t.T
        out[prefix + name[len("model."):] if name.startswith("model.") else name] = np.ascontiguousarray(t)
    if fuse:
        for name in [n for n in out if ".q_proj." in n]:
            parts = [out.pop(name.replace("q_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = np.concatenate(parts, axis=-1)
        for name in [n for n in out if "gate_proj." in n]:
            parts = [out.pop(name.replace("gate_proj", p)) for p in ("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "up_gate_proj")] = np.concatenate(parts, axis=-1)
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if architecture:
        config["architectures"] = [architecture]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst
