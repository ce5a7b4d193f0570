"""Continuous batching under one token budget shared by prefill and decode (vLLM v1's scheme).

Each step, running sequences go first (a decode is one token; a partly prefilled prompt continues),
then waiting ones join while the batch has room (`max_num_seqs`), the budget has tokens
(`max_num_batched_tokens`) and the cache has blocks. When a running sequence needs a block and none
is free, the lowest-priority running sequence (the latest to arrive) is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later. No request is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fdlite.config import EngineConfig
from fdlite.kvcache.block_allocator import BlockAllocator
from fdlite.runner.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    rows: list[tuple[Sequence, int]]  # (sequence, tokens computed this step), in priority order
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.rows)


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: BlockAllocator):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch(rows=[])
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if n < seq.num_uncomputed_tokens and not self.chunked_prefill:
                break
            # Make room, preempting from the tail; the tail may be this sequence itself.
            while not self.allocator.can_grow(seq.block_table, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.allocator.grow(seq.block_table, seq.num_computed_tokens + n)
            batch.rows.append((seq, n))
            budget -= n
            i += 1

        # New sequences join only on a step that preempted nothing: blocks are short.
        while not batch.preempted and self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if n < seq.num_uncomputed_tokens and not self.chunked_prefill:
                break
            if not self.allocator.can_grow(seq.block_table, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.allocator.grow(seq.block_table, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.rows.append((seq, n))
            budget -= n
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark a running sequence finished and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.allocator.free(seq.block_table)
        self.running.remove(seq)
