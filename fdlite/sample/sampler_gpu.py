"""The sampler on the GPU: fdlite's argmax / sampling kernels, host round trips only where asked for.

Same contract as the CPU sampler (`SamplingBatch` in, `SamplerOutput` out) and the same counter-based
noise (`fdlite/sample/random.py`: u(seed, position, 0)), so a seeded request draws independently of its batch
on either device. The kernel's rule (ops_sampling.cu, `fdlite/sample/sampling_ref.py`) keeps the
same token sets as the CPU's top-k / top-p / min-p; where a CPU and a GPU draw differ it is in which
token of the kept set u lands on (integer masses vs float64 sums), not in the distribution.

What crosses to the host per step: the sampled ids. Rows that ask for logprobs also copy their raw
logits back (log-softmax and top-k on the host). Rows with penalties, with
stop tokens held back by min_tokens, or constrained by a grammar (structured outputs: the bitmask is
computed on the host anyway) copy their logits to the host, are adjusted there by the CPU sampler's own
code, and go back before the kernel draws: those rows pay two copies, the rest of the batch nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import paddle

from fdlite.kernels import gpu as gpu_ops
from fdlite.kernels.device_tensors import to_numpy_f32, write_from_host
from fdlite.sample.sampler import SamplerOutput, SamplingBatch, _output, adjust_logits


def _rows_to_host(logits: paddle.Tensor, rows: np.ndarray) -> np.ndarray:
    index = paddle.to_tensor(np.asarray(rows, np.int64))
    return to_numpy_f32(gpu_ops.gather_rows(logits, index))


def _adjust_on_host(logits: paddle.Tensor, batch: SamplingBatch) -> None:
    """Penalties, grammar masks and min_tokens bans for the rows that have them, in place in the GPU logits."""
    grammar = batch.grammar_bitmask is not None and batch.grammar_rows is not None
    parts = [batch.banned_rows] + ([batch.penalty_rows] if batch.penalty_rows is not None else []) + (
        [batch.grammar_rows] if grammar else [])
    rows = np.unique(np.concatenate(parts).astype(np.int64))
    if not len(rows):
        return
    host = _rows_to_host(logits, rows)
    # The same batch with its row indices renumbered into `rows` (the penalty and grammar arrays keep their order).
    renumber = lambda r: None if r is None else np.searchsorted(rows, r)  # noqa: E731
    sub = dataclasses.replace(
        batch, banned_rows=np.searchsorted(rows, batch.banned_rows), penalty_rows=renumber(batch.penalty_rows),
        grammar_rows=renumber(batch.grammar_rows) if grammar else None)
    adjusted = adjust_logits(host, sub)
    for i, r in enumerate(rows.tolist()):
        write_from_host(logits[r : r + 1], adjusted[i : i + 1])


def sample_on_gpu(logits: paddle.Tensor, batch: SamplingBatch) -> SamplerOutput:
    if logits.ndim != 2 or logits.shape[0] != batch.num_rows:
        raise ValueError(f"logits must be [rows={batch.num_rows}, vocab], got shape {list(logits.shape)}")
    asking = np.nonzero(batch.num_logprobs >= 0)[0]
    raw = _rows_to_host(logits, asking) if len(asking) else None  # before any adjustment (vLLM: raw logprobs)
    if len(batch.banned_rows) or batch.penalty_rows is not None or batch.grammar_bitmask is not None:
        _adjust_on_host(logits, batch)
    if (batch.temperature <= 0.0).all():
        tokens = gpu_ops.argmax(logits)
    else:
        upload = lambda a, dt: paddle.to_tensor(np.ascontiguousarray(a, dtype=dt))  # noqa: E731
        tokens = gpu_ops.sample(
            logits, upload(batch.temperature, np.float32), upload(np.clip(batch.top_k, -1, 2**31 - 1), np.int32),
            upload(batch.top_p, np.float32), upload(batch.min_p, np.float32),
            upload(np.asarray(batch.seeds, np.uint64).view(np.int64), np.int64), upload(batch.positions, np.int64))
    ids = tokens.numpy().astype(np.int64, copy=False)
    if raw is None:
        return SamplerOutput(ids.tolist(), [None] * batch.num_rows, [None] * batch.num_rows)
    return _output(raw, ids, batch, rows_asking_only=True)
