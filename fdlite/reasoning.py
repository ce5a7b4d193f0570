"""Reasoning parsers: split a thinking model's `<think>...</think>` part from its answer.

The `reasoning_parser` option (FastDeploy's name) picks one; the split lands in
`CompletionOutput.reasoning_content` beside `text`, which keeps the answer only. The behaviour is
vLLM's parsers' for a finished (non-streamed) output:

- `qwen3`: a `<think>` the model wrote is dropped; text before `</think>` is reasoning, after it the
  answer. Without `</think>`: everything is reasoning (the output stopped while thinking), unless a
  tool call (`<tool_call>` then `<function`) begins, which ends the reasoning there.
- `ernie45`: the same split; without `</think>` everything is reasoning. An answer wrapped in
  `<response>...</response>` is unwrapped.

Thinking switched off (`chat_template_kwargs={"enable_thinking": False}`): the chat template closes
the think block in the prompt (Qwen3 writes `<think>\\n\\n</think>\\n\\n` after the assistant tag), so
the output is all answer. As vLLM's serving layer does (`is_reasoning_end` on the prompt), this is
read from the prompt's tokens: the last of `<think>` / `</think>` in the prompt being `</think>` means
reasoning is over before the output starts. That way `LLM.chat`, batch jobs and plain prompts that
embed the template all behave the same, with no per-request flag to carry.
"""

from __future__ import annotations

import re

from fdlite.tokenizer import Tokenizer

_FUNCTION_OPEN = re.compile(r"<function[\s=]")


class ReasoningParser:
    """`<think>` ... `</think>` outputs (the shared part of vLLM's thinking parsers)."""

    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer: Tokenizer):
        self.start_id = tokenizer.token_to_id(self.start_token)
        self.end_id = tokenizer.token_to_id(self.end_token)

    def prompt_ends_reasoning(self, prompt_ids: list[int], prompt_text: str | None = None) -> bool:
        """True when the prompt itself closed the think block (thinking switched off in the template)."""
        if self.start_id is not None and self.end_id is not None:
            for token in reversed(prompt_ids):
                if token == self.start_id:
                    return False
                if token == self.end_id:
                    return True
            return False
        text = prompt_text or ""
        return text.rfind(self.end_token) > text.rfind(self.start_token)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, answer) of a finished output's text; either may be None."""
        before, start, after = text.partition(self.start_token)
        text = after if start else before
        if self.end_token in text:
            reasoning, _, answer = text.partition(self.end_token)
            return reasoning, answer or None
        return self.unterminated(text)

    def unterminated(self, text: str) -> tuple[str | None, str | None]:
        return text, None

    def extract(self, text: str, prompt_ids: list[int], prompt_text: str | None = None) -> tuple[str | None, str]:
        """(reasoning_content, text) for a completion of this prompt: the answer as a string ("" when none)."""
        if self.prompt_ends_reasoning(prompt_ids, prompt_text) and self.end_token not in text:
            return None, text
        reasoning, answer = self.split(text)
        return reasoning, answer or ""


class Qwen3ReasoningParser(ReasoningParser):
    def unterminated(self, text: str) -> tuple[str | None, str | None]:
        call = text.find("<tool_call>")
        if call != -1 and _FUNCTION_OPEN.match(text[call + len("<tool_call>"):].lstrip()):
            return text[:call] or None, text[call:] or None
        return text, None


class Ernie45ReasoningParser(ReasoningParser):
    def split(self, text: str) -> tuple[str | None, str | None]:
        reasoning, answer = super().split(text)
        if answer:
            start, end = answer.find("<response>"), answer.rfind("</response>")
            if start != -1 and end != -1 and start < end:
                answer = answer[start + len("<response>"):end]
        return reasoning, answer or None


PARSERS = {"qwen3": Qwen3ReasoningParser, "ernie45": Ernie45ReasoningParser}


def make_reasoning_parser(name: str | None, tokenizer: Tokenizer | None) -> ReasoningParser | None:
    """The parser called `name` (None: none), or a ValueError naming the choices."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(sorted(PARSERS))} or None, got {name!r}")
    if tokenizer is None:
        raise ValueError("reasoning_parser needs output text; this LLM was built with skip_tokenizer_init=True")
    return PARSERS[name](tokenizer)
