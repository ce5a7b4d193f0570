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
from fdlite.runner.sequence import Sequence
from fdlite.sample.logprobs import LogprobsList, LogprobsTensors
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
        if sampled.prompt_logprobs:
            self.record_prompt_logprobs(sampled.prompt_logprobs)
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
        """First-token times, and the logprobs of the rows that asked (their arrays, read as dicts later)."""
        for seq in seqs:
            if seq.first_token_time is None:
                seq.first_token_time = now
        tensors = sampled.logprobs_tensors
        if tensors is None:
            return
        for j, (i, num, lp) in enumerate(zip(sampled.logprob_rows.tolist(), sampled.num_logprobs.tolist(),
                                             tensors.logprobs.tolist())):
            seq = seqs[i]
            if seq.logprobs is None:
                seq.logprobs = LogprobsList(self.decode_token)
            seq.logprobs.append(tensors, j, num)
            seq.cumulative_logprob += lp

    def record_prompt_logprobs(self, prompt_logprobs: list[tuple[Sequence, LogprobsTensors]]) -> None:
        """Prompt logprobs computed this step, in prompt order per sequence (`prompt_logprobs`)."""
        for seq, tensors in prompt_logprobs:
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = LogprobsList(self.decode_token, leading_none=True)
            seq.prompt_logprobs.extend_rows(tensors, seq.params.prompt_logprobs)

    def decode_token(self, token_id: int) -> str | None:
        """One token's text for a `Logprob` (one tokenizer call per distinct id, ever; None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text
