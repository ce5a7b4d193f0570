"""The collectives of the tensor-parallel group: NCCL (GPU) or gloo (CPU) through `paddle.distributed`,
or fdlite's custom all-reduce when asked for and built.

Layers call `tensor_parallel_all_reduce(x)`, a module function rather than a method on something the
layer holds: SOT must see one fixed function to keep out of its graphs (it is an opaque graph break,
like attention: `graph/graph_break.py`), and there is one tensor-parallel group per process anyway.

`enable_custom_all_reduce` (FastDeploy's option) uses `custom_all_reduce.CustomAllReduce` (fdlite's
CUDA all-reduce, fdlite/kernels/csrc) for messages it accepts (`should_use`), NCCL for the rest. When that module or its
CUDA library is missing, or the device is a CPU, one log line says so and everything goes through
`paddle.distributed`. All ranks agree on the choice (an all-reduce of each rank's answer) before any
layer runs: a rank on the custom path and one on NCCL would wait on each other forever.
"""

from __future__ import annotations

import logging
import math

import paddle

from fdlite.distributed.parallel_state import ParallelState
from fdlite.graph.graph_break import opaque_to_sot
from fdlite.kernels.allreduce.capture import register_capture_participant, unregister_capture_participant

logger = logging.getLogger("fdlite")


class Communicator:
    def __init__(self, state: ParallelState, device: str, enable_custom_all_reduce: bool = False):
        self.state = state
        self.device = device
        self.custom = self._start_custom_all_reduce() if enable_custom_all_reduce else None

    @property
    def world_size(self) -> int:
        return self.state.world_size

    @property
    def group(self):
        """The paddle group of this tensor-parallel group (None: the whole launch is one group)."""
        return self.state.group

    def broadcast_object(self, obj):
        """The driver's `obj` on every rank of the group (the driver passes it, the others anything)."""
        import paddle.distributed as dist

        box = [obj if self.state.is_driver else None]
        dist.broadcast_object_list(box, src=self.state.driver_rank, group=self.group)
        return box[0]

    @property
    def backend(self) -> str:
        return f"custom+{self.state.backend}" if self.custom is not None else self.state.backend

    # ---- custom all-reduce -----------------------------------------------------------------

    def _start_custom_all_reduce(self):
        """The custom all-reduce, or None after one log line saying why not (the same answer on every rank)."""
        custom, reason = None, self._custom_all_reduce_problem()
        if self.world_size > 1 and not self.agree(reason is None):
            reason = reason or "another rank cannot use it"
        elif reason is None:
            from fdlite.kernels.allreduce.custom_all_reduce import CustomAllReduce

            try:
                exchange = self.all_gather_bytes if self.world_size > 1 else None
                custom = CustomAllReduce(self.state.rank, self.world_size, exchange)
            except Exception as e:  # a failed start on any rank sends every rank to the fallback below
                reason = f"it failed to start: {e}"
            if self.world_size > 1 and not self.agree(custom is not None):
                reason, custom = reason or "it failed to start on another rank", None
        if custom is None:
            fallback = ("using NCCL" if self.device == "gpu" else "using gloo") if self.world_size > 1 else \
                "one process has nothing to all-reduce anyway"
            logger.warning("enable_custom_all_reduce=True, but the custom all-reduce cannot be used: %s; %s",
                           reason, fallback)
            return None
        logger.info("custom all-reduce on (messages up to %d bytes; larger ones use NCCL)", custom.max_size)
        return custom

    def _custom_all_reduce_problem(self) -> str | None:
        if self.device != "gpu":
            return f"it is GPU-only (device here: {self.device})"
        try:
            from fdlite.kernels.allreduce import custom_all_reduce as mod
        except ImportError as e:
            return f"fdlite.kernels.allreduce.custom_all_reduce is not in this build ({e})"
        if not mod.CustomAllReduce.is_available():
            why = getattr(mod, "unavailable_reason", lambda: "")()
            return "its CUDA library is not built" + (f": {why}" if why else "")
        return None

    def close(self) -> None:
        """Free this engine's custom all-reduce (its CUDA buffers and peer mappings). Local, no collective. The
        process groups stay: Paddle cannot make them again in this process, and another engine may use them."""
        custom, self.custom = self.custom, None
        if custom is not None:
            unregister_capture_participant(custom)
            custom.close()

    # ---- collectives -----------------------------------------------------------------------

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        """Sum of `x` over the ranks (in place on the NCCL/gloo path)."""
        if self.custom is not None and self.custom.should_use(math.prod(x.shape) * x.element_size()):
            # Out of place: inside a CUDA-graph capture the kernel then reads `x` where it lies.
            return self.custom.all_reduce(x, paddle.empty_like(x))
        import paddle.distributed as dist

        if self.device == "gpu":
            # On the compute stream: no cross-stream events, so a CUDA graph can capture it.
            group = {"group": self.group} if self.group is not None else {}
            dist.stream.all_reduce(x, use_calc_stream=True, **group)
        else:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_axis(self, x: paddle.Tensor) -> paddle.Tensor:
        """Every rank's `x` concatenated along the last axis, in rank order (on every rank)."""
        import paddle.distributed as dist

        parts: list[paddle.Tensor] = []
        dist.all_gather(parts, x, group=self.group)
        return paddle.concat(parts, axis=-1)

    def broadcast_from_driver(self, x: paddle.Tensor) -> paddle.Tensor:
        import paddle.distributed as dist

        dist.broadcast(x, src=self.state.driver_rank, group=self.group)
        return x

    def reduce_int(self, value: int, op: str) -> int:
        """min / max of a Python int over the ranks."""
        import paddle.distributed as dist

        t = paddle.to_tensor([value], dtype="int64")
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def agree(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on every rank."""
        return bool(self.reduce_int(int(flag), "min"))

    def all_gather_bytes(self, blob: bytes) -> list[bytes]:
        """Each rank's bytes, in rank order (the custom all-reduce swaps IPC handles with it)."""
        import paddle.distributed as dist

        out: list = []
        dist.all_gather_object(out, blob, group=self.group)
        return list(out)


# ---- the process's tensor-parallel group, for the layers ---------------------------------------

_current: dict[str, Communicator | None] = {"comm": None}


def set_communicator(comm: Communicator | None) -> None:
    """Make `comm` the group the layers reduce over; its custom all-reduce (if any) takes part in graph capture."""
    old = _current["comm"]
    if old is not None and old.custom is not None:
        unregister_capture_participant(old.custom)
    _current["comm"] = comm
    if comm is not None and comm.custom is not None:
        # begin_capture() / end_capture(register=...) around every capture_custom_allreduce() (capture.py).
        register_capture_participant(comm.custom)


def get_communicator() -> Communicator | None:
    return _current["comm"]


@opaque_to_sot
def tensor_parallel_all_reduce(x: paddle.Tensor) -> paddle.Tensor:
    """Sum of a row-parallel layer's partial outputs over the ranks (identity with one rank)."""
    comm = _current["comm"]
    if comm is None or comm.world_size == 1:
        return x
    return comm.all_reduce(x)

