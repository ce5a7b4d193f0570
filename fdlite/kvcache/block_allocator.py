"""Paged KV-cache bookkeeping: reference-counted fixed-size blocks and each sequence's block table.

Pure Python, no tensors: the scheduler asks it whether a sequence can grow to n tokens, grows it,
and frees a finished or preempted sequence's blocks (`free`). Slot i of block b is cache row
`b * block_size + i`.

With prefix caching a block may be in several block tables at once (a shared prefix), so blocks
carry a reference count. A block whose count drops to 0 goes back to the free list, unless it is
cached (`PrefixCache`): then it keeps its KV, parked in an LRU, and is evicted only when the free
list is empty and a block is needed. Free capacity is therefore the free list plus the evictable
blocks. A sequence only ever writes blocks it holds alone and that are not cached: prefix hits
stop short of the block with the last token, and decode writes go to the sequence's own last block.

`on_release` (debug) is called with blocks whose contents no one may read any more (freed
uncached blocks, evicted blocks), so the KV cache can poison them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from fdlite.kvcache.prefix_cache import PrefixCache


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self.prefix_cache = PrefixCache(block_size) if enable_prefix_caching else None
        self.on_release: Callable[[list[int]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence could get now: never-cached free ones plus evictable cached ones."""
        return len(self._free) + (self.prefix_cache.num_evictable if self.prefix_cache else 0)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def _take_free_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block = self.prefix_cache.evict_oldest()
            if self.on_release is not None:
                self.on_release([block])
        self._refs[block] = 1
        return block

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_size) - len(block_table) <= self.num_free_blocks

    def grow(self, block_table: list[int], num_tokens: int) -> int:
        """Append blocks to `block_table` until it holds `num_tokens` tokens; return how many were added."""
        need = blocks_for(num_tokens, self.block_size) - len(block_table)
        if need > self.num_free_blocks:
            raise RuntimeError(f"KV cache out of blocks: need {need}, {self.num_free_blocks} free")
        for _ in range(need):
            block_table.append(self._take_free_block())
        return max(need, 0)

    def free(self, block_table: list[int]) -> None:
        """Let go of a finished or preempted sequence's blocks and empty its table.

        Tail first, so that of a parked chain the tail blocks are evicted first: a chain is
        only found from its head, so an evicted head would strand the rest.
        """
        released = []
        for block in reversed(block_table):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if self.prefix_cache is not None and self.prefix_cache.is_cached(block):
                self.prefix_cache.park(block)
            else:
                self._free.append(block)
                released.append(block)
        block_table.clear()
        if released and self.on_release is not None:
            self.on_release(released)

    # ---- prefix caching --------------------------------------------------------------------

    def match_prefix(self, seq) -> list[int]:
        """Cached blocks for the longest block-aligned prefix of `seq` (none without caching)."""
        return self.prefix_cache.lookup(seq) if self.prefix_cache is not None else []

    def can_admit(self, hits: list[int], num_tokens: int) -> bool:
        """Whether a new sequence can hold `num_tokens` tokens starting from the `hits` blocks.
        A hit parked in the LRU leaves the evictable pool when taken, so it costs a block too."""
        need = blocks_for(num_tokens, self.block_size) - len(hits)
        parked_hits = sum(1 for b in hits if self._refs[b] == 0)
        return need + parked_hits <= self.num_free_blocks

    def admit(self, seq, hits: list[int], num_tokens: int) -> None:
        """Give a sequence with an empty table the `hits` blocks (shared) and fresh blocks up to
        `num_tokens` tokens; record the lookup in the hit statistics."""
        assert not seq.block_table, "admit expects a sequence without blocks"
        for block in hits:
            if self._refs[block] == 0:
                self.prefix_cache.unpark(block)
            self._refs[block] += 1
        seq.block_table.extend(hits)
        seq.num_hashed_blocks = len(hits)
        self.grow(seq.block_table, num_tokens)
        if self.prefix_cache is not None:
            self.prefix_cache.record_query(seq.num_tokens, len(hits) * self.block_size)

    def cache_full_blocks(self, seq, computed: int | None = None) -> None:
        """Hash and cache the blocks of `seq` that are full and computed: of its first `computed` tokens (those whose
        KV the steps that have run wrote; default: every step scheduled so far), those whose ids are known."""
        if self.prefix_cache is None:
            return
        computed = seq.num_computed_tokens if computed is None else min(computed, seq.num_computed_tokens)
        full = min(computed, seq.num_known_tokens) // self.block_size
        if full <= seq.num_hashed_blocks:
            return
        hashes = self.prefix_cache.seq_hashes(seq, full)
        for i in range(seq.num_hashed_blocks, full):
            self.prefix_cache.register(seq.block_table[i], hashes[i])
        seq.num_hashed_blocks = full

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; refused (False) while any block is in use, as in vLLM."""
        if any(self._refs):
            return False
        if self.prefix_cache is not None:
            released = self.prefix_cache.evict_all_unused()
            self._free.extend(released)
            if released and self.on_release is not None:
                self.on_release(released)
        return True

    def check_writable(self, block_table: list[int], start: int, end: int) -> None:
        """Debug check: positions [start, end) may only go to blocks held alone and not cached."""
        for i in range(start // self.block_size, blocks_for(end, self.block_size)):
            block = block_table[i]
            if self._refs[block] != 1 or (self.prefix_cache is not None and self.prefix_cache.is_cached(block)):
                raise AssertionError(
                    f"write to shared or cached block {block} (references {self._refs[block]}) at positions [{start}, {end})"
                )
