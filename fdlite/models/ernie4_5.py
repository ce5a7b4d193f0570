"""ERNIE 4.5: dense (ERNIE-4.5-0.3B) and MoE (ERNIE-4.5-21B-A3B, 300B-A47B), text only.

The shared decoder with ERNIE's interleaved rotary layout (`DecoderSpec.rope_interleaved`), bias on
every projection when config.json says `use_bias`, tied embeddings by default; the MoE model adds
routed experts with a float32 router and score-correction bias, shared experts, and dense layers
outside `moe_layer_start_index`..`moe_layer_end_index` / `moe_layer_interval` (`models/moe.py`).
Both Hugging Face (`-PT`) and Paddle (`-Paddle`) checkpoints load (`weight_loader.py`).
"""

from fdlite.models.decoder import DecoderForCausalLM, DecoderSpec
from fdlite.models.moe import MoEDecoderMixin, MoESpec


class Ernie4_5ForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(rope_interleaved=True)


class Ernie4_5_MoeForCausalLM(MoEDecoderMixin, DecoderForCausalLM):
    spec = DecoderSpec(rope_interleaved=True)

    def moe_spec(self) -> MoESpec:
        return MoESpec.ernie(self.config)
