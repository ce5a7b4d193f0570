"""The default `max_model_len`: the model's own context length, bounded by what the KV cache holds.

Why: `LLM(path)` with no options must start on every supported model. A fixed default (2048) is too
long for some models (`max_position_embeddings` 512) and far too short for others (40960). As vLLM
does, the default is the smallest of the length keys config.json has (`max_position_embeddings`,
`n_positions`, `max_seq_len`, ...), multiplied by the rope-scaling factor where that factor plainly
stretches the positions (linear, dynamic; YaRN from its `original_max_position_embeddings`), and
not for rope types whose `max_position_embeddings` already is the stretched length (llama3,
longrope). A user's value above that is an error.

The KV cache may hold fewer tokens than the model allows (a 1 GiB CPU cache holds about 4,600 tokens
of Qwen3-0.6B, whose context is 40,960): a default length is then lowered to the cache's size, so one
sequence of max_model_len always fits, and one log line says so. An explicit value is never lowered
(the cache allocation reports the shortfall instead).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fdlite.models.model_config import ModelConfig

logger = logging.getLogger("fdlite")

# vLLM's keys for a model's context length, in its order; the smallest present wins.
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# Without any of them (vLLM's fallback too).
FALLBACK_LENGTH = 2048
# Rope types whose max_position_embeddings is already the extended length.
_UNSCALED_ROPE_TYPES = ("su", "longrope", "llama3")


@dataclass(frozen=True)
class ContextLength:
    """A model's longest sequence, and where that number came from (for messages)."""

    tokens: int
    source: str  # e.g. "max_position_embeddings=40960"


def model_context_length(raw: dict, rope_scaling: dict | None) -> ContextLength:
    """The context length config.json implies, as vLLM derives it (`raw`: config.json's dict)."""
    present = [(raw[k], k) for k in LENGTH_KEYS if isinstance(raw.get(k), (int, float)) and not isinstance(raw.get(k), bool)]
    if present:
        length, key = min(present)
        source = f"{key}={int(length)}"
    else:
        length, source = FALLBACK_LENGTH, f"no length in config.json, fallback {FALLBACK_LENGTH}"
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_scaling and rope_type not in _UNSCALED_ROPE_TYPES:
        factor = rope_scaling.get("factor", 1.0)
        if rope_type == "yarn" and "original_max_position_embeddings" in rope_scaling:
            length = rope_scaling["original_max_position_embeddings"]
            source = f"original_max_position_embeddings={int(length)}"
        if factor != 1.0:
            length *= factor
            source += f" x {rope_type} rope_scaling factor {factor:g}"
    return ContextLength(int(length), source)


@dataclass(frozen=True)
class LengthChoice:
    """What `choose_max_model_len` settled on before the KV cache was sized."""

    tokens: int
    user_set: bool
    model: ContextLength


def choose_max_model_len(requested: int | None, model_config: ModelConfig) -> LengthChoice:
    """The user's max_model_len if it fits the model, else an error; the model's context length if unset."""
    model = model_context_length(model_config.raw, model_config.rope_scaling)
    if requested is None:
        return LengthChoice(model.tokens, False, model)
    if requested > model.tokens:
        raise ValueError(
            f"max_model_len ({requested}) exceeds the model's context length ({model.tokens}, from {model.source}); "
            "leave max_model_len unset to use the model's"
        )
    return LengthChoice(requested, True, model)


def fit_to_cache(choice: LengthChoice, num_blocks: int, block_size: int) -> int:
    """The final max_model_len: a default one lowered to the cache's capacity; logs what and why."""
    capacity = num_blocks * block_size
    if choice.user_set:
        return choice.tokens
    if choice.tokens <= capacity or capacity < 2:  # a cache too small for anything: allocation says so
        logger.info("max_model_len=%d: the model's context length (%s); the KV cache holds %d tokens",
                    choice.tokens, choice.model.source, capacity)
        return choice.tokens
    logger.info("max_model_len=%d: what the KV cache holds (%d blocks of %d tokens), below the model's context "
                "length %d (%s); a larger KV cache budget (kv_cache_memory_bytes on CPU, gpu_memory_utilization on "
                "GPU) allows longer sequences", capacity, num_blocks, block_size, choice.model.tokens, choice.model.source)
    return capacity
