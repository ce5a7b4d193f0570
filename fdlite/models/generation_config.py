"""Sampling defaults from a model's `generation_config.json` (vLLM's `generation_config="auto"`).

Model authors put their recommended sampling there (Qwen3: temperature 0.6, top_p 0.95, top_k 20;
Qwen2.5: repetition_penalty 1.05). With `generation_config="auto"` (the default, as in vLLM) those
values become the defaults of every request that leaves the field unset; a field the request sets
always wins. `"vllm"` ignores the file (fdlite's own defaults, vLLM's name for the same choice); any
other value is a folder holding a `generation_config.json` to read instead of the model's.
"""

from __future__ import annotations

import json
import os
from typing import Any

from fdlite.sampling_params import SamplingParams

# The fields vLLM takes from generation_config.json for its default sampling parameters.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(choice: str, model_path: str) -> dict[str, Any]:
    """{field: value} of the generation config's sampling fields ({} for "vllm" or when it sets none)."""
    if choice == "vllm":
        return {}
    folder = model_path if choice == "auto" else choice
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if choice != "auto":
            raise ValueError(f"generation_config={choice!r}: no generation_config.json in that folder")
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")
    defaults = {k: cfg[k] for k in SAMPLING_FIELDS if cfg.get(k) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return defaults
