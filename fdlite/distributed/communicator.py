"""The collectives of the tensor-parallel group: NCCL (GPU) or gloo (CPU) through `paddle.distributed`,
or fdlite's custom all-reduce when asked for and built.

Layers call `tensor_parallel_all_reduce(x)`, a module function rather than a method on something the
layer holds: SOT must see one fixed function to keep out of its graphs (it is an opaque graph break,
like attention: `graph/graph_break.py`), and there is one tensor-parallel group per process anyway.

`enable_custom_all_reduce` (FastDeploy's option, on by default on a GPU) uses
`custom_all_reduce.CustomAllReduce` (fdlite's CUDA all-reduce, fdlite/kernels/csrc) for messages it accepts
(`should_use`) up to the size where it stops beating NCCL (timed at startup, `custom_max_bytes`), NCCL for the
rest. When that module or its CUDA library is missing, or the device is a
CPU, one log line says so and everything goes through `paddle.distributed`. All ranks agree on the
choice (an all-reduce of each rank's answer) before any layer runs: a rank on the custom path and one
on NCCL would wait on each other forever.

On a GPU the step's other two collectives go through the same library's staging buffers too (`fdar_gather`):
the logits' vocabulary all-gather, written straight into [tokens, vocab] (Paddle's concat and column
slice are built-in kernels with no sm_90 code), and rank 0's sampled ids, broadcast on the device. Ranks
that share one GPU (gloo group, `parallel_state.py`) have no NCCL at all: the custom library is then
required, and messages above its staging size go through it in pieces. The host's own collectives
(`reduce_int`, `all_gather_bytes`, ...) run on CPU tensors there, as gloo needs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import pickle

import paddle

from fdlite.distributed.parallel_state import ParallelState
from fdlite.graph.graph_break import opaque_to_sot
from fdlite.kernels import gpu as gpu_ops
from fdlite.kernels.allreduce.capture import register_capture_participant, unregister_capture_participant

logger = logging.getLogger("fdlite")


class Communicator:
    """The tensor-parallel group's collectives; owns this engine's custom all-reduce (if any)."""

    def __init__(self, state: ParallelState, device: str, enable_custom_all_reduce: bool | None = None):
        self.state = state
        self.device = device
        # No NCCL: GPU ranks in a gloo group (they may share a GPU). Every device collective is then custom.
        self.custom_only = device == "gpu" and state.world_size > 1 and state.backend == "gloo"
        self.ranks_on_device = self._ranks_on_this_device()
        if self.custom_only and enable_custom_all_reduce is False:
            raise ValueError("tensor-parallel ranks in a gloo group (device='gpu:N' in every process) have no NCCL: "
                             "they need enable_custom_all_reduce=True")
        # None (the default): on where there is something to reduce on a GPU, and silent where there is not.
        asked = enable_custom_all_reduce is True
        wanted = asked or (enable_custom_all_reduce is None and device == "gpu" and state.world_size > 1)
        self.custom_max_bytes = None  # largest message for the custom kernel when NCCL is there too (measured)
        self.custom = self._start_custom_all_reduce(loud=asked) if wanted else None
        if self.custom_only and self.custom is None:
            raise RuntimeError("tensor-parallel ranks in a gloo group (device='gpu:N' in every process) need fdlite's "
                               "custom all-reduce (NCCL cannot run two ranks on one GPU), and it could not start "
                               "(the warning above says why)")

    @property
    def world_size(self) -> int:
        return self.state.world_size

    @property
    def group(self):
        """The paddle group of this tensor-parallel group (None: the whole launch is one group)."""
        return self.state.group

    @contextlib.contextmanager
    def _host_tensors(self):
        """Collectives of host values on a gloo group from a GPU process: their tensors must be CPU tensors
        (Paddle makes them on the expected place, the GPU)."""
        if self.device != "gpu" or self.state.backend != "gloo":
            yield
            return
        from paddle.framework import _current_expected_place, _set_expected_place  # noqa: PLC0415

        place = _current_expected_place()
        _set_expected_place(paddle.CPUPlace())
        try:
            yield
        finally:
            _set_expected_place(place)

    def broadcast_object(self, obj):
        """The driver's `obj` on every rank of the group (the driver passes it, the others anything)."""
        import paddle.distributed as dist

        box = [obj if self.state.is_driver else None]
        with self._host_tensors():
            dist.broadcast_object_list(box, src=self.state.driver_rank, group=self.group)
        return box[0]

    def _ranks_on_this_device(self) -> int:
        """How many ranks of the group compute on this process's GPU (1 on CPU): they split its memory."""
        if self.device != "gpu" or self.world_size == 1:
            return 1
        import socket  # noqa: PLC0415

        where = (socket.gethostname(), paddle.framework._current_expected_place().get_device_id())
        return sum(pickle.loads(b) == where for b in self.all_gather_bytes(pickle.dumps(where)))

    @property
    def backend(self) -> str:
        return f"custom+{self.state.backend}" if self.custom is not None else self.state.backend

    # ---- custom all-reduce -----------------------------------------------------------------

    def _start_custom_all_reduce(self, loud: bool = True):
        """The custom all-reduce, or None after one log line saying why not (the same answer on every rank): a
        warning when the user asked for it (`loud`), else an info line."""
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
            (logger.warning if loud else logger.info)(
                "enable_custom_all_reduce=%s, but the custom all-reduce cannot be used: %s; %s",
                "True" if loud else "None (on by default on a GPU)", reason, fallback)
            return None
        if self.custom_only:
            logger.info("custom all-reduce on for every message (no NCCL in a gloo group: larger ones than its %d-byte "
                        "buffer go in pieces)", custom.max_size)
        elif self.device == "gpu" and self.world_size > 1:
            self.custom_max_bytes = self._measure_custom_max_bytes(custom)
        else:
            logger.info("custom all-reduce on (messages up to %d bytes; larger ones use NCCL)", custom.max_size)
        return custom

    def _measure_custom_max_bytes(self, custom) -> int:
        """Time the custom kernel and NCCL on bf16 messages of `MEASURED_SIZES` bytes (each the median of a few
        calls, the slowest rank's) and return the largest size up to which the custom one is not slower; one log
        line with the numbers. Ranks on distinct GPUs only (where both run), once per engine."""
        import paddle.distributed as dist  # noqa: PLC0415

        sizes = [n for n in MEASURED_SIZES if custom.should_use(n)]
        group = {"group": self.group} if self.group is not None else {}
        x = paddle.empty([max(sizes) // 2], dtype="bfloat16")
        gpu_ops.fill_(x, 0.0)

        def timed(call, n: int) -> float:
            view = x[: n // 2]
            return _median_us(lambda: call(view))

        ours = [timed(lambda v: custom.all_reduce(v, paddle.empty_like(v), stream=gpu_ops.current_stream_handle()), n)
                for n in sizes]
        nccl = [timed(lambda v: dist.stream.all_reduce(v, use_calc_stream=True, **group), n) for n in sizes]
        slowest = [self.reduce_int(int(t * 1000), "max") / 1000 for t in ours + nccl]
        ours, nccl = slowest[: len(sizes)], slowest[len(sizes):]
        limit = custom_max_bytes(sizes, ours, nccl)
        logger.info("custom all-reduce on for messages up to %d bytes, NCCL above (measured, us, custom vs NCCL: %s)",
                    limit, ", ".join(f"{n >> 10} KiB {a:.1f} vs {b:.1f}" for n, a, b in zip(sizes, ours, nccl)))
        return limit

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
        nbytes = math.prod(x.shape) * x.element_size()
        if self.custom is not None and self.custom.should_use(nbytes) and (
                self.custom_max_bytes is None or nbytes <= self.custom_max_bytes):
            # Out of place: inside a CUDA-graph capture the kernel then reads `x` where it lies.
            return self.custom.all_reduce(x, paddle.empty_like(x), stream=gpu_ops.current_stream_handle())
        if self.custom_only:
            return self._all_reduce_in_pieces(x, nbytes)
        import paddle.distributed as dist

        if self.device == "gpu":
            # On the compute stream: no cross-stream events, so a CUDA graph can capture it.
            group = {"group": self.group} if self.group is not None else {}
            dist.stream.all_reduce(x, use_calc_stream=True, **group)
        else:
            dist.all_reduce(x, group=self.group)
        return x

    def _all_reduce_in_pieces(self, x: paddle.Tensor, nbytes: int) -> paddle.Tensor:
        """The custom all-reduce of a message above its staging size, as consecutive pieces of at most that size
        (ranks without NCCL); out of place, like the one-piece path, so a capture reads `x` where it lies."""
        from fdlite.kernels.allreduce.custom_all_reduce import DTYPE_SIZES  # noqa: PLC0415

        dtype = str(x.dtype).rsplit(".", 1)[-1]
        if dtype not in DTYPE_SIZES or nbytes % 16:
            raise ValueError(f"the custom all-reduce takes {sorted(DTYPE_SIZES)} messages of a multiple of 16 bytes; "
                             f"got {dtype}, {nbytes} bytes, and these ranks have no NCCL to fall back on")
        out = paddle.empty_like(x)
        piece = self.custom.max_size // 16 * 16
        stream = gpu_ops.current_stream_handle()
        size = DTYPE_SIZES[dtype]
        for start in range(0, nbytes, piece):
            n = min(piece, nbytes - start)
            self.custom.all_reduce_ptr(x.data_ptr() + start, out.data_ptr() + start, n // size, dtype, stream)
        return out

    def all_gather_last_axis(self, x: paddle.Tensor, columns: int | None = None) -> paddle.Tensor:
        """Every rank's `x` ([rows, c]) side by side in rank order, on every rank: [rows, columns], the first
        `columns` (default all W * c) of the gathered ones (a padded vocabulary's tail dropped)."""
        width = x.shape[-1] * self.world_size
        columns = width if columns is None else columns
        if self.device == "gpu":
            return self._gather_on_device(x, columns)
        import paddle.distributed as dist

        parts: list[paddle.Tensor] = []
        dist.all_gather(parts, x, group=self.group)
        full = paddle.concat(parts, axis=-1)
        return full[:, :columns] if columns != width else full

    def _gather_on_device(self, x: paddle.Tensor, columns: int) -> paddle.Tensor:
        """all_gather_last_axis on a GPU: fdlite's gather kernel over the custom all-reduce's staging buffers,
        rows in pieces that fit them, written straight into the [rows, columns] output."""
        if self.custom is None:
            raise RuntimeError("the vocabulary all-gather on a GPU runs on fdlite's custom all-reduce library, which "
                               "is off or could not start here (see the warning at startup)")
        rows, c = x.shape
        out = paddle.empty([rows, columns], dtype=x.dtype)
        row_in, row_out = c * x.element_size(), columns * x.element_size()
        step = max(1, self.custom.max_size // row_in)
        stream = gpu_ops.current_stream_handle()
        for start in range(0, rows, step):
            n = min(step, rows - start)
            self.custom.gather_ptr(x.data_ptr() + start * row_in, out.data_ptr() + start * row_out, n, row_in,
                                   row_out, -1, stream)
        return out

    def broadcast_from_driver(self, x: paddle.Tensor) -> paddle.Tensor:
        """The driver's `x` in `x` on every rank. On a GPU with the custom library: through its staging buffers
        on the device (no host round trip, no NCCL); otherwise `paddle.distributed.broadcast`."""
        if self.device == "gpu" and self.custom is not None:
            nbytes = math.prod(x.shape) * x.element_size()
            out = paddle.empty_like(x)
            src = x.data_ptr() if self.state.is_driver else 0
            self.custom.gather_ptr(src, out.data_ptr(), 1, nbytes, nbytes, 0, gpu_ops.current_stream_handle())
            return out
        import paddle.distributed as dist

        dist.broadcast(x, src=self.state.driver_rank, group=self.group)
        return x

    def reduce_int(self, value: int, op: str) -> int:
        """min / max of a Python int over the ranks."""
        import paddle.distributed as dist

        with self._host_tensors():
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
        with self._host_tensors():
            dist.all_gather_object(out, blob, group=self.group)
        return list(out)


# ---- the custom kernel or NCCL, by message size ------------------------------------------------------------

MEASURED_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20)  # bytes: decode steps to large prefill chunks


def custom_max_bytes(sizes: list[int], custom_us: list[float], nccl_us: list[float]) -> int:
    """The largest of `sizes` (ascending) up to which the custom all-reduce is never slower than NCCL; 0 when it is
    slower already at the smallest (then NCCL takes every message)."""
    limit = 0
    for n, ours, theirs in zip(sizes, custom_us, nccl_us):
        if ours > theirs:
            break
        limit = n
    return limit


def _median_us(call, reps: int = 7) -> float:
    """Median device time of `call()` over `reps` runs after one warm-up, in microseconds (fdlite's CUDA events:
    Paddle 2.6's Event.elapsed_time returns 0)."""
    lib = gpu_ops.capi()
    start, end = lib.fdl_event_create(), lib.fdl_event_create()
    call()
    times = []
    try:
        for _ in range(reps):
            stream = gpu_ops.current_stream_handle()
            lib.fdl_event_record(start, stream)
            call()
            lib.fdl_event_record(end, stream)
            times.append(lib.fdl_event_elapsed_ms(start, end) * 1000.0)
    finally:
        lib.fdl_event_destroy(start)
        lib.fdl_event_destroy(end)
    return sorted(times)[len(times) // 2]


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

