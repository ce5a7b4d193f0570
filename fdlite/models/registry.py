"""Architecture name in config.json -> model class."""

from fdlite.models.decoder import DecoderForCausalLM
from fdlite.models.llama import LlamaForCausalLM
from fdlite.models.qwen2 import Qwen2ForCausalLM
from fdlite.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unknown architecture {architecture!r} in config.json; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None
