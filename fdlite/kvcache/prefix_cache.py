"""Prefix caching: which KV blocks a new sequence can take over instead of computing them.

Offline batches repeat prefixes (one system prompt or few-shot block in front of thousands of
questions). A full block is named by a hash chained over everything in front of it,
`hash(block i) = H(hash(block i-1), token ids of block i)`, so two sequences that agree on their
first k blocks of tokens agree on their first k hashes, and a hash names the block's KV exactly
(the KV at a position depends only on the tokens up to it). Only full blocks whose tokens are all
computed are hashed: a partial block is still being written. Output tokens count like prompt
tokens, so the blocks of a finished or preempted sequence are reusable too.

`PrefixCache` owns the hash -> block map and the LRU of cached blocks that no sequence uses
(reference count 0, counted by the allocator). Those keep their KV and their hash until the
allocator has no never-cached free block left and evicts the least recently freed one. It also
keeps the hit statistics (tokens looked up, tokens found).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

ROOT_HASH = b""  # the parent of block 0


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """Chain hash of one full block. 128-bit blake2b: collisions are not a practical concern,
    unlike Python's `hash`, which is 64-bit and predictable for small ints."""
    return hashlib.blake2b(parent + np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=16).digest()


class PrefixCache:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._unused: OrderedDict[int, None] = OrderedDict()  # cached, reference count 0; oldest first
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.num_evictions = 0

    # ---- hashing -------------------------------------------------------------------------

    def seq_hashes(self, seq, num_blocks: int) -> list[bytes]:
        """The chain hashes of `seq`'s first `num_blocks` full blocks, computed once per sequence
        (tokens are append-only, so a block's hash never changes). Only blocks whose tokens are all
        known are hashed: fewer than `num_blocks` come back while placeholders are pending."""
        hashes = seq.block_hashes
        bs = self.block_size
        num_blocks = min(num_blocks, seq.num_known_tokens // bs)
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH, seq.token_ids(i * bs, (i + 1) * bs)))
        return hashes

    def lookup(self, seq) -> list[int]:
        """Blocks holding the longest cached block-aligned prefix of `seq`.

        Capped so that at least the last token is computed: its logits pick the next token, and
        it lives in a block of its own that this sequence will write (a cached block is shared
        and never written). Hashes are computed only up to the first miss.
        """
        max_blocks = min((seq.num_tokens - 1) // self.block_size, seq.num_known_tokens // self.block_size)
        blocks = []
        for i in range(max_blocks):
            block = self._block_of.get(self.seq_hashes(seq, i + 1)[i])
            if block is None:
                break
            blocks.append(block)
        return blocks

    # ---- the map and the LRU ---------------------------------------------------------------

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def register(self, block: int, block_hash: bytes) -> None:
        """Name `block` by `block_hash`, unless another block already holds that content (two
        sequences computed the same block in one step): the duplicate stays uncached and goes
        back to the free list when its sequence lets go of it."""
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash

    def park(self, block: int) -> None:
        """A cached block's last user let go of it: keep it, evictable, newest last."""
        self._unused[block] = None

    def unpark(self, block: int) -> None:
        """A parked block is taken again by a prefix hit."""
        del self._unused[block]

    @property
    def num_evictable(self) -> int:
        return len(self._unused)

    def evict_oldest(self) -> int:
        """Forget the least recently freed unused block and return it for reuse."""
        block, _ = self._unused.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        self.num_evictions += 1
        return block

    def evict_all_unused(self) -> list[int]:
        """Forget every unused cached block (for `reset_prefix_cache`)."""
        blocks = []
        while self._unused:
            blocks.append(self.evict_oldest())
        return blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """One sequence joined the batch with `num_hit_tokens` of its `num_tokens` from the cache
        (a preempted sequence counts again when it comes back, as in vLLM)."""
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit_tokens
