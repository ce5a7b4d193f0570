"""One sequence being generated: its tokens, how many of them are in the KV cache, its blocks.

A request with `n > 1` becomes n sequences that share the prompt (through the prefix cache, the
children share its KV blocks too). After preemption a sequence keeps its output tokens and
recomputes their KV with the prompt (`num_computed_tokens` back to 0), minus what the prefix cache
still holds of it.

Who writes what: the scheduler (with its block allocator) owns the record: status, tokens
(`output_token_ids`, `num_output_placeholders`), `num_computed_tokens`, `block_table` and the
prefix-cache hashes, and finishes the sequence. The output processor writes what only the outputs
read (`first_token_time`, `logprobs`, `cumulative_logprob`, the detokenizer's state). The worker's
persistent batch keeps a device-input copy of a running sequence's tokens and blocks, written from
the scheduler's diffs (`runner/input_batch.py`); it writes nothing here.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from fdlite.sampling_params import SamplingParams

if TYPE_CHECKING:
    from fdlite.sample.logprobs import LogprobsList


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
    bad_words_token_ids: list[list[int]] | None = None  # params.bad_words tokenized (each with and without a space)
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens scheduled to be sampled whose values have not come back yet (vLLM's
    # `num_output_placeholders`): `schedule()` adds one for each row that samples, `update_from_output`
    # turns it into a token. Under async scheduling a row can have two (this step's and the next's).
    num_output_placeholders: int = 0
    num_computed_tokens: int = 0  # tokens whose KV is in the cache once the steps scheduled so far ran
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full blocks, filled lazily
    num_hashed_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when first scheduled
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why it finished with "error" (a grammar the output could not follow)
    logprobs: LogprobsList | None = None  # read as a list of dicts (token id -> Logprob)
    prompt_logprobs: LogprobsList | None = None  # the same, one per prompt token, the first None
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are computed by a request's first sequence (its `n > 1` siblings share the prompt)."""
        return self.params.prompt_logprobs is not None and self.child_index == 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, placeholders included: what the scheduler schedules against."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def num_known_tokens(self) -> int:
        """Prompt + output tokens whose values are known (what hashing and stop checks read)."""
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
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
