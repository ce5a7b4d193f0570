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
kernels. Logprobs are computed on the device too (ops_logprobs.cu, from a device copy of the raw rows
when a processor changes them). What crosses to the host per step is one buffer: the sampled ids, and
for the rows that ask for logprobs their [2 + 2k] numbers (`fdlite/sample/logprobs.py`).
"""

from __future__ import annotations

import numpy as np
import paddle

from fdlite.kernels import gpu as gpu_ops
from fdlite.kernels.device_tensors import release_tensor
from fdlite.sample.logprobs import LogprobsTensors, unpack
from fdlite.sample.sampler import _NEG_INF, PendingSample, SamplerOutput, SamplingBatch, bans_a_grammar_leaves


def _upload(a, dtype) -> paddle.Tensor:
    return gpu_ops.upload(a, dtype)


def _adjusts(batch: SamplingBatch) -> bool:
    """Whether any logits processor runs on this batch (and so changes the logits in place)."""
    return (batch.penalty_rows is not None or batch.bias_rows is not None or batch.allowed_rows is not None
            or batch.grammar_rows is not None or len(batch.banned_rows) > 0)


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

    def release(self) -> None:
        """Free both tables now (the engine is closing), whoever still holds this object."""
        for t in (self.counts, self.prompt):
            release_tensor(t)
        self.counts = self.prompt = None

    def count(self, slots: np.ndarray, tokens: paddle.Tensor) -> None:
        """One more occurrence of each sampled token (int64, on the device) in its slot's output."""
        gpu_ops.scatter_(self.counts, _upload(slots, np.int64), tokens, _upload(np.ones(len(slots)), np.float32), add=True)


def logprobs_of(logits: paddle.Tensor, targets: np.ndarray, k: int) -> LogprobsTensors:
    """`Sampler.logprobs_of` on the device: one kernel, one copy of the [rows, 2 + 2k] numbers."""
    rows = _upload(np.arange(len(targets)), np.int64)
    buf = gpu_ops.to_host(gpu_ops.logprobs(logits, rows, _upload(targets, np.int64), rows, k))
    return unpack(buf, len(targets), np.arange(len(targets)), k)[1]


class GpuSampler:
    """The GPU half of `Sampler`: holds the device token tables between steps."""

    def __init__(self) -> None:
        self.tables: DeviceTokenTables | None = None
        self.copies = gpu_ops.PinnedCopies()

    def close(self) -> None:
        tables, self.tables = self.tables, None
        if tables is not None:
            tables.release()
        self.copies.close()

    def __call__(self, logits: paddle.Tensor, batch: SamplingBatch, defer: bool = False) -> SamplerOutput | PendingSample:
        """Sample; with `defer` the ids' copy to the host is left in flight (a `PendingSample`)."""
        if logits.ndim != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits must be [rows={batch.num_rows}, vocab], got shape {list(logits.shape)}")
        asking = np.nonzero(batch.num_logprobs >= 0)[0]
        raw, raw_rows = logits, asking
        if len(asking) and _adjusts(batch):  # logprobs are of the raw logits: a device copy of the asking rows first
            raw, raw_rows = gpu_ops.gather_rows(logits, _upload(asking, np.int64)), np.arange(len(asking))
        self._adjust(logits, batch)
        if (batch.temperature <= 0.0).all():
            tokens = gpu_ops.argmax(logits)
        else:
            tokens = gpu_ops.sample(
                logits, _upload(batch.temperature, np.float32), _upload(np.clip(batch.top_k, -1, 2**31 - 1), np.int32),
                _upload(batch.top_p, np.float32), _upload(batch.min_p, np.float32),
                _upload(np.asarray(batch.seeds, np.uint64).view(np.int64), np.int64),
                _upload(batch.positions, np.int64))
        if batch.penalty_rows is not None:
            self.tables.count(batch.penalty_slots, gpu_ops.gather_rows(tokens, _upload(batch.penalty_rows, np.int64)))
        if not len(asking):
            copy = self.copies.start(tokens)

            def finish(host):
                return SamplerOutput(host.tolist(), device_tokens=tokens)
        else:
            num = batch.num_logprobs[asking]
            k = int(num.max())
            # One copy: the sampled ids and the asking rows' [2 + 2k] numbers in one buffer.
            copy = self.copies.start(gpu_ops.logprobs(raw, _upload(raw_rows, np.int64), tokens,
                                                      _upload(asking, np.int64), k))

            def finish(host):
                ids, tensors = unpack(host, batch.num_rows, asking, k)
                return SamplerOutput(ids.tolist(), tensors, asking, num, device_tokens=tokens)
        pending = PendingSample(copy, finish, tokens)
        return pending if defer else pending.wait()

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

