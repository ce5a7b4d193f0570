"""The step loop: schedule, run the model, sample, detokenize, check stops, free finished blocks.

After each step the blocks that became full are offered to the prefix cache, before any finished
sequence lets go of them. The engine also counts what it computed (`stats()`), and tells each of its
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
from dataclasses import dataclass

from fdlite.config import EngineConfig
from fdlite.kvcache.block_allocator import BlockAllocator
from fdlite.runner.model_runner import ModelRunner
from fdlite.runner.scheduler import Scheduler
from fdlite.runner.sequence import Sequence
from fdlite.runner.stop_checker import check_stop


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
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.allocator = BlockAllocator(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.allocator)
        self.num_steps = 0
        self.num_prefill_tokens = 0  # tokens computed for prompts (and recomputed after preemption)
        self.num_decode_tokens = 0
        # Called after each step is scheduled with its rows, in batch order (for tests and tools).
        self.schedule_listeners: list[Callable[[list[ScheduledRow]], None]] = []
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
            **self.runner.forward_stats(),
        }

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> tuple[list[Sequence], int]:
        """Run one step; return (sequences finished in it, tokens computed in it)."""
        running_before = set(self.scheduler.running) if self.schedule_listeners else None
        batch = self.scheduler.schedule()
        if not batch.rows:
            raise RuntimeError("scheduler made no progress: a sequence cannot fit the KV cache")
        if running_before is not None:
            rows = [ScheduledRow(seq.request_index, seq.child_index, n, seq not in running_before, _is_decode(seq, n))
                    for seq, n in batch.rows]
            for listener in self.schedule_listeners:
                listener(rows)
        for seq, n in batch.rows:
            if _is_decode(seq, n):
                self.num_decode_tokens += 1
            else:
                self.num_prefill_tokens += n
            if self.debug_poison:
                self.allocator.check_writable(seq.block_table, seq.num_computed_tokens, seq.num_computed_tokens + n)
        result = self.runner.execute(batch.rows, self.eos_token_ids)
        self.num_steps += 1
        for seq, n in batch.rows:
            seq.num_computed_tokens += n
            self.allocator.cache_full_blocks(seq)
        finished = []
        if result.sampled is None:
            return finished, batch.num_tokens
        now = time.perf_counter()
        out = result.sampled
        for i, seq in enumerate(result.inputs.sample_seqs):
            token = out.token_ids[i]
            seq.output_token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.cumulative_logprob += out.sampled_logprobs[i]
            if seq.params.logprobs is not None:
                seq.logprobs = seq.logprobs if seq.logprobs is not None else []
                entry = out.logprobs[i]
                if self.tokenizer is not None:
                    for tid, lp in entry.items():
                        lp.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)
                seq.logprobs.append(entry)
            stop_str = None
            if seq.detokenizer is not None:
                # Stop strings count only once min_tokens are out (the token just appended included).
                stop_str = seq.detokenizer.append(token, check_stop=len(seq.output_token_ids) >= seq.params.min_tokens)
            stop = check_stop(seq, token, stop_str, self.eos_token_ids, self.config.max_model_len)
            if stop is not None:
                seq.finish_time = now
                self.scheduler.finish(seq, *stop)
                finished.append(seq)
        return finished, batch.num_tokens
