"""Startup cost of the model's construction and weight loading (issue 24, "ready in seconds").

The rotary cos/sin table is built once per model, for max_model_len positions, and converted on the host with
numpy; the loader copies each checkpoint tensor (or this rank's slice of it) once into its place, and on the
GPU path (emulated, `gpu_emulator.py`) straight from the memory-mapped file into the device parameter, with
no Paddle CPU kernel (cast, transpose, concat) on the way for Hugging Face checkpoints.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

import gpu_emulator
from fdlite import LLM
from fdlite.layers import rotary
from fdlite.models import decoder

OPTS = dict(skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_num_batched_tokens=96,
            kv_cache_memory_bytes=1 << 22)


def test_rotary_table_is_built_once_per_model_for_max_model_len(model_dirs, monkeypatch):
    built = []

    class Counting(rotary.RotaryEmbedding):
        def __init__(self, head_dim, max_positions, *a, **k):
            built.append(max_positions)
            super().__init__(head_dim, max_positions, *a, **k)

    monkeypatch.setattr(decoder, "RotaryEmbedding", Counting)
    llm = LLM(model_dirs["qwen3"], max_model_len=200, **OPTS)
    model = llm.runner.model
    assert built == [200]
    tables = {id(layer.self_attn.attn.rotary) for layer in model.model.layers}
    assert tables == {id(model.model.rotary_emb)} and len(model.model.layers) > 1
    assert list(model.model.rotary_emb.cos.shape) == [200, model.config.head_dim]


def test_rotary_table_in_bfloat16_is_rounded_on_the_host_as_paddle_casts():
    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * 3
    x[:4] = [np.inf, -np.inf, 3.4e38, 1e-40]
    bits = rotary.host_bits(x, "bfloat16")
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits, paddle.to_tensor(x).astype("bfloat16").numpy())
    table = rotary.RotaryEmbedding(64, 50, 10000.0, None, "bfloat16")
    assert table.cos.dtype == paddle.bfloat16 and list(table.cos.shape) == [50, 64]
    want = rotary.RotaryEmbedding(64, 50, 10000.0, None, "float32").cos.astype("bfloat16")
    np.testing.assert_array_equal(table.cos.numpy(), want.numpy())
