"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (q/k RMSNorm) with routed experts (no shared
ones) on every `decoder_sparse_step`-th layer not in `mlp_only_layers`; `norm_topk_prob` renormalises
the chosen weights (`models/moe.py`)."""

from fdlite.models.decoder import DecoderForCausalLM, DecoderSpec
from fdlite.models.moe import MoEDecoderMixin, MoESpec


class Qwen3MoeForCausalLM(MoEDecoderMixin, DecoderForCausalLM):
    spec = DecoderSpec(qk_norm=True)

    def moe_spec(self) -> MoESpec:
        return MoESpec.qwen3(self.config)
