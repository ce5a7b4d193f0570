"""Text for generated tokens, apart from the step loop: stop strings as tokens arrive, the rest once at the end.

The scheduler checks stops on token ids (EOS, stop ids, lengths); text is needed per token only
for a sequence with stop strings, which gets an `IncrementalDetokenizer`: each step `process` feeds
it the new token and reports the rows whose text completed a stop string, for the scheduler to
finish (vLLM's output processor does the same apart from its core). Every other sequence is decoded once, when it finishes (lazy
detokenization; nano-vllm decodes only at the end too). The final text is the decode of the output
tokens, cut before (or after, with `include_stop_str_in_output`) the stop string that ended it.

`FDLITE_INCREMENTAL_DETOKENIZE=1` gives every sequence a detokenizer fed token by token (for tests
that compare the two ways; outputs are the same).
"""

from __future__ import annotations


from fdlite import envs
from fdlite.detokenizer import IncrementalDetokenizer
from fdlite.outputs import Logprob
from fdlite.runner.sequence import Sequence
from fdlite.sampling_params import SamplingParams


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.incremental = envs.FDLITE_INCREMENTAL_DETOKENIZE
        self._token_text: dict[int, str] = {}

    def new_detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        """A detokenizer for a sequence that needs text as it goes (stop strings), else None."""
        if self.tokenizer is None or not (self.incremental or any(params.stop or ())):
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                                      stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)

    def process(self, seqs: list[Sequence], sampled, sampling, candidates: list[int], now: float) -> dict[int, str]:
        """One step's sampled rows (`seqs`, in logits order), before the scheduler takes their tokens:
        first-token times, the logprobs of the rows that asked, and each watched candidate's new
        text. Returns {row: stop string} for the rows whose text completed one."""
        if sampled is None:
            return {}
        self.record(seqs, sampled, sampling, now)
        stops = {}
        for i in candidates:
            seq = seqs[i]
            if seq.detokenizer is not None:
                # Stop strings count only once min_tokens are out (this token included).
                s = seq.detokenizer.append(sampled.token_ids[i],
                                           check_stop=len(seq.output_token_ids) + 1 >= seq.params.min_tokens)
                if s is not None:
                    stops[i] = s
        return stops

    def text(self, seq: Sequence) -> str:
        """The output text of a finished (or aborted) sequence."""
        if self.tokenizer is None:
            return ""
        detok = seq.detokenizer
        if detok is not None and detok.stop_reason is not None:
            return detok.text
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def record(self, seqs: list[Sequence], sampled, sampling, now: float) -> None:
        """First-token times, and the logprobs of the rows that asked (with their token strings)."""
        for seq in seqs:
            if seq.first_token_time is None:
                seq.first_token_time = now
        for i in (sampling.logprob_rows() if sampling is not None else ()):
            entry = sampled.logprobs[i]
            if entry is None:
                continue
            seq = seqs[i]
            seq.logprobs = seq.logprobs if seq.logprobs is not None else []
            seq.logprobs.append(self.decode_logprobs(entry))
            if sampled.sampled_logprobs[i] is not None:
                seq.cumulative_logprob += sampled.sampled_logprobs[i]

    def decode_logprobs(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        """Fill each entry's `decoded_token` (one tokenizer call per distinct token id, ever)."""
        if self.tokenizer is None:
            return entry
        for tid, lp in entry.items():
            text = self._token_text.get(tid)
            if text is None:
                text = self._token_text[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
            lp.decoded_token = text
        return entry
