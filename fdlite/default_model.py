"""The built-in default model: a tiny random-weight Qwen3 with the real Qwen3 tokenizer, built on first use.

Why hand-written: `LLM()` and the README's first command must run with no download (the machines that run
fdlite often cannot reach a model hub), yet exercise the real code paths: the HF folder layout, the Qwen3
architecture and tensor names, safetensors loading, the real 151k-token tokenizer and its chat template.
Shipping 80 MB of weights in the repo would be wasteful, so the weights are generated deterministically
(seed 0) and only the tokenizer (2 MB gzipped, under `fdlite/assets/qwen3_tokenizer/`) is shipped. The
output text is gibberish, since the weights are random; everything around the model is real.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile

import numpy as np

from fdlite import envs

DEFAULT_MODEL_NAME = "fdlite-default-qwen3-tiny"

# Logged once when an `LLM` loads it: a first `fdlite generate "..."` prints gibberish, and this says why.
RANDOM_WEIGHTS_NOTE = (
    f"model: the built-in {DEFAULT_MODEL_NAME} has random weights, so its text is gibberish; for real text "
    "give a model folder or a Hugging Face id (--model Qwen/Qwen3-0.6B, `model:` in a job file, LLM(model=...))"
)

# Bump the folder name whenever the contents change, so old caches are not reused.
_FOLDER_NAME = "default-model-v1"
_ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "qwen3_tokenizer")

# Files a complete folder has; a folder missing any of them is rebuilt.
_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,  # Qwen3's embedding rows (the tokenizer uses 151669 of them)
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 2,
    "initializer_range": 0.02,
    "use_cache": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

# As in the real Qwen3 release: generation stops at <|im_end|> or <|endoftext|>. No sampling defaults, so
# fdlite's own SamplingParams defaults apply unchanged.
GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
}


def _cache_root() -> str:
    return envs.FDLITE_CACHE


def _random_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Qwen3 tensors under their HF names, float32: linear weights ~ N(0, 0.02), RMSNorm weights = 1."""
    c = CONFIG
    rng = np.random.default_rng(seed)
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_dim = c["num_attention_heads"] * head_dim
    kv_dim = c["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones((n,), dtype=np.float32)

    # nn.Linear weights are stored [out_features, in_features].
    tensors = {"model.embed_tokens.weight": normal(c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = ones(hidden)
        tensors[p + "self_attn.q_proj.weight"] = normal(q_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden, q_dim)
        tensors[p + "self_attn.q_norm.weight"] = ones(head_dim)  # Qwen3's per-head RMSNorm on q and k
        tensors[p + "self_attn.k_norm.weight"] = ones(head_dim)
        tensors[p + "post_attention_layernorm.weight"] = ones(hidden)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    tensors["model.norm.weight"] = ones(hidden)
    # No lm_head.weight: tie_word_embeddings reuses embed_tokens, as HF's Qwen3 checkpoints with tied heads do.
    return tensors


def _write_folder(folder: str) -> None:
    from safetensors.numpy import save_file

    def dump(name: str, data: dict) -> None:
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")

    dump("config.json", CONFIG)
    dump("generation_config.json", GENERATION_CONFIG)
    weights_file = os.path.join(folder, "model.safetensors")
    save_file(_random_weights(seed=0), weights_file, metadata={"format": "pt"})
    os.chmod(weights_file, 0o644)  # safetensors creates it owner-only; keep the cache shareable like the rest
    with gzip.open(os.path.join(_ASSETS, "tokenizer.json.gz"), "rb") as src:
        with open(os.path.join(folder, "tokenizer.json"), "wb") as dst:
            shutil.copyfileobj(src, dst)
    shutil.copyfile(os.path.join(_ASSETS, "tokenizer_config.json"), os.path.join(folder, "tokenizer_config.json"))
    shutil.copyfile(os.path.join(_ASSETS, "NOTICE"), os.path.join(folder, "NOTICE"))


def _is_complete(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, name)) for name in _FILES)


def default_model_path() -> str:
    """Path of the default model folder (HF layout), building it on first use.

    It lives at `$FDLITE_CACHE/default-model-v1` (default cache: `~/.cache/fdlite`). The folder is written
    under a temporary name and renamed into place, so concurrent processes never see a half-written model:
    the first rename wins and the others discard their copy.
    """
    root = _cache_root()
    final = os.path.join(root, _FOLDER_NAME)
    if _is_complete(final):
        return final
    os.makedirs(root, exist_ok=True)
    if os.path.isdir(final):
        # Left incomplete by something other than this function (renames are atomic): move it aside.
        stale = tempfile.mkdtemp(prefix=f".{_FOLDER_NAME}.stale-", dir=root)
        try:
            os.replace(final, os.path.join(stale, "old"))
        except OSError:
            pass  # another process moved or replaced it meanwhile
        shutil.rmtree(stale, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=f".{_FOLDER_NAME}.tmp-", dir=root)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model folder is ordinary readable data
        _write_folder(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            # A non-empty `final` cannot be replaced: another process finished first. Use theirs.
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
