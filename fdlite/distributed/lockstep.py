"""How tensor-parallel ranks stay in lockstep without shipping the schedule around.

Every rank runs the same script, so every rank builds the same requests and runs the same
deterministic scheduler over the same KV block count (the minimum over ranks). Two things could
still drive them apart, and each is closed here:

- Different requests (a script that reads a file only rank 0 can see, or shuffles without a
  seed): the ranks compare a digest of their requests when `generate` starts, and every rank raises
  the same error rather than hanging in a collective whose partner never comes.
- Sampling: only rank 0 samples, and broadcasts the token ids each step; the others append those.
  So random sampling, and ties that floating-point noise might break differently, cannot diverge.
  Ranks > 0 do not compute logprobs: they return no outputs (rank 0 alone does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import paddle

from fdlite.distributed.communicator import Communicator
from fdlite.kernels import gpu as gpu_ops
from fdlite.sample.sampler import SamplerOutput
from fdlite.sampling_params import SamplingParams


def requests_digest(requests: list[tuple[list[int], SamplingParams]]) -> int:
    """A 63-bit digest of (prompt token ids, sampling params) of every request, in order."""
    h = hashlib.sha256()
    for ids, params in requests:
        h.update(json.dumps([ids, dataclasses.asdict(params)], sort_keys=True, default=str).encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1


def check_same_requests(comm: Communicator, digest: int, count: int) -> None:
    """Raise on every rank when the ranks were given different requests."""
    if comm.world_size == 1:
        return
    lo, hi = comm.reduce_int(digest, "min"), comm.reduce_int(digest, "max")
    if lo != hi:
        raise ValueError(
            f"tensor-parallel ranks were given different requests (rank {comm.state.rank} has {count}); every "
            "rank must call generate with the same prompts and sampling params, in the same order (rank 0's "
            "results are the ones returned)"
        )


def share_sampled_tokens(comm: Communicator, sampled: SamplerOutput | None, num_rows: int | None = None) -> SamplerOutput:
    """Rank 0's sampled tokens on every rank (rank 0 passes its output, the others None and the row count).
    Ranks > 0 get no logprobs: they return no outputs."""
    if comm.device == "gpu":
        return _share_on_device(comm, sampled, num_rows)
    if comm.state.is_driver:
        comm.broadcast_from_driver(paddle.to_tensor(np.asarray(sampled.token_ids, dtype=np.int64)))
        return sampled
    tokens = comm.broadcast_from_driver(paddle.zeros([num_rows], dtype="int64")).numpy().tolist()
    return SamplerOutput(token_ids=[int(t) for t in tokens])


def _share_on_device(comm: Communicator, sampled: SamplerOutput | None, num_rows: int | None) -> SamplerOutput:
    """share_sampled_tokens on a GPU: the driver's device ids broadcast on the device (no Paddle kernel: `empty`
    and fdlite's copies only); the other ranks keep them on the device too (the next step's input patch reads
    them there) and bring them to the host once."""
    if comm.state.is_driver:
        ids = sampled.device_tokens
        if ids is None:
            ids = gpu_ops.upload(np.asarray(sampled.token_ids, dtype=np.int64), np.int64)
        comm.broadcast_from_driver(ids)
        return sampled
    ids = comm.broadcast_from_driver(paddle.empty([num_rows], dtype="int64"))
    return SamplerOutput(token_ids=gpu_ops.to_host(ids).tolist(), device_tokens=ids)
