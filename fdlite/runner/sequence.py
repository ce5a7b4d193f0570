"""One sequence being generated: its tokens, how many of them are in the KV cache, its blocks.

A request with `n > 1` becomes n sequences that share the prompt (through the prefix cache, the
children share its KV blocks too). After preemption a sequence keeps its output tokens and
recomputes their KV with the prompt (`num_computed_tokens` back to 0), minus what the prefix cache
still holds of it.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from fdlite.outputs import Logprob
from fdlite.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_index: int
    child_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # 64-bit: the sampler's uniforms are a function of (seed, position) (fdlite/sample/random.py)
    detokenizer: object | None = None  # IncrementalDetokenizer, only for sequences with stop strings
    grammar: object | None = None  # llguidance matcher, only for structured outputs (structured/matcher.py)
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full blocks, filled lazily
    num_hashed_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when first scheduled
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why it finished with "error" (a grammar the output could not follow)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    slot: int | None = None  # row in the persistent batch while running (runner/input_batch.py)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list each step."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
