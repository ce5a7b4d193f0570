"""Which process of a multi-GPU launch this is, and how the others learn the job's requests.

Under `python -m paddle.distributed.launch --gpus 0,1 fdlite run job.yaml` every GPU runs its own copy of
the job. With tensor parallelism all ranks must run the same batches in lockstep, but only one may read
the input and write the results, or lines would be doubled and resumes would disagree: that is rank 0.
"""

from __future__ import annotations

import os
from typing import Any

from fdlite import envs


def current_rank() -> int:
    """This process's rank, from the launcher's `PADDLE_TRAINER_ID` (0 when not launched)."""
    return envs.PADDLE_TRAINER_ID


def world_size() -> int:
    """Number of launched processes, from `PADDLE_TRAINERS_NUM` (1 when not launched)."""
    return envs.PADDLE_TRAINERS_NUM


def has_process_group() -> bool:
    """True once a Paddle process group spans the ranks (set up by tensor-parallel startup)."""
    if world_size() <= 1:
        return False
    try:
        import paddle.distributed as dist

        return dist.is_initialized()
    except Exception:  # no paddle.distributed in this build: no group
        return False


def share_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (rank 0 passes the value, the others anything).

    Only valid with a process group (see `has_process_group`); callers decide what ranks > 0 do without one.
    """
    import paddle.distributed as dist

    box = [obj if current_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
