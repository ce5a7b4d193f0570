"""Paged KV-cache bookkeeping: a free list of fixed-size blocks and each sequence's block table.

Pure Python, no tensors: the scheduler asks it whether a sequence can grow to n tokens, grows it,
and frees a finished or preempted sequence's blocks. Slot i of block b is cache row
`b * block_size + i`.
"""

from __future__ import annotations

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_size) - len(block_table) <= len(self._free)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks to `block_table` until it holds `num_tokens` tokens."""
        need = blocks_for(num_tokens, self.block_size) - len(block_table)
        if need > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: need {need}, {len(self._free)} free")
        for _ in range(need):
            block_table.append(self._free.popleft())

    def free(self, block_table: list[int]) -> None:
        """Return a sequence's blocks to the free list and empty its table."""
        self._free.extend(block_table)
        block_table.clear()
