"""The progress bar over requests, with live input and output tokens/s (vLLM's wording)."""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm


class Progress:
    def __init__(self, total: int, enabled: bool = True, desc: str = "Processed prompts", initial: int = 0):
        # `initial`: requests already done before this bar started (a resumed job), so done/total and
        # the ETA describe the whole job while tokens/s only counts this process's work.
        self.start = time.perf_counter()
        self.input_tokens = 0
        self.output_tokens = 0
        self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, disable=not enabled,
                        postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")

    def add_tokens(self, input_tokens: int, output_tokens: int) -> None:
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens

    def request_done(self, prompt_tokens: int) -> None:
        self.input_tokens += prompt_tokens
        dt = max(time.perf_counter() - self.start, 1e-9)
        self.bar.postfix = (f"est. speed input: {self.input_tokens / dt:.2f} toks/s, "
                            f"output: {self.output_tokens / dt:.2f} toks/s")
        self.bar.update(1)

    def write(self, message: str) -> None:
        """Print a line to stderr without breaking the bar."""
        self.bar.write(message, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
