"""The step loop: schedule, update the persistent batch, run the model, take the sampled tokens, stop, free.

One step: the scheduler picks rows (continuing sequences first, then joiners); the persistent
batch (`InputBatch`) is updated with what changed (joined, preempted, new blocks) and builds the
flat inputs; the runner runs the forward and samples; the sampled ids are appended and checked
for stops on token ids (`check_stop`, only for the rows that may stop); text is the output
processor's business. After each step the blocks that became full are offered to the prefix
cache, before any finished sequence lets go of them. The engine also counts what it computed
(`stats()`).

Debug: `FDLITE_DEBUG_POISON_FREED_BLOCKS=1` fills every block that no one may read (never
written, freed, evicted) with NaN keys and huge values, and checks that every write goes to a
block its sequence holds alone; a stale read then shows in the outputs. For tests; slow.
"""

from __future__ import annotations

import os
import time

import numpy as np

from fdlite.config import EngineConfig
from fdlite.kvcache.block_allocator import BlockAllocator
from fdlite.ops.sampler import SamplerOutput
from fdlite.runner.input_batch import InputBatch, StepInputs
from fdlite.runner.model_runner import ModelRunner
from fdlite.runner.output_processor import OutputProcessor
from fdlite.runner.scheduler import Scheduler
from fdlite.runner.sequence import Sequence


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
        self.num_steps = 0
        self.num_prefill_tokens = 0  # tokens computed for prompts (and recomputed after preemption)
        self.num_decode_tokens = 0
        self.debug_poison = os.environ.get("FDLITE_DEBUG_POISON_FREED_BLOCKS", "0") not in ("", "0")
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
        }

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, seqs: list[Sequence]) -> None:
        """Drop unfinished sequences (the caller stopped iterating): free their blocks and slots."""
        for seq in seqs:
            if seq.is_finished:
                continue
            if seq.slot is not None:
                self.input_batch.remove(seq)
            self.scheduler.abort(seq)

    def step(self) -> tuple[list[Sequence], int]:
        """Run one step; return (sequences finished in it, tokens computed in it)."""
        batch = self.scheduler.schedule()
        if not batch.rows:
            raise RuntimeError("scheduler made no progress: a sequence cannot fit the KV cache")
        ib = self.input_batch
        for seq in batch.preempted:
            if seq.slot is not None:
                ib.remove(seq)
        for seq in batch.grown:
            ib.sync_blocks(seq)
        for seq in batch.joined:
            ib.add(seq)
        step = ib.prepare_inputs(batch.rows)
        self._count_tokens(step)
        sampled = self.runner.execute(step)
        self.num_steps += 1
        ib.advance(step)
        self.scheduler.update_after_step(batch.rows)
        if sampled is None:
            return [], step.flat.num_tokens
        return self._take_tokens(step, sampled), step.flat.num_tokens

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

    def _take_tokens(self, step: StepInputs, sampled: SamplerOutput) -> list[Sequence]:
        """Append the sampled tokens, fill logprobs, and finish the sequences that stop."""
        tokens = np.asarray(sampled.token_ids, np.int64)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            bad = int(tokens[(tokens < 0) | (tokens >= self.vocab_size)][0])
            raise RuntimeError(f"step {self.num_steps}: the sampler returned token id {bad}, outside the vocabulary "
                               f"[0, {self.vocab_size}); the logits or the sampling op are broken")
        ib = self.input_batch
        ib.append_tokens(step.sample_slots, tokens)
        candidates = ib.stop_candidates(step.sample_slots, tokens, self.config.max_model_len)
        now = time.perf_counter()
        finished = self.scheduler.update_from_output(step.sample_seqs, sampled.token_ids, candidates.tolist(),
                                                     self.outputs, self.eos_token_ids, now)
        self.outputs.record(step.sample_seqs, sampled, step.sampling, now)
        for seq in finished:
            ib.remove(seq)
        return finished
