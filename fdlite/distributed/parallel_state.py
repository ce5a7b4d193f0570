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
picks the GPU the launcher assigned (`FLAGS_selected_gpus`). A script that pins its GPU itself
(`device="gpu:0"` in every process) may put several ranks on one GPU, where NCCL refuses to run (it
rejects two ranks on one device): the group is then gloo, for the host's few collectives (KV block
count, request digests, IPC handles), and every collective of a step goes through fdlite's custom
all-reduce over CUDA IPC (`communicator.py`). That is the layout the one-GPU machines verify on.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from fdlite import envs

logger = logging.getLogger("fdlite")


@dataclass(frozen=True)
class ParallelState:
    """This process's place in the launch: its rank inside its tensor-parallel group, and which
    data-parallel group (model copy) it belongs to."""

    rank: int  # inside the tensor-parallel group
    world_size: int  # tensor-parallel group size
    backend: str  # "none" (one process), "gloo" (CPU) or "nccl" (GPU)
    dp_rank: int = 0  # which data-parallel group
    dp_size: int = 1
    group: object | None = None  # the paddle group of the tensor-parallel ranks; None: the whole launch
    driver_rank: int = 0  # launch-wide rank of this group's rank 0 (collectives name ranks launch-wide)

    @property
    def is_driver(self) -> bool:
        """Rank 0 of its tensor-parallel group: the one that samples, returns outputs and writes files."""
        return self.rank == 0


def launched_world_size() -> int:
    """Processes started by `paddle.distributed.launch` (1 when not launched)."""
    return envs.PADDLE_TRAINERS_NUM


def launched_rank() -> int:
    """This process's rank in the launch, from the launcher's `PADDLE_TRAINER_ID` (0 when not launched)."""
    return envs.PADDLE_TRAINER_ID


def has_process_group() -> bool:
    """True once a Paddle process group spans the launched processes (`init_tensor_parallel` sets it up)."""
    if launched_world_size() <= 1:
        return False
    try:
        import paddle.distributed as dist

        return dist.is_initialized()
    except Exception:  # no paddle.distributed in this build: no group
        return False


def launch_hint(n: int) -> str:
    return (f"start it with `python -m paddle.distributed.launch --gpus {','.join(map(str, range(n)))} script.py` "
            f"(on CPU: `--nproc_per_node {n}`)")


def group_of(rank: int, tensor_parallel_size: int) -> tuple[int, int]:
    """(data-parallel group, rank inside its tensor-parallel group) of a launch-wide rank.

    Consecutive ranks form a tensor-parallel group (ranks 0..tp-1 are group 0), so with one node per
    group the all-reduces of the model stay inside a node.
    """
    return rank // tensor_parallel_size, rank % tensor_parallel_size


def control_backend(device: str, pinned_gpu: bool) -> str:
    """The process group's backend: gloo on CPU and for GPU ranks that pinned their GPU themselves (they may
    share it, which NCCL refuses), else NCCL. An explicit PADDLE_DISTRI_BACKEND wins."""
    chosen = envs.PADDLE_DISTRI_BACKEND
    if chosen != "auto":
        return chosen
    return "gloo" if device == "cpu" or pinned_gpu else "nccl"


def init_tensor_parallel(tensor_parallel_size: int, device: str, data_parallel_size: int = 1,
                         pinned_gpu: bool = False) -> ParallelState:
    """Check the launch matches `data_parallel_size * tensor_parallel_size` and join the collective groups
    (once per process): the whole launch, and with both sizes above 1 this rank's tensor-parallel group.
    `pinned_gpu`: the GPU was named by the caller (`device="gpu:N"`), so ranks may share it: gloo control."""
    world = launched_world_size()
    tp, dp = tensor_parallel_size, data_parallel_size
    if tp * dp == 1 and world == 1:
        return ParallelState(0, 1, "none")
    sizes = f"tensor_parallel_size={tp}" + (f" * data_parallel_size={dp}" if dp > 1 else "")
    if world == 1:
        raise ValueError(
            f"{sizes} needs {tp * dp} processes, one per GPU; this one was not started by Paddle's launcher: "
            f"{launch_hint(tp * dp)}"
        )
    if world != tp * dp:
        hint = (f"pass tensor_parallel_size={world} (or launch {tp} processes)" if dp == 1 else
                f"launch {tp * dp} processes")
        raise ValueError(
            f"paddle.distributed.launch started {world} processes but {sizes} needs {tp * dp}; fdlite uses all "
            f"launched processes, so {hint}"
        )
    import paddle.distributed as dist

    backend = control_backend(device, pinned_gpu)
    if backend == "gloo":
        os.environ["PADDLE_DISTRI_BACKEND"] = "gloo"
    if not dist.is_initialized():
        import paddle  # noqa: PLC0415

        place = paddle.get_device()
        dist.init_parallel_env()
        paddle.set_device(place)  # a gloo group makes the CPU Paddle's expected place, even in a GPU process
    rank, size = dist.get_rank(), dist.get_world_size()
    if size != world or rank != launched_rank():
        raise RuntimeError(f"process group is rank {rank} of {size}, but the launcher said rank "
                           f"{launched_rank()} of {world}")
    dp_rank, tp_rank = group_of(rank, tp)
    group = None
    if dp > 1 and tp > 1:
        # Every rank must create every group, in the same order, even the ones it is not in. (On the
        # loaded 2-core test machine, gloo's connect inside this call is sometimes refused: see README.)
        groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(dp)]
        group = groups[dp_rank]
    if tp > 1:
        logger.info("tensor parallel: rank %d of %d (%s)", tp_rank, tp, backend)
    if dp > 1:
        logger.info("data parallel: group %d of %d", dp_rank, dp)
    return ParallelState(tp_rank, tp, backend if tp > 1 else "none", dp_rank, dp, group, dp_rank * tp)
