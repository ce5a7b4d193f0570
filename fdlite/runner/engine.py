"""The step loop: schedule, prepare, execute, commit, output (nano-vllm's schedule / run / postprocess).

One step makes one call to each phase of its three collaborators: the scheduler picks rows and says
what changed (`schedule`), the worker applies that to its persistent batch and builds the inputs
(`prepare`), runs the forward and samples (`execute`) and writes the sampled tokens back (`commit`,
which returns the rows that may stop); the output processor turns tokens into what the outputs
need (`process`: logprobs, first-token times, the stop strings found in the text); the scheduler
takes the tokens and finishes the rows that stop (`update_from_output`). Async scheduling is the
same calls in another order: the next step is scheduled while this one executes on a worker
thread (its rows' tokens are placeholders until they come back).

The engine also counts what it computed (`stats()`), and tells each of its `schedule_listeners`
what every step computed (`ScheduledRow`s), so tests can assert the schedule itself (mixed
prefill + decode steps, who joined when) rather than only its outcome.

Debug: `FDLITE_DEBUG_POISON_FREED_BLOCKS=1` fills every block that no one may read (never
written, freed, evicted) with NaN keys and huge values, and checks that every write goes to a
block its sequence holds alone; a stale read then shows in the outputs. For tests; slow.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fdlite import envs
from fdlite.config import EngineConfig
from fdlite.kvcache.block_allocator import BlockAllocator
from fdlite.runner.input_batch import InputBatch, StepInputs, drop_rows
from fdlite.runner.model_runner import ModelRunner
from fdlite.runner.output_processor import OutputProcessor
from fdlite.runner.scheduler import ScheduledBatch, Scheduler
from fdlite.runner.sequence import Sequence
from fdlite.runner.worker import Worker
from fdlite.sample.sampler import SamplerOutput, resolve
from fdlite.structured.matcher import StructuredOutputs
from fdlite.threads import shutdown_pool


@dataclass(frozen=True)
class ScheduledRow:
    """One sequence's part of a step, as a schedule listener sees it."""

    request_index: int
    child_index: int
    num_tokens: int  # tokens computed for it in this step
    joined: bool  # it was waiting before this step: a new sequence, or one back after preemption
    decode: bool  # one token after its last sampled one (else a prompt chunk or a recompute)


def _is_decode(seq: Sequence, n: int) -> bool:
    """A one-token step right after the sequence's last sampled token (read just after scheduling)."""
    return n == 1 and seq.num_tokens == seq.num_computed_tokens + 1 and (
        len(seq.output_token_ids) + seq.num_output_placeholders > 1)


class Engine:
    """The step loop over one scheduler (and its block allocator), one worker and one output processor,
    which it owns; it counts the steps and tokens it ran."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, num_blocks: int, eos_token_ids: set[int], tokenizer=None):
        self.config = config
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.allocator = BlockAllocator(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.allocator, eos_token_ids)
        self.debug_poison = envs.FDLITE_DEBUG_POISON_FREED_BLOCKS
        self.worker = Worker(runner, config.max_num_seqs, config.max_model_len, config.block_size, eos_token_ids,
                             check_writable=self.allocator.check_writable if self.debug_poison else None)
        self.outputs = OutputProcessor(tokenizer)
        self.structured = StructuredOutputs(tokenizer, runner.model_config.vocab_size, eos_token_ids)
        self._pending = None  # async scheduling: the step in flight (scheduled, prepared, future)
        self._executor: ThreadPoolExecutor | None = None
        self.num_early_prepares = 0
        # Async scheduling: the step thread hands back sampled ids still on their way to the host, and launches the
        # next step at once; the engine waits for them (`resolve`). One rank only: ranks share ids on the host.
        runner.sampler.defer_host_copy = config.async_scheduling and config.tensor_parallel_size == 1  # async scheduling: steps prepared before the previous one's tokens came
        self.num_steps = 0
        self.num_prefill_tokens = 0  # tokens computed for prompts (and recomputed after preemption)
        self.num_decode_tokens = 0
        # Called after each step is scheduled with its rows, in batch order (for tests and tools).
        self.schedule_listeners: list[Callable[[list[ScheduledRow]], None]] = []
        self._to_poison: list[int] = []  # debug poison: blocks freed since the last forward started
        if self.debug_poison:
            self.allocator.on_release = self._to_poison.extend
            runner.kv_cache.poison_blocks(list(range(num_blocks)))

    @property
    def input_batch(self) -> InputBatch:
        """The worker's persistent batch (read-only use: tests and tools)."""
        return self.worker.input_batch

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
            if not seq.is_finished:
                self.scheduler.abort(seq)
        self.worker.release(seqs)

    def step(self) -> tuple[list[Sequence], int]:
        """Run one step; return (sequences finished in it, tokens computed in it)."""
        if self.config.async_scheduling:
            return self._step_async()
        scheduled = self._schedule()
        if not scheduled.rows:
            raise RuntimeError("scheduler made no progress: a sequence cannot fit the KV cache")
        prepared = self.worker.prepare(scheduled)
        sampled = self._execute(prepared, self._take_poison())
        return self._postprocess(scheduled, prepared, sampled)

    def _take_poison(self) -> list[int]:
        blocks = self._to_poison[:]
        self._to_poison.clear()  # (the same list: the allocator's on_release extends it)
        return blocks

    def _execute(self, prepared: StepInputs, poison: list[int], execute=None) -> SamplerOutput | None:
        """The step's forward, after the debug poison of the blocks freed before it was scheduled: in stream order,
        so a step still running when they were freed (async scheduling) reads them intact, and the step that
        may reuse them writes after the poison. `execute`: the worker's method, looked up on the engine's thread
        when the step was launched (async scheduling), not on the step thread whenever it gets there."""
        if poison:
            self.runner.kv_cache.poison_blocks(poison)
        return (execute or self.worker.execute)(prepared)

    def _postprocess(self, scheduled: ScheduledBatch, prepared: StepInputs, sampled: SamplerOutput | None):
        """After a step's forward: tokens into the slots, text and logprobs, then stops and finishes."""
        sampled = resolve(sampled)  # async scheduling on the GPU: the ids' copy may still be in flight
        if prepared.dropped_rows is not None and sampled is not None:
            prepared, sampled = drop_rows(prepared, sampled, prepared.dropped_rows)
        candidates = self.worker.commit(prepared, sampled)
        now = time.perf_counter()
        stop_strings = self.outputs.process(prepared.sample_seqs, sampled, prepared.sampling, candidates, now)
        tokens = sampled.token_ids if sampled is not None else []
        finished = self.scheduler.update_from_output(scheduled, prepared.sample_seqs, tokens, candidates,
                                                     stop_strings, now)
        self.num_steps += 1
        self.num_decode_tokens += prepared.num_decode_tokens
        self.num_prefill_tokens += prepared.flat.num_tokens - prepared.num_decode_tokens
        return finished, prepared.flat.num_tokens

    def _schedule(self) -> ScheduledBatch:
        """Schedule a step and tell the listeners what it computes."""
        batch = self.scheduler.schedule()
        if self.schedule_listeners and batch.rows:
            joined = set(map(id, batch.joined))
            rows = [ScheduledRow(seq.request_index, seq.child_index, n, id(seq) in joined, _is_decode(seq, n))
                    for seq, n in batch.rows]
            for listener in self.schedule_listeners:
                listener(rows)
        return batch

    # ---- async scheduling -------------------------------------------------------------------

    def _step_async(self) -> tuple[list[Sequence], int]:
        """Schedule and start step N+1 while step N runs (vLLM v1's async scheduling).

        N+1 is scheduled as if every row of N that samples got its token (a placeholder). When it can
        (`_may_prepare_early`) it is prepared and queued on the step thread before N's tokens come back:
        its decode rows read N's tokens on the device (`StepInputs.patch`), so the host work of N's
        results overlaps N+1's forward. Its rows that finish in N still compute their token, which is
        dropped (`_drop_finished`). Otherwise N+1 is prepared once N's tokens are in the slots (the
        scheduler drops the rows that finished in N from it first). Forwards run in order on the step
        thread, so N+1 reads N's KV either way.
        """
        if self._pending is None:
            scheduled = self._schedule()
            if not scheduled.rows:
                raise RuntimeError("scheduler made no progress: a sequence cannot fit the KV cache")
            self._pending = self._launch(scheduled)
        scheduled, prepared, future = self._pending
        self._pending = None
        ahead = self._schedule() if self.scheduler.has_unfinished() else None
        early = ahead is not None and self._may_prepare_early(ahead)
        if early:
            self._pending = self._launch(ahead)
            self.num_early_prepares += self._pending is not None
        result = self._postprocess(scheduled, prepared, future.result())
        if ahead is not None and not early:
            self._pending = self._launch(ahead)
        elif self._pending is not None and result[0]:
            self._pending = self._drop_finished(self._pending, set(result[0]))
        return result

    def _may_prepare_early(self, ahead: ScheduledBatch) -> bool:
        """Whether step N+1 can be prepared before N's tokens are on the host: nothing it prepares reads them.
        Not when it preempts (a slot leaves while N may still write it), nor with a grammar (its bitmask
        follows N's token), bad words (a word's prefix ends the output) or penalty tables kept on the host
        (counted from N's tokens when they come back)."""
        ib = self.worker.input_batch
        if ahead.preempted or self.scheduler.num_constrained or ib.has_bad_words.any():
            return False
        host_penalties = ib.host_penalty_tables
        if host_penalties and ib.has_penalties.any():
            return False
        return not any(s.bad_words_token_ids or (host_penalties and s.params.has_penalties) for s in ahead.joined)

    @staticmethod
    def _drop_finished(pending, gone: set[Sequence]):
        """The step in flight was prepared before some of its sampling rows finished: their tokens are dropped
        when it comes back (its prepared inputs lose those rows; the scheduler dropped them from its batch)."""
        scheduled, prepared, future = pending
        dead = [i for i, s in enumerate(prepared.sample_seqs) if s in gone]
        if dead:
            prepared.dropped_rows = dead if prepared.dropped_rows is None else prepared.dropped_rows + dead
        return scheduled, prepared, future

    def _launch(self, scheduled: ScheduledBatch):
        """Prepare a scheduled step and start it on the step thread; None when it has no rows left."""
        prepared = self.worker.prepare(scheduled)
        if prepared is None:
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="fdlite-step")
        return scheduled, prepared, self._executor.submit(self._execute, prepared, self._take_poison(),
                                                          self.worker.execute)

    def close(self) -> None:
        """Stop the step thread (async scheduling) once the step in flight is done; the model runner is closed by
        its owner (`LLM.close`)."""
        try:
            self.drain()
        except Exception:  # noqa: BLE001 - that step's error went to the caller already; closing goes on
            pass
        executor, self._executor = self._executor, None
        if executor is not None:
            shutdown_pool(executor)
        self.schedule_listeners.clear()

    def drain(self) -> None:
        """Wait for a step still running (async scheduling) and forget it."""
        if self._pending is not None:
            _, _, future = self._pending
            self._pending = None
            self.worker.input_batch.forget_unwritten()  # its tokens are never written
            future.result()
