"""Architecture name in config.json -> model class."""

from fdlite.models.decoder import DecoderForCausalLM
from fdlite.models.ernie4_5 import Ernie4_5_MoeForCausalLM, Ernie4_5ForCausalLM
from fdlite.models.llama import LlamaForCausalLM
from fdlite.models.qwen2 import Qwen2ForCausalLM
from fdlite.models.qwen3 import Qwen3ForCausalLM
from fdlite.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "Ernie4_5_ForCausalLM": Ernie4_5ForCausalLM,  # the name in ERNIE's Paddle checkpoints' config.json
    "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,
}


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unknown architecture {architecture!r} in config.json; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None
