"""Turn generated token ids into text one token at a time, and spot stop strings as they appear.

Why hand-written: decoding each new token on its own is wrong in two ways. Byte-level BPE splits one UTF-8
character (Chinese, emoji) over several tokens, so a lone token decodes to "\\ufffd"; and SentencePiece-style
decoders drop or add a leading space depending on what comes before. vLLM solves this by decoding a small
window of ids twice, with and without the new token, and emitting only the difference once it no longer ends
in "\\ufffd". The same algorithm is re-done here over `fdlite.tokenizer.Tokenizer` (ids instead of token
strings, because the `tokenizers` package decodes ids directly), together with the stop-string check, which
has to look a little before the new text since a stop string may span two tokens.
"""

from __future__ import annotations

# How many prompt tokens of context the first decode gets (vLLM uses the same 5 (+2) so that a leading space
# or a half-finished character at the start of the output is decoded as it would be in the full text).
INITIAL_OFFSET = 5


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens, grown with `append(token_id)`.

    `text` is the output so far; once a stop string matched it ends before the stop string (or right after it
    with `include_stop_str_in_output=True`) and later appends are ignored. Without a stop match, after the last
    append `text == tokenizer.decode(appended_ids, skip_special_tokens)` for well-formed UTF-8 output; a
    character still incomplete at the end (e.g. the output was cut at max_tokens inside an emoji) is held back.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""
        self.stop_reason: str | None = None  # the stop string that ended the text, once one matched
        # How far back from the new text a stop string may start: it may have begun in earlier tokens.
        self._stop_lookback = max((len(s) for s in self.stop), default=1) - 1

        # `_ids` is the decode window: the last few prompt ids, then every output id. Text is emitted for
        # `_ids[_read_offset:]`; `_ids[_prefix_offset:_read_offset]` is already-emitted context decoded again
        # so that the boundary (spaces, multi-byte characters) comes out as in the full decode.
        self._ids: list[int] = list(prompt_token_ids[-(INITIAL_OFFSET + 2):])
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - INITIAL_OFFSET, 0)

    @property
    def finished(self) -> bool:
        """True once a stop string matched."""
        return self.stop_reason is not None

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one generated token; return the stop string it completed, else None.

        check_stop=False (while the output is shorter than min_tokens) adds the text without looking
        for stop strings, as vLLM does.
        """
        if self.stop_reason is not None:
            return None  # the sequence already ended; text after the stop string is dropped
        self._ids.append(token_id)
        new_text = self._decode_new_text()
        if not new_text:
            return None
        start = len(self.text)
        self.text += new_text
        return self._check_stop(start) if check_stop else None

    def _decode_new_text(self) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        full_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        # Nothing new yet (a skipped special token), or the last character is still incomplete: wait for more.
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _check_stop(self, new_text_start: int) -> str | None:
        if not self.stop:
            return None
        # Search only the new text plus enough characters before it for a stop string spanning tokens.
        search_from = max(new_text_start - self._stop_lookback, 0)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop_str_in_output else self.text[:i]
        self.stop_reason = s
        return s
