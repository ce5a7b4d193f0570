"""Continuous batching under one token budget shared by prefill and decode (vLLM v1's scheme).

Each step, running sequences go first (a decode is one token; a partly prefilled prompt continues),
then waiting ones join while the batch has room (`max_num_seqs`), the budget has tokens
(`max_num_batched_tokens`) and the cache has blocks. When a running sequence needs a block and none
is free, the lowest-priority running sequence (the latest to arrive) is preempted: its blocks are
freed (their full blocks stay in the prefix cache) and it goes back to the front of the queue to be
recomputed later. No request is dropped.

A joining sequence first takes the longest cached prefix of its tokens from the prefix cache and
computes only the rest. A sequence whose next uncached block is being computed in this very step by
another one (100 requests behind one system prompt, or the n children of one request) waits a step
and then finds it cached, instead of computing it again.

Chunked prefill: a prompt longer than the budget left in the step gets a chunk of it, and the rest
in later steps, while decodes keep running. FastDeploy's limits on prefills spanning steps
("partial" prefills) hold at every step:
- at most `max_num_partial_prefills` sequences are partially prefilled at once; when that is more
  than 1, each prefill's chunk is capped at the budget divided by the prefills wanting to run
  (vLLM's rule), so several long prompts progress side by side;
- at most `max_long_partial_prefills` of them are long (more than `long_prefill_token_threshold`
  tokens left to compute); a long prompt that cannot start goes past, so shorter ones behind it
  start first.
Sequences passed over (for these limits or to wait for a shared block) keep their place; at most
`max_num_seqs` are passed over per step, which bounds the scan of a long queue.

The scheduler alone advances and finishes `Sequence`s. `schedule()` counts the scheduled tokens as
computed and gives each row that will sample a placeholder token (vLLM v1's
`_update_after_schedule` and `num_output_placeholders`), so the next step can be scheduled before
this one's tokens are known (async scheduling) with no other call. `update_from_output` turns the
placeholders into the sampled tokens, offers the blocks that became full to the prefix cache,
advances grammars and finishes the rows that stop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import repeat

from fdlite.config import EngineConfig
from fdlite.kvcache.block_allocator import BlockAllocator
from fdlite.runner.sequence import Sequence, SequenceStatus
from fdlite.runner.stop_checker import check_stop


@dataclass
class ScheduledBatch:
    """What changed this step (vLLM's `SchedulerOutput`): the rows to run and the diff the worker's
    persistent batch applies (finished and preempted sequences leave, grown ones append blocks,
    joined ones take a slot)."""

    rows: list[tuple[Sequence, int]]  # (sequence, tokens computed this step), in priority order
    preempted: list[Sequence] = field(default_factory=list)
    grown: list[Sequence] = field(default_factory=list)  # running sequences that got new blocks
    joined: list[Sequence] = field(default_factory=list)  # sequences admitted from the queue this step
    finished: list[Sequence] = field(default_factory=list)  # finished or aborted since the last schedule
    num_decodes: int = 0  # leading rows known to be one-token decodes (the common step's fast path)
    # rows whose step completes a block (prefix caching), with their tokens computed once this step has run: with
    # async scheduling a later step may already be scheduled when this one's tokens come back, and a block whose
    # last slot only that later step writes must not be cached yet (it may never be written: the row can finish).
    filled: list[tuple[Sequence, int]] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: BlockAllocator, eos_token_ids: set[int] | None = None):
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.max_num_partial_prefills = config.max_num_partial_prefills
        self.max_long_partial_prefills = config.max_long_partial_prefills
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Sequences whose prefill spans steps and is unfinished -> whether it counts as long.
        self.partial_prefills: dict[Sequence, bool] = {}
        self.num_preemptions = 0
        self.num_constrained = 0  # unfinished sequences with a grammar (structured outputs)
        self.eos_token_ids = eos_token_ids if eos_token_ids is not None else set()  # model + tokenizer EOS
        self._left: list[Sequence] = []  # finished since the last schedule: the next batch tells the worker
        self._latest: ScheduledBatch | None = None  # the last batch handed out

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.num_constrained += seq.grammar is not None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = self._schedule()
        batch.finished, self._left = self._left, []
        self._update_after_schedule(batch)
        self._latest = batch
        return batch

    def _update_after_schedule(self, batch: ScheduledBatch) -> None:
        """The rows' tokens count as computed now (the forwards run in order, so any later step reads
        them); each row that catches up samples a token whose value comes later: a placeholder."""
        rows, bs, filled = batch.rows, self.block_size, batch.filled
        caching = self.allocator.prefix_cache is not None
        for seq, _ in rows[: batch.num_decodes]:  # each computes its newest token and samples the next
            c = seq.num_computed_tokens = seq.num_computed_tokens + 1
            seq.num_output_placeholders += 1
            if caching and c // bs > seq.num_hashed_blocks:
                filled.append((seq, c))
        for seq, n in rows[batch.num_decodes :]:
            c = seq.num_computed_tokens = seq.num_computed_tokens + n
            if c == seq.num_tokens:
                seq.num_output_placeholders += 1
            if caching and c // bs > seq.num_hashed_blocks:
                filled.append((seq, c))

    def _schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch(rows=[])
        slot = self._prefill_slot()
        i = 0
        if not self.partial_prefills and len(self.running) <= budget and self._schedule_decodes(batch):
            i = len(self.running)
            budget -= i
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if seq in self.partial_prefills:
                n = min(n, slot)
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
            if self.allocator.grow(seq.block_table, seq.num_computed_tokens + n):
                batch.grown.append(seq)
            batch.rows.append((seq, n))
            self._track_partial(seq, n)
            budget -= n
            i += 1

        # New sequences join only on a step that preempted nothing: blocks are short.
        if batch.preempted or not self.waiting or len(self.running) >= self.max_num_seqs or budget <= 0:
            return batch
        in_flight = self._blocks_in_flight(batch)
        passed_over = 0
        j = 0
        while j < len(self.waiting) and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[j]
            # Prompt logprobs need the forward of every prompt token: no prefix-cache hits (vLLM does the same).
            hits = [] if seq.wants_prompt_logprobs else self.allocator.match_prefix(seq)
            cached = len(hits) * self.block_size
            todo = seq.num_tokens - cached
            n = min(todo, budget, slot)
            if n < todo and not self.chunked_prefill:
                break  # FCFS: the head waits for a step with room for its whole prompt
            if (n < todo and not self._may_start_partial(todo)) or (
                    not seq.wants_prompt_logprobs and self._next_block_in_flight(seq, len(hits), in_flight)):
                passed_over += 1
                if passed_over > self.max_num_seqs:
                    break
                j += 1
                continue
            if not self.allocator.can_admit(hits, cached + n):
                break  # out of blocks: nobody behind it jumps the queue for memory
            del self.waiting[j]
            self.allocator.admit(seq, hits, cached + n)
            seq.num_computed_tokens = cached
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.joined.append(seq)
            batch.rows.append((seq, n))
            self._track_partial(seq, n)
            if in_flight is not None:
                in_flight.update(self._uncomputed_block_hashes(seq))
            budget -= n
        return batch

    def _schedule_decodes(self, batch: ScheduledBatch) -> bool:
        """Fast path for the common step: every running sequence decodes one token.

        Without partial prefills every running sequence has exactly one token to compute (its
        last sampled one), so only those whose token opens a new block need the allocator. False,
        with nothing changed, when the free blocks cannot cover them (the general loop preempts).
        """
        bs = self.block_size
        need = [s for s in self.running if s.num_computed_tokens >= len(s.block_table) * bs]
        if len(need) > self.allocator.num_free_blocks:
            return False
        for seq in need:
            self.allocator.grow(seq.block_table, seq.num_computed_tokens + 1)
        batch.grown.extend(need)
        batch.rows.extend(zip(self.running, repeat(1)))  # C speed: this runs every step for every row
        batch.num_decodes = len(batch.rows)
        return True

    # ---- chunked prefill limits ------------------------------------------------------------

    def _prefill_slot(self) -> int:
        """Most tokens one prefill may take this step: the whole budget, or with several partial
        prefills allowed, the budget split among the prefills that want to run (vLLM's rule)."""
        if not self.chunked_prefill or self.max_num_partial_prefills == 1:
            return self.max_num_batched_tokens
        wanting = len(self.partial_prefills)
        long = sum(self.partial_prefills.values())
        for k, seq in enumerate(self.waiting):
            if wanting >= self.max_num_partial_prefills or k > self.max_num_seqs:
                break  # the same look-ahead bound as the admission loop
            if seq.num_tokens > self.long_prefill_token_threshold:
                if long >= self.max_long_partial_prefills:
                    continue  # would not start this step
                long += 1
            wanting += 1
        return max(1, self.max_num_batched_tokens // max(1, wanting))

    def _may_start_partial(self, todo: int) -> bool:
        if len(self.partial_prefills) >= self.max_num_partial_prefills:
            return False
        is_long = todo > self.long_prefill_token_threshold
        return not (is_long and sum(self.partial_prefills.values()) >= self.max_long_partial_prefills)

    def _track_partial(self, seq: Sequence, n: int) -> None:
        """After scheduling n tokens of `seq`: is its prefill left unfinished at the end of the step?"""
        todo = seq.num_uncomputed_tokens
        if n < todo:
            self.partial_prefills.setdefault(seq, todo > self.long_prefill_token_threshold)
        else:
            self.partial_prefills.pop(seq, None)

    # ---- in-step sharing of prefix blocks ---------------------------------------------------

    def _uncomputed_block_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of the full blocks `seq` has still to compute (in this step or later ones)."""
        cache = self.allocator.prefix_cache
        first = seq.num_computed_tokens // self.block_size
        return cache.seq_hashes(seq, seq.num_tokens // self.block_size)[first:]  # known tokens only

    def _blocks_in_flight(self, batch: ScheduledBatch) -> set[bytes] | None:
        """Hashes of full blocks that running prefills are computing; None without prefix caching."""
        if self.allocator.prefix_cache is None:
            return None
        hashes: set[bytes] = set()
        for seq, n in batch.rows:
            if n > 1:
                hashes.update(self._uncomputed_block_hashes(seq))
        for seq in self.partial_prefills:
            hashes.update(self._uncomputed_block_hashes(seq))
        return hashes

    def _next_block_in_flight(self, seq: Sequence, num_hits: int, in_flight: set[bytes] | None) -> bool:
        """Whether the first block `seq` would compute is being computed by another sequence now,
        so that waiting a step turns it into a cache hit."""
        if not in_flight or num_hits >= min(seq.num_tokens - 1, seq.num_known_tokens) // self.block_size:
            return False
        return self.allocator.prefix_cache.seq_hashes(seq, num_hits + 1)[num_hits] in in_flight

    # ---- leaving the running set ------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.partial_prefills.pop(seq, None)
        self.waiting.appendleft(seq)

    # ---- after a step ------------------------------------------------------------------------

    def update_from_output(self, scheduled: ScheduledBatch, seqs: list[Sequence], tokens: list[int],
                           candidates: list[int], stop_strings: dict[int, str], now: float) -> list[Sequence]:
        """A step's results: `seqs` (its rows that sampled, in logits order) take `tokens` in place of
        their placeholders; blocks that became full go to the prefix cache (before any finished
        sequence lets go of them); `candidates` (the rows that may stop, found on token ids by the
        worker) are checked, with the stop string the output processor found in a row's text; a
        constrained row's grammar takes its token. Returns the sequences that finished."""
        for seq, token in zip(seqs, tokens):
            seq.output_token_ids.append(token)
            seq.num_output_placeholders -= 1
        constrained = [(s, t) for s, t in zip(seqs, tokens) if s.grammar is not None] if self.num_constrained else ()
        for seq, computed in scheduled.filled:  # hashes only the known tokens: a block with a placeholder waits
            self.allocator.cache_full_blocks(seq, computed)
        finished = []
        for i in candidates:
            seq, token = seqs[i], tokens[i]
            if seq.is_finished:
                continue
            stop = check_stop(seq, token, stop_strings.get(i), self.eos_token_ids, self.max_model_len)
            if stop is not None:
                seq.finish_time = now
                self.finish(seq, *stop)
                finished.append(seq)
        for seq, token in constrained:
            if not seq.is_finished and not seq.grammar.consume_token(token):
                # The grammar hit a backend limit: the row ends with an error, the batch goes on.
                seq.error = f"structured_outputs: the grammar matcher failed: {seq.grammar.get_error().strip()}"
                seq.finish_time = now
                self.finish(seq, "error")
                finished.append(seq)
        if finished and self._latest is not None and self._latest is not scheduled:
            self._drop_from_latest(set(finished))
        return finished

    def _drop_from_latest(self, gone: set[Sequence]) -> None:
        """Async scheduling: the batch scheduled ahead holds rows that finished meanwhile; they leave it
        before the worker prepares it (their blocks are free already)."""
        b = self._latest
        b.num_decodes -= sum(s in gone for s, _ in b.rows[: b.num_decodes])
        b.rows = [(s, n) for s, n in b.rows if s not in gone]
        b.grown = [s for s in b.grown if s not in gone]
        b.filled = [(s, c) for s, c in b.filled if s not in gone]

    def abort(self, seq: Sequence) -> None:
        """Drop an unfinished sequence, running or waiting."""
        if seq.status is SequenceStatus.RUNNING:
            self.finish(seq, "abort")
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.num_constrained -= seq.grammar is not None

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark a running sequence finished and free its blocks (their full blocks stay cached)."""
        was_running = seq.status is SequenceStatus.RUNNING
        self._left.append(seq)
        self.num_constrained -= seq.grammar is not None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.allocator.free(seq.block_table)
        self.partial_prefills.pop(seq, None)
        if was_running:
            self.running.remove(seq)
        else:  # preempted by a step scheduled ahead (async scheduling) before its last token came
            self.waiting.remove(seq)
