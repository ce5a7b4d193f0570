"""One layer's K (or V) cache in FP8 (e4m3), with a float32 scale per token and KV head (`kv_cache_dtype="fp8"`).

Each (slot, KV head) vector of head_dim values is stored as e4m3 bits of `value / scale`, `scale = amax / 448`
(e4m3's largest finite value), computed when the token is written: no calibration pass, no scale from the
checkpoint needed, and no earlier token ever re-quantized (a scale per layer and head fixed at the first write
would clip later outliers). The scale costs 4 bytes beside the vector's head_dim bytes (3% at head_dim 128), so
a bf16 cache's blocks become 1.94x as many and a float32 one's 3.88x. Readers multiply by the scale after the
dot products' inputs are widened, so a kernel can fold it into a score column (K) or a probability column (V).

The CPU path reads and writes through numpy views of the tensors: Paddle 3.3's CPU scatter has no uint8
kernel. On the GPU the cache-write kernel quantizes (`gpu.rope_qk_norm_cache_fp8`) and the attention kernels widen
value x scale as they read (`gpu.paged_attention_fp8`; ops_rope_cache.cu, ops_attention.cu, attention_mma.cuh). The layout is the model-dtype cache's, [num_blocks + 1, kv_heads, block_size, head_dim], plus
[num_blocks + 1, kv_heads, block_size] scales, addressed by the same flat rows (fdlite/layers/attention.py).
"""

from __future__ import annotations

import numpy as np
import paddle

from fdlite.kernels import device_tensors, platform

E4M3_MAX = 448.0
NAN_BITS = 0x7F  # e4m3fn has NaN (S.1111.111) and no infinities
MAX_BITS = 0x7E  # 448


class Fp8Cache:
    """`data`: e4m3 bits as uint8 [num_blocks + 1, kv_heads, block_size, head_dim]; `scale`: float32
    [num_blocks + 1, kv_heads, block_size]. Owned by `KVCache` (fdlite/kvcache/cache_tensors.py)."""

    @property
    def dtype(self):
        # Looked up when used, not at import: Paddle 2.6 (the GPU host framework) has no float8 dtype.
        return paddle.float8_e4m3fn

    def __init__(self, shape: list[int]):
        self.data = device_tensors.full(shape, 0, "uint8")
        self.scale = device_tensors.full(shape[:-1], 0, "float32")

    @property
    def shape(self) -> list[int]:
        return self.data.shape

    @property
    def place(self):
        return self.data.place

    def write(self, rows: paddle.Tensor, values: paddle.Tensor) -> None:
        """values [n, head_dim] (any float dtype) into flat rows `rows` (int64 [n]), each with its own scale."""
        v = values.astype("float32")
        amax = v.abs().max(axis=-1, keepdim=True)
        scale = paddle.where(amax > 0, amax / E4M3_MAX, paddle.ones_like(amax))
        bits = (v / scale).astype(paddle.float8_e4m3fn).view(paddle.uint8)
        idx = np.from_dlpack(rows)
        d = self.data.shape[-1]
        np.from_dlpack(self.data).reshape(-1, d)[idx] = np.from_dlpack(bits)
        np.from_dlpack(self.scale).reshape(-1)[idx] = np.from_dlpack(scale).reshape(-1)

    def read(self, rows: paddle.Tensor) -> paddle.Tensor:
        """Flat rows `rows` (int64 [n]) -> float32 [n, head_dim]."""
        idx = np.from_dlpack(rows)
        d = self.data.shape[-1]
        bits = paddle.to_tensor(np.take(np.from_dlpack(self.data).reshape(-1, d), idx, axis=0))
        scale = paddle.to_tensor(np.take(np.from_dlpack(self.scale).reshape(-1), idx))
        return bits.view(paddle.float8_e4m3fn).astype("float32") * scale.unsqueeze(-1)

    def poison(self, start: int, stop: int, value: float) -> None:
        """Debug: blocks [start, stop) read as `value` (NaN, or a huge finite value) until written again."""
        bits, scale_value = (NAN_BITS, 1.0) if np.isnan(value) else (MAX_BITS, value / E4M3_MAX)
        if platform.is_gpu():  # leading-axis slices are views; the fill runs in stream order
            device_tensors.fill_(self.data[start:stop], bits)
            device_tensors.fill_(self.scale[start:stop], scale_value)
            return
        np.from_dlpack(self.data)[start:stop] = bits
        np.from_dlpack(self.scale)[start:stop] = scale_value

    def release(self) -> None:
        device_tensors.release_tensor(self.data)
        device_tensors.release_tensor(self.scale)
