"""What `LLM.generate` returns: vLLM's `RequestOutput` / `CompletionOutput` / `Logprob` names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token, its rank in the distribution (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-k). fdlite hands out a
# `fdlite.sample.logprobs.LogprobsList`, which reads (and pickles) as this list.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "error", or None while unfinished
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    # With a `reasoning_parser`: the <think> part of the output (None when there was none); `text` is the rest.
    reasoning_content: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Result of one prompt. `error` is set (and `outputs` empty of text) when the request failed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (vLLM's PromptLogprobs).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = False
    error: str | None = None
    metrics: dict | None = None
