"""The tokenizer-bound side of structured outputs: matchers per sequence, and each step's token bitmask.

One `LLMatcher` is compiled per distinct constraint (by content, `StructuredOutputsParams.key`) and kept
as a template; each sequence gets a copy (microseconds), which advances as the sequence's tokens are
accepted. A preempted sequence keeps its output tokens, so its matcher stays where it was; nothing is
rolled back.

Per step, `BitmaskFiller.start` computes the allowed-token bitmask of the constrained rows in a worker
thread while the forward runs (llguidance drops the GIL and spreads the rows over its own threads); the
sampler waits for it only when it needs the mask (vLLM computes its bitmask on the scheduler side for
the same overlap). Rows without a constraint are not in the mask at all.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from fdlite.structured.grammar import compile_grammar
from fdlite.threads import shutdown_pool

logger = logging.getLogger("fdlite")


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (bit j of word i: token 32 i + j is allowed)."""
    return (vocab_size + 31) // 32


class StructuredOutputs:
    """Matchers for one engine's requests: the llguidance tokenizer (built on first use, about 2 s for a
    150k vocabulary) and a compiled template per distinct constraint.

    Methods take a request's `SamplingParams` (only its `structured_outputs` is read); it is not imported
    here because `sampling_params` validates constraints with `structured.grammar`."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._ll_tokenizer = None
        self._templates: dict[str, object] = {}
        self.num_compiled = 0  # distinct constraints compiled (tests check the cache)

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance  # noqa: PLC0415

            t0 = time.perf_counter()
            # From the tokenizer's own JSON (tokens added from tokenizer_config.json included); the mask
            # covers the model's whole vocabulary, so rows past the tokenizer's are never allowed.
            self._ll_tokenizer = llguidance.LLTokenizer(
                self.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=sorted(self.eos_token_ids))
            logger.info("structured outputs: tokenizer ready in %.2f s", time.perf_counter() - t0)
        return self._ll_tokenizer

    def _template(self, params):
        so = params.structured_outputs
        template = self._templates.get(so.key)
        if template is None:
            import llguidance  # noqa: PLC0415

            template = llguidance.LLMatcher(self._tokenizer(), compile_grammar(so.key), log_level=0)
            if template.is_error():
                raise ValueError(f"structured_outputs.{so.kind}: {template.get_error().strip()}")
            self._templates[so.key] = template
            self.num_compiled += 1
        return template

    def problem(self, params) -> str | None:
        """Why a request with this constraint cannot run here (None if it can); compiles it once."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            return "structured_outputs need a tokenizer; this LLM was built with skip_tokenizer_init=True"
        try:
            self._template(params)
        except ValueError as e:
            return str(e)
        return None

    def new_matcher(self, params):
        """A fresh matcher for one sequence (None for an unconstrained request)."""
        if params.structured_outputs is None:
            return None
        return self._template(params).deep_copy()


class BitmaskFiller:
    """Computes the token bitmask of a step's constrained rows, off the calling thread."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self._pool: ThreadPoolExecutor | None = None
        self._executor = None
        self.last_fill_s = 0.0  # time of the latest fill (benchmarks)

    def start(self, matchers: list, eos_token_ids: list[int]) -> Future:
        """Begin filling `[len(matchers), width]` int32; the future's result is the bitmask."""
        if self._pool is None:
            import llguidance  # noqa: PLC0415

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fdlite-grammar")
            self._executor = llguidance.LLExecutor()
        return self._pool.submit(self.fill, matchers, eos_token_ids)

    def close(self) -> None:
        """Stop the fill thread (the engine is closing)."""
        pool, self._pool, self._executor = self._pool, None, None
        if pool is not None:
            shutdown_pool(pool)

    def fill(self, matchers: list, eos_token_ids: list[int]) -> np.ndarray:
        t0 = time.perf_counter()
        mask = np.zeros((len(matchers), self.width), np.int32)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.ctypes.data,
                                               self.width * 4, len(matchers))
        # A matcher in an error state allows nothing; let it end (the engine then fails that request) rather
        # than hand the sampler a row with no token left.
        empty = np.nonzero(~mask.any(axis=1))[0]
        for e in eos_token_ids:
            if 0 <= e < self.vocab_size:
                mask[empty, e // 32] |= np.int32(np.uint32(1 << (e % 32)).view(np.int32))
        self.last_fill_s = time.perf_counter() - t0
        return mask
