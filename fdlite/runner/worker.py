"""The worker: one step on the device as three calls, prepare / execute / commit.

It owns the persistent batch (`InputBatch`: per-slot tokens, blocks and sampling parameters) and the
model runner (model, KV cache, forward buffers, CUDA graphs, sampler). vLLM v1's model runner does
the same: it owns its `InputBatch` and applies the scheduler's output to it itself.

- `prepare(scheduled)`: apply the scheduler's diff (finished and preempted rows leave, grown rows
  append block ids, joined rows take a slot) and build the step's inputs.
- `execute(prepared)`: the forward (eager or graph replay) and the sampler; may run on another
  thread (async scheduling), so it touches no host state the engine's thread reads meanwhile.
- `commit(prepared, sampled)`: the sampled tokens into their slots; returns the rows that may stop.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fdlite.runner.input_batch import InputBatch, StepInputs
from fdlite.runner.model_runner import ModelRunner
from fdlite.runner.scheduler import ScheduledBatch
from fdlite.runner.sequence import Sequence
from fdlite.sample.sampler import SamplerOutput


class Worker:
    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_model_len: int, block_size: int,
                 eos_token_ids: set[int], check_writable: Callable[[list[int], int, int], None] | None = None):
        self.runner = runner
        self.vocab_size = runner.model_config.vocab_size
        self.input_batch = InputBatch(max_num_seqs, max_model_len, block_size, self.vocab_size, eos_token_ids,
                                      host_penalty_tables=runner.device != "gpu")
        runner.eos_token_ids = sorted(eos_token_ids)  # what a grammar row may end with
        self.check_writable = check_writable  # debug: every KV write goes to a block its row holds alone

    def prepare(self, scheduled: ScheduledBatch) -> StepInputs | None:
        """Apply `scheduled`'s diff to the persistent batch; the step's inputs (None: no rows)."""
        ib = self.input_batch
        self.release(scheduled.finished)
        self.release(scheduled.preempted)
        for seq in scheduled.grown:
            ib.sync_blocks(seq)
        for seq in scheduled.joined:
            ib.add(seq)
        if not scheduled.rows:
            return None
        if self.check_writable is not None:
            for seq, n in scheduled.rows:
                self.check_writable(seq.block_table, seq.num_computed_tokens - n, seq.num_computed_tokens)
        return ib.prepare_inputs(scheduled.rows, scheduled.num_decodes)

    def execute(self, prepared: StepInputs) -> SamplerOutput | None:
        """Forward and sample (None when no row samples)."""
        return self.runner.execute(prepared)

    def commit(self, prepared: StepInputs, sampled: SamplerOutput | None) -> list[int]:
        """Write the sampled tokens into their slots; the rows (indices into the sampled rows) that may stop."""
        if sampled is None:
            return []
        tokens = np.asarray(sampled.token_ids, np.int64)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            bad = int(tokens[(tokens < 0) | (tokens >= self.vocab_size)][0])
            raise RuntimeError(f"the sampler returned token id {bad}, outside the vocabulary [0, {self.vocab_size}); "
                               "the logits or the sampling op are broken")
        return self.input_batch.write_tokens(prepared, tokens).tolist()

    def release(self, seqs: list[Sequence]) -> None:
        """Free the slots of sequences that left (a sequence without one is skipped)."""
        for seq in seqs:
            self.input_batch.remove(seq)
