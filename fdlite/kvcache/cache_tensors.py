"""The KV-cache tensors: one (K, V) pair per layer, each [num_blocks + 1, kv_heads, block_size, head_dim].

FastDeploy's layout: within a block each KV head's tokens are contiguous, so gathering a row's context
by (head, block) yields [kv_heads, tokens, head_dim] with no transpose (a strided copy is slow on CPU).
The extra last block is scratch: tokens that must write nowhere (rows padded to a captured batch size)
write to its first slot, so every token can take the same scatter path.

`poison_blocks` (debug) overwrites blocks no one may read: keys become NaN, so any read that
attention does not mask turns the row's output into NaN, and values become huge but finite, so
masked reads (probability exactly 0) stay harmless, as they are with stale data.

With `kv_cache_dtype="fp8"` each K and V is an `Fp8Cache` (fdlite/kvcache/fp8_cache.py): e4m3 values with a
scale per token and KV head, in the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle

from fdlite.kernels import device_tensors
from fdlite.kvcache.fp8_cache import Fp8Cache

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
POISON_VALUE = 3.0e4  # finite in float16 too


def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: str,
                    kv_cache_dtype: str = "auto") -> int:
    """K and V, every layer, one block (docs/design.md, section "KV-cache sizing"): head_dim values of the model's
    dtype per token and KV head, or head_dim e4m3 bytes and a float32 scale with kv_cache_dtype "fp8"."""
    per_vector = head_dim + 4 if kv_cache_dtype == "fp8" else head_dim * _DTYPE_BYTES[dtype]
    return 2 * num_layers * block_size * kv_heads * per_vector


@dataclass
class KVCache:
    num_blocks: int
    block_size: int
    caches: list[tuple[paddle.Tensor | Fp8Cache, paddle.Tensor | Fp8Cache]]

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_layers: int, kv_heads: int, head_dim: int, dtype: str,
                 kv_cache_dtype: str = "auto") -> KVCache:
        shape = [num_blocks + 1, kv_heads, block_size, head_dim]
        if kv_cache_dtype == "fp8":
            caches = [(Fp8Cache(shape), Fp8Cache(shape)) for _ in range(num_layers)]
        else:
            caches = [(device_tensors.full(shape, 0, dtype), device_tensors.full(shape, 0, dtype)) for _ in range(num_layers)]
        return cls(num_blocks, block_size, caches)

    def release(self) -> None:
        """Free every layer's K and V now (the engine is closing), whoever still holds this object."""
        for k, v in self.caches:
            for t in (k, v):
                if isinstance(t, Fp8Cache):
                    t.release()
                else:
                    device_tensors.release_tensor(t)
        self.caches = []

    def poison_blocks(self, blocks: list[int]) -> None:
        """Debug: make `blocks` unreadable (NaN keys, huge values) until they are written again."""
        if not blocks:
            return
        blocks = sorted(blocks)
        for k, v in self.caches:
            for start, stop in _runs(blocks):  # a run of blocks is a leading-axis slice: a contiguous view
                if isinstance(k, Fp8Cache):
                    k.poison(start, stop, float("nan"))
                    v.poison(start, stop, POISON_VALUE)
                    continue
                device_tensors.fill_(k[start:stop], float("nan"))
                device_tensors.fill_(v[start:stop], POISON_VALUE)


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted block ids as [start, stop) runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs
