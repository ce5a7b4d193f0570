"""Which rank this process is, and the collective group fdlite sets up itself.

Users scale with Paddle's own launcher, one process per GPU:
`python -m paddle.distributed.launch --gpus 0,1 script.py`. `LLM(..., tensor_parallel_size=2)` in that
script reads the launcher's environment and calls `paddle.distributed.init_parallel_env()` itself, so a
script written for one GPU needs no distributed code.

Measured with paddlepaddle 3.3.1 (CPU build), 2026-11-23:
- `python -m paddle.distributed.launch --nproc_per_node 2 script.py` runs on CPU with no other setup:
  the launcher sets `PADDLE_TRAINER_ID`, `PADDLE_TRAINERS_NUM`, `PADDLE_MASTER` (a free port it picks)
  and `PADDLE_DISTRI_BACKEND=gloo`; `init_parallel_env()` then takes 0.8 s and builds a gloo group.
  Only rank 0's output reaches the console; every rank's goes to `log/workerlog.N`.
- On gloo, `all_reduce` (SUM and MIN), `all_gather`, `broadcast` and `all_gather_object` work on CPU
  tensors; a [8, 64] float32 all-reduce between 2 processes takes 2.5 ms.
- `all_reduce` called from a function made opaque to SOT (`graph/graph_break.py`) inside a
  `paddle.jit.to_static(..., full_graph=False)` forward runs eagerly at a graph break and gives the
  same numbers as the dynamic graph, for 3 different token counts.
- With `PADDLE_DISTRI_BACKEND` removed from the launcher's environment, a CPU build's
  `init_parallel_env()` fails ("RuntimeError: The global group is not initialized."), so fdlite sets it
  to gloo on CPU when it is unset.

On GPU the same code asks for NCCL (Paddle's default with a CUDA build); `paddle.set_device("gpu")`
picks the GPU the launcher assigned (`FLAGS_selected_gpus`). That path is written, not run here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger("fdlite")


@dataclass(frozen=True)
class ParallelState:
    rank: int
    world_size: int
    backend: str  # "none" (one process), "gloo" (CPU) or "nccl" (GPU)

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one that samples, returns outputs and writes files."""
        return self.rank == 0


def launched_world_size() -> int:
    """Processes started by `paddle.distributed.launch` (1 when not launched)."""
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1") or 1)


def launched_rank() -> int:
    return int(os.environ.get("PADDLE_TRAINER_ID", "0") or 0)


def launch_hint(tp: int) -> str:
    return (f"start it with `python -m paddle.distributed.launch --gpus {','.join(map(str, range(tp)))} script.py` "
            f"(on CPU: `--nproc_per_node {tp}`)")


def init_tensor_parallel(tensor_parallel_size: int, device: str) -> ParallelState:
    """Check the launch matches `tensor_parallel_size` and join the collective group (once per process)."""
    world = launched_world_size()
    if tensor_parallel_size == 1 and world == 1:
        return ParallelState(0, 1, "none")
    if world == 1:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} processes, one per GPU; "
            f"this one was not started by Paddle's launcher: {launch_hint(tensor_parallel_size)}"
        )
    if world != tensor_parallel_size:
        raise ValueError(
            f"paddle.distributed.launch started {world} processes but tensor_parallel_size={tensor_parallel_size}; "
            f"fdlite splits the model across all launched processes, so pass tensor_parallel_size={world} "
            f"(or launch {tensor_parallel_size} processes)"
        )
    import paddle.distributed as dist

    if device == "cpu":
        os.environ.setdefault("PADDLE_DISTRI_BACKEND", "gloo")
    if not dist.is_initialized():
        dist.init_parallel_env()
    rank, size = dist.get_rank(), dist.get_world_size()
    if size != world or rank != launched_rank():
        raise RuntimeError(f"process group is rank {rank} of {size}, but the launcher said rank "
                           f"{launched_rank()} of {world}")
    backend = "gloo" if device == "cpu" else "nccl"
    logger.info("tensor parallel: rank %d of %d (%s)", rank, size, backend)
    return ParallelState(rank, size, backend)
