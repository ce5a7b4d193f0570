"""The default max_model_len comes from the model (as in vLLM), bounded by the KV cache; explicit values are checked."""

import logging

import pytest
from hf_models import add_qwen3_tokenizer, write_random_model

from fdlite import LLM, SamplingParams
from fdlite.config import EngineConfig
from fdlite.models.context_length import (
    FALLBACK_LENGTH, ContextLength, LengthChoice, choose_max_model_len, fit_to_cache, model_context_length,
)
from fdlite.models.model_config import ModelConfig


def test_context_length_keys_and_rope_scaling():
    assert model_context_length({"max_position_embeddings": 512}, None) == ContextLength(512, "max_position_embeddings=512")
    # The smallest of vLLM's keys wins.
    assert model_context_length({"max_position_embeddings": 4096, "seq_length": 1024}, None).tokens == 1024
    assert model_context_length({}, None).tokens == FALLBACK_LENGTH
    # Plain stretches multiply; YaRN multiplies its original length.
    assert model_context_length({"max_position_embeddings": 4096}, {"rope_type": "linear", "factor": 2.0}).tokens == 8192
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    got = model_context_length({"max_position_embeddings": 40960}, yarn)
    assert got.tokens == 131072 and "factor 4" in got.source
    # llama3's max_position_embeddings already is the stretched length.
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    assert model_context_length({"max_position_embeddings": 131072}, llama3).tokens == 131072
    assert model_context_length({"max_position_embeddings": 2048}, {"rope_type": "default"}).tokens == 2048


def _model_config(length: int) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                                  "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
                                  "max_position_embeddings": length})


def test_choose_and_fit():
    assert choose_max_model_len(None, _model_config(512)) == LengthChoice(512, False, ContextLength(512, "max_position_embeddings=512"))
    assert choose_max_model_len(256, _model_config(512)).tokens == 256
    with pytest.raises(ValueError, match=r"max_model_len \(1024\) exceeds the model's context length \(512"):
        choose_max_model_len(1024, _model_config(512))
    default, explicit = choose_max_model_len(None, _model_config(4096)), choose_max_model_len(4096, _model_config(4096))
    assert fit_to_cache(default, num_blocks=100, block_size=64) == 4096
    assert fit_to_cache(default, num_blocks=10, block_size=64) == 640  # lowered to the cache
    assert fit_to_cache(explicit, num_blocks=10, block_size=64) == 4096  # never: allocation reports it


def test_config_derives_again_once_the_length_is_known():
    cfg = EngineConfig(max_num_seqs=4)
    assert cfg.max_model_len is None and cfg.max_num_batched_tokens == 2048
    cfg.resolve_max_model_len(128)
    assert (cfg.max_model_len, cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold) == (128, 512, 5)
    cfg.resolve_max_model_len(4096)  # again, e.g. lowered to the cache: the defaults follow
    assert (cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold) == (2048, 163)
    cfg = EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=1000, long_prefill_token_threshold=7)
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        cfg.resolve_max_model_len(2048)  # the user's budget stays, and is checked against the new length
    cfg = EngineConfig(enable_chunked_prefill=False)
    assert cfg.max_num_batched_tokens is None
    cfg.resolve_max_model_len(300)
    assert cfg.max_num_batched_tokens == 300


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """A random Qwen3 whose max_position_embeddings (512) is below the old fixed default of 2048, with a tokenizer."""
    path = str(tmp_path_factory.mktemp("short") / "qwen3-512")
    return add_qwen3_tokenizer(write_random_model(path, "qwen3", max_position_embeddings=512))


def test_llm_with_no_options_starts_on_a_512_token_model(short_model, caplog):
    with caplog.at_level(logging.INFO, logger="fdlite"):
        llm = LLM(short_model)
    assert llm.config.max_model_len == 512
    assert any("max_model_len=512: the model's context length (max_position_embeddings=512)" in r.getMessage()
               for r in caplog.records)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        LLM(short_model, max_model_len=1024)


def test_default_length_is_lowered_to_the_kv_cache(short_model, caplog):
    bytes_per_token = 2 * 2 * 2 * 32 * 4  # k and v, 2 layers, 2 KV heads, head_dim 32, float32
    with caplog.at_level(logging.INFO, logger="fdlite"):
        llm = LLM(short_model, block_size=16, kv_cache_memory_bytes=20 * 16 * bytes_per_token)
    assert llm.num_blocks == 20 and llm.config.max_model_len == 320
    assert any("max_model_len=320: what the KV cache holds (20 blocks of 16 tokens)" in r.getMessage()
               for r in caplog.records)
    out = llm.generate([list(range(3, 303))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 20 and out.outputs[0].finish_reason == "length"
