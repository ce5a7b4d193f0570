"""Rotary position embedding (NeoX / Hugging Face `rotate_half` layout) with Llama 3 frequency scaling.

The cos/sin table is built once per model (every layer shares it: `DecoderModel`) for every position up to
max_model_len, in float32 with numpy and the same arithmetic as transformers (inverse frequencies from
float32 powers, then position * inv_freq), and looked up by each token's position, so flat token batches
need no per-step trigonometry. It is converted to the model dtype on the host with numpy (`host_bits`:
bfloat16 as its uint16 bits, rounded to nearest even as transformers' `cos.to(dtype)`) and copied to the
device once: Paddle 2.6's own float32 -> bfloat16 conversion of a host array runs element by element in
Python (28 layers' tables of Qwen3-0.6B's 40,960 positions took 171 s).
"""

from __future__ import annotations

import math

import numpy as np
import paddle
from paddle import nn


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))).astype(np.float32)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: default, llama3)")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def host_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """Float32 `x` as the host array Paddle takes for a `dtype` tensor: float32 / float16 values, or bfloat16's
    uint16 bits rounded to nearest even (NaN stays NaN), computed with numpy bit operations."""
    if dtype == "float32":
        return np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float16":
        return np.ascontiguousarray(x, dtype=np.float16)
    if dtype != "bfloat16":
        raise ValueError(f"no host conversion to {dtype}")
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    bits = ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        bits[nan] = 0x7FC0
    return bits


class RotaryEmbedding(nn.Layer):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, dtype: str):
        super().__init__()
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        freqs = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        # Buffers, not parameters: they never appear in a checkpoint. One host-to-device copy each of the
        # host array in the model dtype (a uint16 array becomes a bfloat16 tensor): no Paddle kernel runs.
        self.register_buffer("cos", paddle.to_tensor(host_bits(np.cos(emb), dtype)), persistable=False)
        self.register_buffer("sin", paddle.to_tensor(host_bits(np.sin(emb), dtype)), persistable=False)

    def forward(self, positions: paddle.Tensor, q: paddle.Tensor, k: paddle.Tensor):
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        cos = paddle.gather(self.cos, positions).unsqueeze(1)
        sin = paddle.gather(self.sin, positions).unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    x1, x2 = paddle.chunk(x, 2, axis=-1)
    return x * cos + paddle.concat([-x2, x1], axis=-1) * sin
