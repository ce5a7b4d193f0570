"""The sampler on the GPU: fdlite's kernels for the draw and for every logits processor, no logits to the host.

Same contract as the CPU sampler (`SamplingBatch` in, `SamplerOutput` out) and the same counter-based
noise (`fdlite/sample/random.py`: u(seed, position, 0)), so a seeded request draws independently of its
batch on either device. The kernel's rule (ops_sampling.cu, `fdlite/sample/sampling_ref.py`) keeps the
same token sets as the CPU's top-k / top-p / min-p; where a CPU and a GPU draw differ it is in which
token of the kept set u lands on (integer masses vs float64 sums), not in the distribution.

The logits processors run in place on the device, in the CPU sampler's order (ops_logits.cu):
repetition / frequency / presence penalties from per-slot token tables kept on the device
(`DeviceTokenTables`: output counts and prompt marks, reset from the prompt and outputs when a slot is
taken, counted up from the sampled ids after each draw); the grammar bitmask of constrained rows
(computed on the host by llguidance beside the forward, uploaded for those rows only); min_tokens bans as
sparse (row, token) writes; logit_bias as sparse adds and allowed_token_ids as a bitmask, by the same
kernels. What crosses to the host per step: the sampled ids, and the raw logits of the
rows that ask for logprobs (log-softmax and top-k on the host, for now).
"""

from __future__ import annotations

import numpy as np
import paddle

from fdlite.kernels import gpu as gpu_ops
from fdlite.kernels.device_tensors import to_numpy_f32
from fdlite.sample.sampler import _NEG_INF, SamplerOutput, SamplingBatch, _output, bans_a_grammar_leaves


def _upload(a, dtype) -> paddle.Tensor:
    return paddle.to_tensor(np.ascontiguousarray(a, dtype=dtype))


def _rows_to_host(logits: paddle.Tensor, rows: np.ndarray) -> np.ndarray:
    return to_numpy_f32(gpu_ops.gather_rows(logits, _upload(rows, np.int64)))


class DeviceTokenTables:
    """Per-slot token tables of the penalty rows, on the device: output occurrences [S, V] float32 and prompt
    marks [S, V] uint8. Owned by the GPU sampler; allocated when the first request with penalties joins."""

    def __init__(self, num_slots: int, vocab: int):
        self.counts = paddle.empty([num_slots, vocab], dtype="float32")
        self.prompt = paddle.empty([num_slots, vocab], dtype="uint8")
        gpu_ops.fill_(self.counts, 0.0)
        gpu_ops.fill_(self.prompt, 0)

    def reset(self, resets: list[tuple[int, list[int], list[int]]]) -> None:
        """Rows of slots taken since the last step: zeros, then the prompt's marks and the outputs' counts."""
        for slot, _, _ in resets:
            gpu_ops.fill_(self.counts[slot : slot + 1], 0.0)
            gpu_ops.fill_(self.prompt[slot : slot + 1], 0)
        prompt = [(s, t) for s, p, _ in resets for t in p]
        out = [(s, t) for s, _, o in resets for t in o]
        for table, pairs, add in ((self.prompt, prompt, False), (self.counts, out, True)):
            if pairs:
                rows, cols = np.asarray(pairs, np.int64).T
                gpu_ops.scatter_(table, _upload(rows, np.int64), _upload(cols, np.int64),
                                 _upload(np.ones(len(rows)), np.float32), add=add)

    def count(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """One more occurrence of each sampled token in its slot's output."""
        gpu_ops.scatter_(self.counts, _upload(slots, np.int64), _upload(tokens, np.int64),
                         _upload(np.ones(len(slots)), np.float32), add=True)


class GpuSampler:
    """The GPU half of `Sampler`: holds the device token tables between steps."""

    def __init__(self) -> None:
        self.tables: DeviceTokenTables | None = None

    def __call__(self, logits: paddle.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.ndim != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits must be [rows={batch.num_rows}, vocab], got shape {list(logits.shape)}")
        asking = np.nonzero(batch.num_logprobs >= 0)[0]
        raw = _rows_to_host(logits, asking) if len(asking) else None  # before any adjustment (vLLM: raw logprobs)
        self._adjust(logits, batch)
        if (batch.temperature <= 0.0).all():
            tokens = gpu_ops.argmax(logits)
        else:
            tokens = gpu_ops.sample(
                logits, _upload(batch.temperature, np.float32), _upload(np.clip(batch.top_k, -1, 2**31 - 1), np.int32),
                _upload(batch.top_p, np.float32), _upload(batch.min_p, np.float32),
                _upload(np.asarray(batch.seeds, np.uint64).view(np.int64), np.int64),
                _upload(batch.positions, np.int64))
        ids = tokens.numpy().astype(np.int64, copy=False)
        if batch.penalty_rows is not None:
            self.tables.count(batch.penalty_slots, ids[batch.penalty_rows])
        if raw is None:
            return SamplerOutput(ids.tolist(), [None] * batch.num_rows, [None] * batch.num_rows)
        return _output(raw, ids, batch, rows_asking_only=True)

    def _adjust(self, logits: paddle.Tensor, batch: SamplingBatch) -> None:
        """Penalties, logit_bias, allowed_token_ids, the grammar mask, then min_tokens bans (the CPU sampler's
        order), in place on the device."""
        if batch.penalty_resets:
            if self.tables is None:
                self.tables = DeviceTokenTables(batch.num_slots, logits.shape[1])
            self.tables.reset(batch.penalty_resets)
        if batch.penalty_rows is not None:
            gpu_ops.apply_penalties_(logits, _upload(batch.penalty_rows, np.int64), _upload(batch.penalty_slots, np.int64),
                                     self.tables.counts, self.tables.prompt,
                                     _upload(batch.repetition_penalty, np.float32),
                                     _upload(batch.frequency_penalty, np.float32),
                                     _upload(batch.presence_penalty, np.float32))
        if batch.bias_rows is not None:
            gpu_ops.scatter_(logits, _upload(batch.bias_rows, np.int64), _upload(batch.bias_tokens, np.int64),
                             _upload(batch.bias_values, np.float32), add=True)
        if batch.allowed_rows is not None:
            gpu_ops.apply_bitmask_(logits, _upload(batch.allowed_rows, np.int64), _upload(batch.allowed_bitmask, np.int32))
        if batch.grammar_bitmask is not None and batch.grammar_rows is not None and len(batch.grammar_rows):
            gpu_ops.apply_bitmask_(logits, _upload(batch.grammar_rows, np.int64), _upload(batch.grammar_bitmask, np.int32))
        banned_rows, banned_tokens = bans_a_grammar_leaves(batch, logits.shape[1])
        if len(banned_rows):
            gpu_ops.scatter_(logits, _upload(banned_rows, np.int64), _upload(banned_tokens, np.int64),
                             _upload(np.full(len(banned_rows), _NEG_INF), np.float32))

