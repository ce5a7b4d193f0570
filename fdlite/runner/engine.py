"""The step loop: schedule, update the persistent batch, run the model, take the sampled tokens, stop, free.

One step: the scheduler picks rows (continuing sequences first, then joiners); the persistent
batch (`InputBatch`) is updated with what changed (joined, preempted, new blocks) and builds the
flat inputs; the runner runs the forward and samples; the sampled ids are appended and checked
for stops on token ids (`check_stop`, only for the rows that may stop); text is the output
processor's business. After each step the blocks that became full are offered to the prefix
cache, before any finished sequence lets go of them. The engine also counts what it computed
(`stats()`), and tells each of its
`schedule_listeners` what every step computed (`ScheduledRow`s), so tests can assert the schedule
itself (mixed prefill + decode steps, who joined when) rather than only its outcome.

Debug: `FDLITE_DEBUG_POISON_FREED_BLOCKS=1` fills every block that no one may read (never
written, freed, evicted) with NaN keys and huge values, and checks that every write goes to a
block its sequence holds alone; a stale read then shows in the outputs. For tests; slow.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from fdlite import envs
from fdlite.config import EngineConfig
from fdlite.kvcache.block_allocator import BlockAllocator
from fdlite.sample.sampler import SamplerOutput
from fdlite.runner.input_batch import InputBatch, StepInputs
from fdlite.runner.model_runner import ModelRunner
from fdlite.runner.output_processor import OutputProcessor
from fdlite.runner.scheduler import ScheduledBatch, Scheduler
from fdlite.runner.sequence import Sequence
from fdlite.structured.matcher import StructuredOutputs


@dataclass(frozen=True)
class ScheduledRow:
    """One sequence's part of a step, as a schedule listener sees it."""

    request_index: int
    child_index: int
    num_tokens: int  # tokens computed for it in this step
    joined: bool  # it was waiting before this step: a new sequence, or one back after preemption
    decode: bool  # one token after its last sampled one (else a prompt chunk or a recompute)


def _is_decode(seq: Sequence, n: int) -> bool:
    return n == 1 and bool(seq.output_token_ids) and seq.num_computed_tokens == seq.num_tokens - 1


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner, num_blocks: int, eos_token_ids: set[int], tokenizer=None):
        self.config = config
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.vocab_size = runner.model_config.vocab_size
        self.allocator = BlockAllocator(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.allocator)
        self.input_batch = InputBatch(config.max_num_seqs, config.max_model_len, config.block_size, self.vocab_size,
                                      eos_token_ids)
        self.outputs = OutputProcessor(tokenizer)
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, eos_token_ids)
        runner.eos_token_ids = sorted(eos_token_ids)
        self._pending = None  # async scheduling: the step in flight (batch, inputs, future)
        self._executor: ThreadPoolExecutor | None = None
        self.num_steps = 0
        self.num_prefill_tokens = 0  # tokens computed for prompts (and recomputed after preemption)
        self.num_decode_tokens = 0
        # Called after each step is scheduled with its rows, in batch order (for tests and tools).
        self.schedule_listeners: list[Callable[[list[ScheduledRow]], None]] = []
        self.debug_poison = envs.FDLITE_DEBUG_POISON_FREED_BLOCKS
        if self.debug_poison:
            self.allocator.on_release = runner.kv_cache.poison_blocks
            runner.kv_cache.poison_blocks(list(range(num_blocks)))

    def stats(self) -> dict[str, int]:
        """Counters since the engine started (`LLM.last_generate_stats` takes differences)."""
        cache = self.allocator.prefix_cache
        return {
            "num_steps": self.num_steps,
            "prefill_tokens_computed": self.num_prefill_tokens,
            "decode_tokens_computed": self.num_decode_tokens,
            "prefix_cache_queried_tokens": cache.queried_tokens if cache else 0,
            "prefix_cache_hit_tokens": cache.hit_tokens if cache else 0,
            "prefix_cache_evicted_blocks": cache.num_evictions if cache else 0,
            "num_preemptions": self.scheduler.num_preemptions,
            **self.runner.forward_stats(),
        }

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, seqs: list[Sequence]) -> None:
        """Drop unfinished sequences (the caller stopped iterating): free their blocks and slots."""
        self.drain()
        for seq in seqs:
            if seq.is_finished:
                continue
            if seq.slot is not None:
                self.input_batch.remove(seq)
            self.scheduler.abort(seq)

    def step(self) -> tuple[list[Sequence], int]:
        """Run one step; return (sequences finished in it, tokens computed in it)."""
        if self.config.async_scheduling:
            return self._step_async()
        batch, step = self._schedule()
        if batch is None:
            raise RuntimeError("scheduler made no progress: a sequence cannot fit the KV cache")
        sampled = self.runner.execute(step)
        self._computed(batch, step)
        finished = self._take_tokens(step, sampled) if sampled is not None else []
        return finished, step.flat.num_tokens

    def _schedule(self) -> tuple[ScheduledBatch | None, StepInputs | None]:
        """Schedule a step and bring the persistent batch up to date with it; (None, None) if nothing runs."""
        batch = self.scheduler.schedule()
        if not batch.rows:
            return None, None
        if self.schedule_listeners:
            joined = set(map(id, batch.joined))
            rows = [ScheduledRow(seq.request_index, seq.child_index, n, id(seq) in joined, _is_decode(seq, n))
                    for seq, n in batch.rows]
            for listener in self.schedule_listeners:
                listener(rows)
        ib = self.input_batch
        for seq in batch.preempted:
            if seq.slot is not None:
                ib.remove(seq)
        for seq in batch.grown:
            ib.sync_blocks(seq)
        for seq in batch.joined:
            ib.add(seq)
        return batch, ib.prepare_inputs(batch.rows)

    def _computed(self, batch: ScheduledBatch, step: StepInputs) -> None:
        """The step's tokens are in the KV cache (or will be, before any later step reads them)."""
        self._count_tokens(step)
        self.num_steps += 1
        self.input_batch.advance(step)
        self.scheduler.update_after_step(batch.rows)

    # ---- async scheduling -------------------------------------------------------------------

    def _step_async(self) -> tuple[list[Sequence], int]:
        """Schedule and prepare step N+1 while step N runs (vLLM's async scheduling).

        Step N+1 is scheduled as if every row of N that samples got its token (a placeholder), so
        it also holds the rows that turn out to finish in N: they are dropped from it (its inputs
        rebuilt) before it is launched. The placeholders' values are patched into N+1's inputs when
        N's tokens come. Forwards stay in order: N+1 is launched only after N is done.
        """
        if self._pending is None:
            batch, step = self._schedule()
            if batch is None:
                raise RuntimeError("scheduler made no progress: a sequence cannot fit the KV cache")
            self._pending = (batch, step, self._launch(step))
        batch, step, future = self._pending
        self._pending = None
        self._computed(batch, step)
        self.scheduler.reserve_tokens(step.sample_seqs)
        self.input_batch.reserve_tokens(step.sample_slots)
        next_batch, next_step = self._schedule() if self.scheduler.has_unfinished() else (None, None)
        sampled = future.result()
        finished = self._take_tokens(step, sampled, reserved=True) if sampled is not None else []
        if next_batch is not None:
            next_step = self._reconcile(next_batch, next_step, finished)
            if next_step is not None:
                self._pending = (next_batch, next_step, self._launch(next_step))
        return finished, step.flat.num_tokens

    def _launch(self, step: StepInputs):
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="fdlite-step")
        return self._executor.submit(self.runner.execute, step)

    def _reconcile(self, batch: ScheduledBatch, step: StepInputs, finished: list[Sequence]) -> StepInputs | None:
        """Step N+1's inputs once step N's tokens are known: without the rows that finished, with
        the real tokens where placeholders were."""
        if finished:
            gone = set(map(id, finished))
            batch.rows = [(s, n) for s, n in batch.rows if id(s) not in gone]
            if not batch.rows:
                return None
            return self.input_batch.prepare_inputs(batch.rows)
        return self.input_batch.refresh_tokens(step)

    def drain(self) -> None:
        """Wait for a step still running (async scheduling) and forget it."""
        if self._pending is not None:
            _, _, future = self._pending
            self._pending = None
            future.result()

    def _advance_grammars(self, step: StepInputs, tokens: list[int], now: float) -> list[Sequence]:
        """Feed each constrained row's token to its matcher; a row whose matcher rejects it (the grammar
        hit a backend limit) finishes with "error". Returns those rows."""
        failed = []
        for i in step.sampling.grammar_rows.tolist():
            seq = step.sample_seqs[i]
            if seq.is_finished:
                continue
            if not seq.grammar.consume_token(tokens[i]):
                seq.error = f"structured_outputs: the grammar matcher failed: {seq.grammar.get_error().strip()}"
                seq.finish_time = now
                self.scheduler.finish(seq, "error")
                failed.append(seq)
        return failed

    def _count_tokens(self, step: StepInputs) -> None:
        ib = self.input_batch
        if self.debug_poison:
            for seq, n in zip((ib.seqs[s] for s in step.slots.tolist()), step.counts.tolist()):
                self.allocator.check_writable(seq.block_table, seq.num_computed_tokens, seq.num_computed_tokens + n)
        s = step.slots
        # A decode: one token, the sequence's newest, after at least one output token.
        decode = (step.counts == 1) & (ib.num_tokens[s] > ib.num_prompt[s]) & (ib.num_computed[s] == ib.num_tokens[s] - 1)
        n_decode = int(decode.sum())
        self.num_decode_tokens += n_decode
        self.num_prefill_tokens += step.flat.num_tokens - n_decode

    def _take_tokens(self, step: StepInputs, sampled: SamplerOutput, reserved: bool = False) -> list[Sequence]:
        """Append the sampled tokens, fill logprobs, and finish the sequences that stop."""
        tokens = np.asarray(sampled.token_ids, np.int64)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            bad = int(tokens[(tokens < 0) | (tokens >= self.vocab_size)][0])
            raise RuntimeError(f"step {self.num_steps}: the sampler returned token id {bad}, outside the vocabulary "
                               f"[0, {self.vocab_size}); the logits or the sampling op are broken")
        ib = self.input_batch
        if reserved:  # only rows that still hold their slot (not preempted by the step scheduled ahead)
            held = np.fromiter((s.slot is not None for s in step.sample_seqs), bool, len(tokens))
            ib.write_tokens(step.sample_slots[held], tokens[held])
            # A row whose slot went to another sequence meanwhile is checked in full.
            kept = np.nonzero(held)[0]
            candidates = np.union1d(kept[ib.stop_candidates(step.sample_slots[kept], tokens[kept],
                                                            self.config.max_model_len)], np.nonzero(~held)[0])
        else:
            ib.append_tokens(step.sample_slots, tokens)
            candidates = ib.stop_candidates(step.sample_slots, tokens, self.config.max_model_len)
        now = time.perf_counter()
        finished = self.scheduler.update_from_output(step.sample_seqs, sampled.token_ids, candidates.tolist(),
                                                     self.outputs, self.eos_token_ids, now, reserved)
        self.outputs.record(step.sample_seqs, sampled, step.sampling, now)
        if step.sampling is not None and step.sampling.grammar_rows is not None:
            finished += self._advance_grammars(step, sampled.token_ids, now)
        for seq in finished:
            if seq.slot is not None:
                ib.remove(seq)
        return finished
