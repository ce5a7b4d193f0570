"""The persistent batch: per-slot arrays of the running sequences, and the flat step inputs built from them.

Each running sequence owns a slot (a row of every array here) from the step it is scheduled until
it finishes or is preempted. What the forward and the sampler need per step is kept in those rows
and changed only where something changed: a joining sequence writes its row once (tokens, block
table, sampling parameters, penalty counts), a grown sequence appends its new block ids, a sampled
token is written into its row. The step's flat inputs (`FlatBatch`) and sampling parameters
(`SamplingBatch`) are then built with vectorised numpy over the scheduled slots, with no per-token
Python and no copy of block tables per token (vLLM v1's persistent `InputBatch`; FastDeploy 2.x's
`worker/gpu/input_batch.py` in Paddle).

Owned by the worker (`runner/worker.py`), which alone calls it. The scheduler's `Sequence`s stay
the record of every sequence; a slot's rows here are the device-input copy of a running one: its
tokens (written when it joins, then one sampled token per step: a position is reserved when the
step is prepared, its value written when the step's tokens come back), its block ids (appended from
the scheduler's diff) and its sampling parameters. How many tokens a sequence has computed is read
from the `Sequence` when a step is prepared, never kept here.

Host only (numpy): the runner copies a `FlatBatch` into its persistent device buffers
(`runner/forward_buffers.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter, itemgetter

import numpy as np

from fdlite.kvcache.block_allocator import blocks_for
from fdlite.layers.forward_meta import FlatBatch, PrefillSpan
from fdlite.sample.logprobs import LogprobsTensors
from fdlite.sample.sampler import SamplerOutput, SamplingBatch, stop_tokens_while_short, token_counts
from fdlite.runner.sequence import Sequence
from fdlite.runner.stop_checker import stop_candidates
from fdlite.structured.matcher import bitmask_width


_first, _second, _computed_of = itemgetter(0), itemgetter(1), attrgetter("num_computed_tokens")


@dataclass
class PromptLogprobsInputs:
    """The prompt positions whose logprobs a step computes: per sequence that asks, in flat-batch order, how many
    targets it has; then for every target its hidden-state row in the flat batch and its token (the next prompt
    token). Each sequence's targets are consecutive prompt positions after those it has recorded."""

    seqs: list[Sequence]
    counts: list[int]
    token_indices: np.ndarray  # [T] int64
    targets: np.ndarray  # [T] int64
    k: int  # the largest prompt_logprobs asked


@dataclass
class TokenPatch:
    """Input tokens of a step prepared before the previous step's sampled tokens reached the host (async
    scheduling): flat token `dst[i]` is the previous step's sampled token of its sample row `src[i]`. The
    runner applies it on the device after writing the inputs (`ForwardBuffers`), from the sampled ids the
    previous step left there; `prev_step` is that step's `StepInputs.step_id`."""

    dst: np.ndarray  # [P] int64 flat token indices, ascending
    src: np.ndarray  # [P] int64 rows of the previous step's sampled ids
    prev_step: int


@dataclass
class StepInputs:
    """What `InputBatch.prepare_inputs` hands the runner and the engine for one step."""

    flat: FlatBatch
    slots: np.ndarray  # [rows] slot of each row, in flat-batch order
    counts: np.ndarray  # [rows] tokens computed this step
    sample_seqs: list[Sequence]  # the rows that sample a token this step, in logits order
    sample_slots: np.ndarray  # their slots
    sample_positions: np.ndarray  # where each sampled token goes in its slot's token row
    sampling: SamplingBatch | None  # None when no row samples
    num_decode_tokens: int = 0  # rows that compute one token after their last sampled one
    prompt_logprobs: PromptLogprobsInputs | None = None  # prompt positions whose logprobs this step computes
    step_id: int = 0  # counts the steps prepared
    patch: TokenPatch | None = None  # input tokens still on the device (the previous step's samples)
    # Sample rows whose sequence finished before this step's tokens came back (it was prepared early, async
    # scheduling): their tokens are dropped (`drop_rows`).
    dropped_rows: list[int] | None = None


def drop_rows(step: StepInputs, sampled: SamplerOutput, rows: list[int]) -> tuple[StepInputs, SamplerOutput]:
    """`step` and its `sampled` output without the sample rows `rows`: what the engine commits and reports."""
    keep = np.ones(len(step.sample_seqs), bool)
    keep[rows] = False
    idx = np.flatnonzero(keep)
    step = replace(step, sample_seqs=[step.sample_seqs[i] for i in idx.tolist()],
                   sample_slots=step.sample_slots[idx], sample_positions=step.sample_positions[idx],
                   dropped_rows=None)
    out = replace(sampled, token_ids=[sampled.token_ids[i] for i in idx.tolist()], device_tokens=None)
    if sampled.logprobs_tensors is not None:
        new_row = np.cumsum(keep) - 1
        kept = keep[sampled.logprob_rows]
        t = sampled.logprobs_tensors
        out.logprobs_tensors = None
        out.logprob_rows = out.num_logprobs = None
        if kept.any():
            out.logprobs_tensors = LogprobsTensors(t.token_ids[kept], t.logprobs[kept], t.ranks[kept],
                                                   t.top_ids[kept], t.top_logprobs[kept])
            out.logprob_rows = new_row[sampled.logprob_rows[kept]]
            out.num_logprobs = sampled.num_logprobs[kept]
    return step, out


def flat_batch(token_ids: np.ndarray, rows: np.ndarray, computed: np.ndarray, counts: np.ndarray,
               tables: np.ndarray, block_size: int, samples: np.ndarray) -> FlatBatch:
    """The flat batch of rows (decodes first), vectorised.

    token_ids [R, L] tokens per row slot; rows [B] slots in batch order; computed / counts [B]
    tokens already in the cache / computed this step; tables [R, W] block ids; samples [B] bool:
    whether the row's last token samples.
    """
    b = len(rows)
    if b and (counts == 1).all():
        return _decode_batch(token_ids, rows, computed, tables, block_size, samples)
    cu = np.zeros(b + 1, np.int32)
    np.cumsum(counts, out=cu[1:])
    t = int(cu[-1])
    token_rows = np.repeat(np.arange(b, dtype=np.int64), counts)
    pos = np.arange(t, dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64) - computed, counts)
    slot_of_token = rows[token_rows]
    width = int(blocks_for(int((computed + counts).max()), block_size)) if b else 1
    batch_tables = tables[rows, :width]
    blocks = batch_tables[token_rows, pos // block_size].astype(np.int64)
    seq_lens = (computed + counts).astype(np.int32)
    num_decodes = int(np.argmax(counts != 1)) if (counts != 1).any() else b
    prefills = [PrefillSpan(row=r, token_start=int(cu[r]), q_len=int(counts[r]), kv_len=int(seq_lens[r]))
                for r in range(num_decodes, b)]
    return FlatBatch(
        input_ids=token_ids[slot_of_token, pos].astype(np.int64),
        positions=pos,
        slot_mapping=blocks * block_size + pos % block_size,
        token_rows=token_rows,
        block_tables=np.ascontiguousarray(batch_tables),
        seq_lens_kv=seq_lens,
        cu_seqlens_q=cu,
        logits_indices=(cu[1:][samples] - 1).astype(np.int64),
        num_decodes=num_decodes,
        prefills=prefills,
    )


def _decode_batch(token_ids: np.ndarray, rows: np.ndarray, computed: np.ndarray, tables: np.ndarray,
                  block_size: int, samples: np.ndarray) -> FlatBatch:
    """`flat_batch` when every row computes one token (the common step): token i is row i."""
    b = len(rows)
    seq_lens = (computed + 1).astype(np.int32)
    width = int(blocks_for(int(seq_lens.max()), block_size))
    batch_tables = tables[rows, :width]
    blocks = batch_tables[np.arange(b), computed // block_size].astype(np.int64)
    cu = np.arange(b + 1, dtype=np.int32)
    return FlatBatch(
        input_ids=token_ids[rows, computed].astype(np.int64),
        positions=computed.astype(np.int64, copy=True),
        slot_mapping=blocks * block_size + computed % block_size,
        token_rows=np.arange(b, dtype=np.int64),
        block_tables=batch_tables,
        seq_lens_kv=seq_lens,
        cu_seqlens_q=cu,
        logits_indices=np.nonzero(samples)[0].astype(np.int64),
        num_decodes=b,
        prefills=[],
    )


class InputBatch:
    """Per-slot state of up to `max_num_seqs` running sequences."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, vocab_size: int,
                 eos_token_ids: set[int], host_penalty_tables: bool = True):
        n = max_num_seqs
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.seqs: list[Sequence | None] = [None] * n
        self.slot_of: dict[Sequence, int] = {}  # the slot of each running sequence
        self._free = list(range(n - 1, -1, -1))  # pop() hands out slot 0 first
        self.token_ids = np.zeros((n, max_model_len), np.int32)
        self.num_tokens = np.zeros(n, np.int64)  # tokens in the row, reserved positions included
        self.num_prompt = np.zeros(n, np.int64)
        self.block_table = np.zeros((n, blocks_for(max_model_len, block_size)), np.int32)
        self.num_blocks = np.zeros(n, np.int64)
        # Sampling parameters per slot.
        self.temperature = np.zeros(n, np.float32)
        self.top_k = np.zeros(n, np.int64)
        self.top_p = np.ones(n, np.float32)
        self.min_p = np.zeros(n, np.float32)
        self.seeds = np.zeros(n, np.uint64)
        self.num_logprobs = np.full(n, -1, np.int64)
        self.min_tokens = np.zeros(n, np.int64)
        self.has_penalties = np.zeros(n, bool)
        self.repetition_penalty = np.ones(n, np.float32)
        self.frequency_penalty = np.zeros(n, np.float32)
        self.presence_penalty = np.zeros(n, np.float32)
        # [slots, vocab] penalty state, allocated when the first request with penalties joins; on the host for
        # the CPU sampler. Without `host_penalty_tables` (the GPU) the sampler keeps them on the device, and
        # the batch only says which slots start over (`penalty_resets`).
        self.host_penalty_tables = host_penalty_tables
        self.output_counts: np.ndarray | None = None
        self.prompt_seen: np.ndarray | None = None
        self._penalty_resets: list[tuple[int, list[int], list[int]]] = []
        # Stop checks the engine does on token ids.
        self.max_tokens = np.full(n, np.iinfo(np.int64).max, np.int64)
        self.ignore_eos = np.zeros(n, bool)
        self.has_stop_ids = np.zeros(n, bool)
        self.watch_text = np.zeros(n, bool)
        self.has_grammar = np.zeros(n, bool)  # structured outputs: the row's sequence has a matcher
        # logit_bias and allowed_token_ids per slot: (token ids, biases), and the allowed tokens' bitmask row.
        self.has_bias = np.zeros(n, bool)
        self.bias_of: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.has_allowed = np.zeros(n, bool)
        self.allowed_of: dict[int, np.ndarray] = {}
        self.has_bad_words = np.zeros(n, bool)  # the sequence's bad_words_token_ids (`Sequence`) are checked
        self.wants_prompt_logprobs = np.zeros(n, bool)
        # Async scheduling: a step may be prepared before the previous one's tokens are written. The last
        # prepared step whose tokens are not written yet: its id, its sample rows' slots and reserved positions,
        # and each slot's generation then (a slot taken again since holds another sequence).
        self.num_prepared = 0
        self.slot_gen = np.zeros(n, np.int64)
        self._unwritten: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None

    @property
    def num_running(self) -> int:
        return len(self.seqs) - len(self._free)

    # ---- joining and leaving ---------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Give `seq` a slot and write its row: tokens, blocks, sampling parameters, penalty state."""
        assert seq.num_output_placeholders <= 1, "a joining sequence's earlier tokens are all known"
        slot = self._free.pop()
        self.slot_of[seq] = slot
        self.seqs[slot] = seq
        self.slot_gen[slot] += 1
        n = seq.num_known_tokens
        self.token_ids[slot, : seq.num_prompt_tokens] = seq.prompt_token_ids
        self.token_ids[slot, seq.num_prompt_tokens : n] = seq.output_token_ids
        self.num_tokens[slot] = n
        self.num_prompt[slot] = seq.num_prompt_tokens
        self.num_blocks[slot] = 0
        self.sync_blocks(seq)
        p = seq.params
        self.temperature[slot] = 0.0 if p.is_greedy else p.temperature
        self.top_k[slot] = p.top_k
        self.top_p[slot] = p.top_p
        self.min_p[slot] = p.min_p
        self.seeds[slot] = seq.seed
        self.num_logprobs[slot] = -1 if p.logprobs is None else p.logprobs
        self.min_tokens[slot] = p.min_tokens
        self.max_tokens[slot] = p.max_tokens if p.max_tokens is not None else np.iinfo(np.int64).max
        self.ignore_eos[slot] = p.ignore_eos
        self.has_stop_ids[slot] = bool(p.stop_token_ids)
        self.watch_text[slot] = seq.detokenizer is not None  # fed every token (stop strings)
        self.has_grammar[slot] = seq.grammar is not None
        self.has_bias[slot] = p.logit_bias is not None
        if p.logit_bias is not None:
            self.bias_of[slot] = (np.fromiter(p.logit_bias, np.int64), np.fromiter(p.logit_bias.values(), np.float32))
        self.has_bad_words[slot] = bool(seq.bad_words_token_ids)
        self.has_allowed[slot] = p.allowed_token_ids is not None
        if p.allowed_token_ids is not None:
            bits = np.zeros(bitmask_width(self.vocab_size) * 32, bool)
            bits[p.allowed_token_ids] = True
            self.allowed_of[slot] = np.packbits(bits, bitorder="little").view(np.int32)
        self.wants_prompt_logprobs[slot] = seq.wants_prompt_logprobs
        self.has_penalties[slot] = p.has_penalties
        if p.has_penalties:
            self.repetition_penalty[slot] = p.repetition_penalty
            self.frequency_penalty[slot] = p.frequency_penalty
            self.presence_penalty[slot] = p.presence_penalty
            if not self.host_penalty_tables:  # the GPU sampler's device tables start this slot over
                self._penalty_resets.append((slot, seq.prompt_token_ids, list(seq.output_token_ids)))
            else:
                if self.output_counts is None:
                    self.output_counts = np.zeros((len(self.seqs), self.vocab_size), np.float32)
                    self.prompt_seen = np.zeros((len(self.seqs), self.vocab_size), bool)
                self.output_counts[slot] = token_counts(seq.output_token_ids, self.vocab_size)
                self.prompt_seen[slot] = token_counts(seq.prompt_token_ids, self.vocab_size) > 0

    def remove(self, seq: Sequence) -> None:
        """Free `seq`'s slot (finished or preempted), if it holds one; its row is rewritten by the next joiner."""
        slot = self.slot_of.pop(seq, None)
        if slot is not None:
            self.seqs[slot] = None
            self._free.append(slot)
            # Flags the engine reads over all slots (`Engine._may_prepare_early`) say nothing of a free slot.
            self.has_bad_words[slot] = self.has_penalties[slot] = self.has_grammar[slot] = False

    def sync_blocks(self, seq: Sequence) -> None:
        """Append the block ids `seq` got since its row was last written (a block table only grows while running)."""
        slot = self.slot_of[seq]
        have = int(self.num_blocks[slot])
        new = seq.block_table[have:]
        if new:
            self.block_table[slot, have : have + len(new)] = new
            self.num_blocks[slot] = have + len(new)

    # ---- one step ----------------------------------------------------------------------------

    def prepare_inputs(self, rows: list[tuple[Sequence, int]], num_decodes: int = 0) -> StepInputs:
        """The flat inputs and sampling parameters of the scheduled rows (decodes first), and a
        reserved position for each row's sampled token. The rows' sequences already count this
        step's tokens as computed (the scheduler advanced them). `num_decodes`: leading rows the
        scheduler knows are decodes; when that is every row (the common step) their computed counts
        follow from the rows' tokens, and the sequences are not read."""
        b = len(rows)
        seqs = list(map(_first, rows))
        slots = np.fromiter(map(self.slot_of.__getitem__, seqs), np.int64, b)
        if b and num_decodes == b:  # each row computes its newest token and samples
            counts = np.ones(b, np.int64)
            num_tokens = self.num_tokens[slots]
            computed = num_tokens - 1
            samples = np.ones(b, bool)
            num_decode_tokens = b
        else:
            # map/itemgetter/attrgetter: the per-row work of a step runs at C speed (half a genexpr's cost).
            counts = np.fromiter(map(_second, rows), np.int64, b)
            if (counts != 1).any():  # decodes first, each group in scheduler order
                order = np.argsort(counts != 1, kind="stable")
                rows, counts = [rows[i] for i in order.tolist()], counts[order]
                seqs = list(map(_first, rows))
                slots = slots[order]
            computed = np.fromiter(map(_computed_of, seqs), np.int64, b) - counts
            num_tokens = self.num_tokens[slots]
            samples = computed + counts == num_tokens  # caught up: the last position predicts
            # A decode: one token, the sequence's newest, after at least one output token.
            num_decode_tokens = int(((counts == 1) & (num_tokens > self.num_prompt[slots])
                                     & (computed == num_tokens - 1)).sum())
        flat = flat_batch(self.token_ids, slots, computed, counts, self.block_table, self.block_size, samples)
        idx = np.nonzero(samples)[0]
        sample_slots = slots[idx]
        sample_seqs = [seqs[i] for i in idx.tolist()] if len(idx) != b else seqs
        sampling = self.sampling_batch(sample_slots) if len(idx) else None
        positions = self.num_tokens[sample_slots]
        self.num_tokens[sample_slots] += 1
        prompt_lp = None
        if num_decode_tokens < b and self.wants_prompt_logprobs[slots].any():
            prompt_lp = self._prompt_logprobs_inputs(seqs, slots, computed, counts, flat.cu_seqlens_q)
        patch = self._patch(flat, slots) if self._unwritten is not None else None
        self.num_prepared += 1
        step = self.num_prepared
        self._unwritten = (step, sample_slots, positions, self.slot_gen[sample_slots]) if len(idx) else None
        return StepInputs(flat, slots, counts, sample_seqs, sample_slots, positions, sampling, num_decode_tokens,
                          prompt_lp, step, patch)

    def _patch(self, flat: FlatBatch, slots: np.ndarray) -> TokenPatch | None:
        """The flat tokens whose value is a sampled token of the last prepared step, not written yet (async
        scheduling: it is still on its way from the device); None when there are none."""
        prev, prev_slots, prev_positions, gens = self._unwritten
        row_of_slot = np.full(len(self.seqs), -1, np.int64)
        held = self.slot_gen[prev_slots] == gens  # a slot taken again since belongs to a joiner: its tokens are known
        row_of_slot[prev_slots[held]] = np.nonzero(held)[0]
        src = row_of_slot[slots[flat.token_rows]]
        hit = src >= 0
        hit[hit] = prev_positions[src[hit]] == flat.positions[hit]
        if not hit.any():
            return None
        dst = np.nonzero(hit)[0].astype(np.int64)
        return TokenPatch(dst, src[dst], prev)

    def _prompt_logprobs_inputs(self, seqs: list[Sequence], slots: np.ndarray, computed: np.ndarray,
                                counts: np.ndarray, cu: np.ndarray) -> PromptLogprobsInputs | None:
        """Targets of the rows that ask for prompt logprobs: the hidden state at position p predicts prompt token
        p + 1, for the prompt tokens this step's chunk reaches that the sequence has not recorded (a preempted
        sequence recomputes its prompt but reports each position once)."""
        req_seqs, req_counts, index, targets, k = [], [], [], [], 0
        for r in np.nonzero(self.wants_prompt_logprobs[slots])[0].tolist():
            seq, slot, c = seqs[r], int(slots[r]), int(computed[r])
            recorded = len(seq.prompt_logprobs) if seq.prompt_logprobs is not None else 1
            first, last = max(c + 1, recorded), min(c + int(counts[r]), int(self.num_prompt[slot]) - 1)
            if last < first:
                continue
            req_seqs.append(seq)
            req_counts.append(last - first + 1)
            index.append(int(cu[r]) - c - 1 + np.arange(first, last + 1))
            targets.append(self.token_ids[slot, first : last + 1])
            k = max(k, seq.params.prompt_logprobs)
        if not req_seqs:
            return None
        return PromptLogprobsInputs(req_seqs, req_counts, np.concatenate(index).astype(np.int64),
                                    np.concatenate(targets).astype(np.int64), k)

    def forget_unwritten(self) -> None:
        """The last prepared step's tokens will never be written (it was drained, not committed)."""
        self._unwritten = None

    def sampling_batch(self, slots: np.ndarray) -> SamplingBatch:
        """Sampling parameters of `slots`, gathered from the per-slot arrays."""
        batch = SamplingBatch(
            temperature=self.temperature[slots], top_k=self.top_k[slots], top_p=self.top_p[slots],
            min_p=self.min_p[slots], seeds=self.seeds[slots], positions=self.num_tokens[slots],
            num_logprobs=self.num_logprobs[slots],
        )
        num_output = self.num_tokens[slots] - self.num_prompt[slots]
        short = np.nonzero(num_output < self.min_tokens[slots])[0]
        if len(short):
            pairs = [(i, t) for i in short.tolist() for t in stop_tokens_while_short(
                self.seqs[slots[i]].params, int(num_output[i]), self.eos_token_ids, self.vocab_size)]
        else:
            pairs = []
        for i in np.nonzero(self.has_bad_words[slots])[0].tolist():
            pairs += [(i, t) for t in self._bad_words_due(int(slots[i]), int(num_output[i]))]
        if pairs:
            batch.banned_rows, batch.banned_tokens = (np.asarray(a, np.int64) for a in zip(*pairs))
        biased = np.nonzero(self.has_bias[slots])[0]
        if len(biased):
            parts = [self.bias_of[s] for s in slots[biased].tolist()]
            batch.bias_rows = np.repeat(biased, [len(t) for t, _ in parts])
            batch.bias_tokens = np.concatenate([t for t, _ in parts])
            batch.bias_values = np.concatenate([v for _, v in parts])
        allowed = np.nonzero(self.has_allowed[slots])[0]
        if len(allowed):
            batch.allowed_rows = allowed
            batch.allowed_bitmask = np.stack([self.allowed_of[s] for s in slots[allowed].tolist()])
        constrained = np.nonzero(self.has_grammar[slots])[0]
        if len(constrained):
            batch.grammar_rows = constrained
            batch.grammars = [self.seqs[s].grammar for s in slots[constrained].tolist()]
        pen = np.nonzero(self.has_penalties[slots])[0]
        if len(pen):
            ps = slots[pen]
            batch.penalty_rows = pen
            batch.repetition_penalty = self.repetition_penalty[ps]
            batch.frequency_penalty = self.frequency_penalty[ps]
            batch.presence_penalty = self.presence_penalty[ps]
            batch.penalty_slots = ps
            if self.host_penalty_tables:
                batch.output_counts = self.output_counts[ps]
                batch.prompt_seen = self.prompt_seen[ps]
        if self._penalty_resets:
            batch.penalty_resets, self._penalty_resets = self._penalty_resets, []
            batch.num_slots = len(self.seqs)
        return batch

    def _bad_words_due(self, slot: int, num_output: int) -> list[int]:
        """The last token of each bad word whose other tokens end the slot's output (vLLM's rule: output only)."""
        end = int(self.num_tokens[slot])
        out = []
        for word in self.seqs[slot].bad_words_token_ids:
            k = len(word) - 1
            if k == 0 or (k <= num_output and self.token_ids[slot, end - k : end].tolist() == word[:-1]):
                out.append(word[-1])
        return out

    def write_tokens(self, step: StepInputs, tokens: np.ndarray) -> np.ndarray:
        """The step's sampled tokens into their reserved positions (and penalty counts); returns the
        rows (indices into `tokens`) that may stop (`stop_checker.stop_candidates`)."""
        slots = step.sample_slots
        if self._unwritten is not None and self._unwritten[0] == step.step_id:
            self._unwritten = None
        self.token_ids[slots, step.sample_positions] = tokens
        if self.output_counts is not None:
            pen = self.has_penalties[slots]
            if pen.any():
                np.add.at(self.output_counts, (slots[pen], tokens[pen]), 1.0)
        return stop_candidates(tokens, step.sample_positions + 1, self.num_prompt[slots], self.max_tokens[slots],
                               self.ignore_eos[slots], self.has_stop_ids[slots], self.watch_text[slots],
                               self.eos_token_ids, self.max_model_len)
