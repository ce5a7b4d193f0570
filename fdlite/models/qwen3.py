"""Qwen3 (dense): the shared decoder with per-head RMSNorm on q and k, no q/k/v bias."""

from fdlite.models.decoder import DecoderForCausalLM, DecoderSpec


class Qwen3ForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(qk_norm=True)
