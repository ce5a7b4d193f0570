"""Qwen2 / Qwen2.5: the shared decoder with a bias on the q/k/v projections."""

from fdlite.models.decoder import DecoderForCausalLM, DecoderSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(qkv_bias=True)
