"""The KV-cache tensors: one (K, V) pair per layer, each [num_blocks + 1, kv_heads, block_size, head_dim].

FastDeploy's layout: within a block each KV head's tokens are contiguous, so gathering a row's context
by (head, block) yields [kv_heads, tokens, head_dim] with no transpose (a strided copy is slow on CPU).
The extra last block is scratch: tokens that must write nowhere (rows padded to a captured batch size)
write to its first slot, so every token can take the same scatter path.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """DESIGN.md's formula: K and V, every layer, one block."""
    return 2 * num_layers * block_size * kv_heads * head_dim * _DTYPE_BYTES[dtype]


@dataclass
class KVCache:
    num_blocks: int
    block_size: int
    caches: list[tuple[paddle.Tensor, paddle.Tensor]]

    @property
    def scratch_slot(self) -> int:
        return self.num_blocks * self.block_size

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_layers: int, kv_heads: int, head_dim: int, dtype: str) -> KVCache:
        shape = [num_blocks + 1, kv_heads, block_size, head_dim]
        caches = [(paddle.zeros(shape, dtype=dtype), paddle.zeros(shape, dtype=dtype)) for _ in range(num_layers)]
        return cls(num_blocks, block_size, caches)
