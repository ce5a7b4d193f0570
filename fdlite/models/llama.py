"""Llama 3 / 3.1 / 3.2: the shared decoder as is; 'llama3' rope scaling comes from config.json."""

from fdlite.models.decoder import DecoderForCausalLM, DecoderSpec


class LlamaForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec()
