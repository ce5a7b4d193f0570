"""`config.json` of a Hugging Face model folder, read into one plain dataclass.

Accepts both the transformers 4.x spelling (`rope_theta`, `rope_scaling`, `torch_dtype`) and the
5.x one (`rope_parameters`, `dtype`), and ERNIE 4.5's (`use_bias` for every projection; its Paddle
checkpoints' architecture name `Ernie4_5_ForCausalLM`). The MoE keys stay in `raw`
(`models/moe.py` reads them); only `moe_intermediate_size` is here, since the tensor-parallel split
checks it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    torch_dtype: str
    hidden_act: str
    eos_token_id: list[int] = field(default_factory=list)
    moe_intermediate_size: int = 0  # one routed expert's MLP width; 0: a dense model
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"model folder {path!r} has no config.json")
        with open(cfg_path, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError("config.json names no 'architectures'")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in raw:
                raise ValueError(f"config.json is missing '{key}'")
        if raw.get("use_sliding_window"):
            raise ValueError("config.json sets use_sliding_window=true; sliding-window attention is not supported")
        heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
        ernie = str(raw.get("model_type", "")).startswith("ernie4_5")
        # ERNIE's configs may leave rope_theta out: transformers' Ernie4_5Config then means 500000.
        default_theta = 500000.0 if ernie else 10000.0
        moe_inter = raw.get("moe_intermediate_size") or 0
        if isinstance(moe_inter, list):  # ERNIE-VL's per-modality widths; the text experts come first
            moe_inter = moe_inter[0]
        eos = raw.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=archs[0],
            model_type=raw.get("model_type", ""),
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", default_theta))),
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", raw.get("use_bias", False))),
            mlp_bias=bool(raw.get("mlp_bias", raw.get("use_bias", False))),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            hidden_act=raw.get("hidden_act", "silu"),
            eos_token_id=eos,
            moe_intermediate_size=int(moe_inter),
            raw=raw,
        )
