"""Python face of fdlite's CUDA-graph-safe custom all-reduce (fdlite/kernels/csrc).

Hand-written over ctypes rather than a framework binding: the same shared library
then serves Paddle (paddle_binding.cc links the same C ABI), the GPU test harness
(PyTorch/CuPy buffers) and the engine, and this module imports on machines with no
GPU, no CUDA and no built library, where `is_available()` is simply False.

The library is found through the environment variable FDLITE_OPS_LIB (a path to
libfdlite_allreduce.so or to the Paddle extension built by fdlite/kernels/setup_ops.py,
which exports the same C symbols), else fdlite/kernels/lib/libfdlite_allreduce.so
(tools/gpu/build_ops.sh puts it there), and loaded by fdlite/kernels/native.py. Loaded
by path (tools/gpu/allreduce_harness.py, where Paddle is missing), this module loads
native.py and fdlite/envs.py by path too.

Graph capture follows FastDeploy: inside `capture()` an out-of-place all-reduce on a
capturing stream reads its input where it lies, through a slot of a device-side
pointer table that is filled when the context exits (every rank exchanges the
addresses of the buffers its graph captured). Outside capture, and for in-place
calls, the input goes through a pre-registered staging buffer inside the kernel.
Messages above `max_size` (the staging size) or not a multiple of 16 bytes fall back
to the caller's NCCL path: `should_use()` decides.
"""
from __future__ import annotations

import contextlib
import ctypes
import sys
from pathlib import Path
from typing import Callable, Iterator, Sequence

if __package__:
    from fdlite.kernels import native
else:  # loaded by path: no import of the fdlite package (hence of Paddle)
    import importlib.util

    native = sys.modules.get("fdlite_native")
    if native is None:
        _spec = importlib.util.spec_from_file_location("fdlite_native",
                                                       Path(__file__).resolve().parent.parent / "native.py")
        native = sys.modules["fdlite_native"] = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(native)

LIB_ENV = native.ALLREDUCE_LIB_ENV
LIB_NAME = native.ALLREDUCE_LIB
ABI_VERSION = 2  # 2: fdar_gather
IPC_HANDLE_BYTES = 64
DEFAULT_STAGING_BYTES = 8 << 20  # FastDeploy's default max_size
SUPPORTED_WORLD_SIZES = (1, 2, 4, 8)
DTYPES = {"bfloat16": 0, "float16": 1, "float32": 2}
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}
ALGOS = {"auto": 0, "one_shot": 1, "two_shot": 2}
STATS = ("staging", "registered", "graph", "one_shot", "two_shot")
DEVICE_ERRORS = {1: "graph replayed before its buffers were registered", 2: "a peer never reached a barrier"}

# Allgather of one bytes object per rank, in rank order (e.g. over torch.distributed
# or Paddle's communicator); used to swap IPC handles at start and after captures.
Exchange = Callable[[bytes], Sequence[bytes]]

_vp, _int, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_pi, _pi64, _pvp = ctypes.POINTER(_int), ctypes.POINTER(_i64), ctypes.POINTER(_vp)
_pu32 = ctypes.POINTER(ctypes.c_uint32)
# name -> (restype, argtypes). tests/test_custom_allreduce_cpu.py checks this table
# against custom_all_reduce_capi.h, so the two cannot drift apart silently.
_SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "fdar_abi_version": (_int, []),
    "fdar_last_error": (ctypes.c_char_p, []),
    "fdar_device_count": (_int, [_pi]),
    "fdar_create": (_int, [_int, _int, _i64, _int, _pvp]),
    "fdar_destroy": (_int, [_vp]),
    "fdar_max_size": (_i64, [_vp]),
    "fdar_world": (_int, [_vp]),
    "fdar_rank": (_int, [_vp]),
    "fdar_max_blocks": (_int, [_vp]),
    "fdar_one_shot_max": (_i64, [_vp]),
    "fdar_set_one_shot_max": (_int, [_vp, _i64]),
    "fdar_ipc_handle": (_int, [_vp, _vp]),
    "fdar_open_peers_ipc": (_int, [_vp, _vp]),
    "fdar_shared_base": (_vp, [_vp]),
    "fdar_set_peers_local": (_int, [_vp, _pvp]),
    "fdar_buffer_ipc_meta": (_int, [_vp, _vp, _pi64]),
    "fdar_register_buffer_local": (_int, [_vp, _pvp]),
    "fdar_register_buffer_ipc": (_int, [_vp, _vp, _vp, _pi64]),
    "fdar_begin_capture": (_int, [_vp]),
    "fdar_end_capture": (_int, [_vp, _pi64]),
    "fdar_pending_buffers": (_int, [_vp, _pvp, _i64, _pi64]),
    "fdar_register_graph_local": (_int, [_vp, _pvp, _i64]),
    "fdar_register_graph_ipc": (_int, [_vp, _vp, _pi64, _i64]),
    "fdar_drop_pending": (_int, [_vp]),
    "fdar_all_reduce": (_int, [_vp, _vp, _vp, _i64, _int, _vp]),
    "fdar_all_reduce_ex": (_int, [_vp, _vp, _vp, _i64, _int, _vp, _int]),
    "fdar_gather": (_int, [_vp, _vp, _vp, _i64, _i64, _i64, _int, _vp]),
    "fdar_device_errors": (_int, [_vp, _pu32, _int]),
    "fdar_stats": (_int, [_vp, _pi64]),
    "fdar_blocks_per_sm": (_int, [_int, _pi]),
}


class CustomAllReduceError(RuntimeError):
    """A call into the library failed; `code` is a cudaError_t or an FDAR_E_* code."""

    def __init__(self, message: str, code: int = -1):
        super().__init__(message)
        self.code = code


def find_library() -> tuple[str | None, str]:
    """(path or None, how it was found or why not)."""
    path, why = native.named_library(LIB_ENV)
    if path is not None or why:
        return path, why
    here = native.LIB_DIR / LIB_NAME
    if here.is_file():
        return str(here), "next to the package"
    return None, f"no {LIB_NAME}: set ${LIB_ENV} or run tools/gpu/build_ops.sh"


class _Lib:
    """Thin pythonic layer over the C ABI: one method per call, errors raised.

    CustomAllReduce talks only to this layer, so CPU tests can stand a fake in for it.
    """

    def __init__(self, path: str):
        self.path = path
        self.c = native.load_ctypes(path, _SIGNATURES)  # AttributeError: library older than this module
        v = self.c.fdar_abi_version()
        if v != ABI_VERSION:
            raise CustomAllReduceError(f"{path}: ABI version {v}, this module speaks {ABI_VERSION}")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = (self.c.fdar_last_error() or b"").decode(errors="replace")
            raise CustomAllReduceError(f"{what} failed ({rc}): {msg}", rc)

    def device_count(self) -> int:
        n = _int(0)
        self._check(self.c.fdar_device_count(ctypes.byref(n)), "fdar_device_count")
        return n.value

    def create(self, rank: int, world: int, staging_bytes: int, max_blocks: int) -> int:
        ctx = _vp()
        self._check(self.c.fdar_create(rank, world, staging_bytes, max_blocks, ctypes.byref(ctx)), "fdar_create")
        return ctx.value

    def destroy(self, ctx: int) -> None:
        self.c.fdar_destroy(ctx)

    def max_size(self, ctx: int) -> int:
        return self.c.fdar_max_size(ctx)

    def one_shot_max(self, ctx: int) -> int:
        return self.c.fdar_one_shot_max(ctx)

    def set_one_shot_max(self, ctx: int, nbytes: int) -> None:
        self._check(self.c.fdar_set_one_shot_max(ctx, nbytes), "fdar_set_one_shot_max")

    def max_blocks(self, ctx: int) -> int:
        return self.c.fdar_max_blocks(ctx)

    def ipc_handle(self, ctx: int) -> bytes:
        buf = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        self._check(self.c.fdar_ipc_handle(ctx, buf), "fdar_ipc_handle")
        return buf.raw

    def open_peers_ipc(self, ctx: int, handles: Sequence[bytes]) -> None:
        blob = b"".join(handles)
        self._check(self.c.fdar_open_peers_ipc(ctx, blob), "fdar_open_peers_ipc")

    def shared_base(self, ctx: int) -> int:
        return self.c.fdar_shared_base(ctx)

    def set_peers_local(self, ctx: int, bases: Sequence[int]) -> None:
        arr = (_vp * len(bases))(*bases)
        self._check(self.c.fdar_set_peers_local(ctx, arr), "fdar_set_peers_local")

    def buffer_ipc_meta(self, ptr: int) -> tuple[bytes, int]:
        buf, off = ctypes.create_string_buffer(IPC_HANDLE_BYTES), _i64(0)
        self._check(self.c.fdar_buffer_ipc_meta(ptr, buf, ctypes.byref(off)), "fdar_buffer_ipc_meta")
        return buf.raw, off.value

    def register_buffer_local(self, ctx: int, ptrs: Sequence[int]) -> None:
        arr = (_vp * len(ptrs))(*ptrs)
        self._check(self.c.fdar_register_buffer_local(ctx, arr), "fdar_register_buffer_local")

    def register_buffer_ipc(self, ctx: int, own: int, handles: Sequence[bytes], offsets: Sequence[int]) -> None:
        offs = (_i64 * len(offsets))(*offsets)
        self._check(self.c.fdar_register_buffer_ipc(ctx, own, b"".join(handles), offs), "fdar_register_buffer_ipc")

    def begin_capture(self, ctx: int) -> None:
        self._check(self.c.fdar_begin_capture(ctx), "fdar_begin_capture")

    def end_capture(self, ctx: int) -> int:
        n = _i64(0)
        self._check(self.c.fdar_end_capture(ctx, ctypes.byref(n)), "fdar_end_capture")
        return n.value

    def pending_buffers(self, ctx: int) -> list[int]:
        n = _i64(0)
        self._check(self.c.fdar_pending_buffers(ctx, None, 0, ctypes.byref(n)), "fdar_pending_buffers")
        arr = (_vp * max(n.value, 1))()
        self._check(self.c.fdar_pending_buffers(ctx, arr, n.value, ctypes.byref(n)), "fdar_pending_buffers")
        return [arr[i] or 0 for i in range(n.value)]

    def register_graph_local(self, ctx: int, ptrs_rank_major: Sequence[int], n: int) -> None:
        arr = (_vp * max(len(ptrs_rank_major), 1))(*ptrs_rank_major)
        self._check(self.c.fdar_register_graph_local(ctx, arr, n), "fdar_register_graph_local")

    def register_graph_ipc(self, ctx: int, handles: Sequence[bytes], offsets: Sequence[int], n: int) -> None:
        offs = (_i64 * max(len(offsets), 1))(*offsets)
        self._check(self.c.fdar_register_graph_ipc(ctx, b"".join(handles), offs, n), "fdar_register_graph_ipc")

    def drop_pending(self, ctx: int) -> None:
        self._check(self.c.fdar_drop_pending(ctx), "fdar_drop_pending")

    def all_reduce(self, ctx: int, inp: int, out: int, numel: int, dtype: int, stream: int, algo: int) -> None:
        self._check(self.c.fdar_all_reduce_ex(ctx, inp, out, numel, dtype, stream, algo), "fdar_all_reduce")

    def gather(self, ctx: int, inp: int, out: int, rows: int, in_row_bytes: int, out_row_bytes: int, root: int,
               stream: int) -> None:
        self._check(self.c.fdar_gather(ctx, inp or None, out, rows, in_row_bytes, out_row_bytes, root, stream),
                    "fdar_gather")

    def device_errors(self, ctx: int, clear: bool) -> int:
        v = ctypes.c_uint32(0)
        self._check(self.c.fdar_device_errors(ctx, ctypes.byref(v), int(clear)), "fdar_device_errors")
        return v.value

    def stats(self, ctx: int) -> dict[str, int]:
        arr = (_i64 * len(STATS))()
        self._check(self.c.fdar_stats(ctx, arr), "fdar_stats")
        return dict(zip(STATS, arr))

    def blocks_per_sm(self, world: int) -> int:
        n = _int(0)
        self._check(self.c.fdar_blocks_per_sm(world, ctypes.byref(n)), "fdar_blocks_per_sm")
        return n.value


_loaded: dict[str, _Lib] = {}
_load_error: dict[str, str] = {}


def load_library(path: str | None = None) -> _Lib | None:
    """The library at `path` (default: find_library()), or None; unavailable_reason() says why."""
    if path is None:
        path, why = find_library()
        if path is None:
            _load_error[""] = why
            return None
    if path in _loaded:
        return _loaded[path]
    try:
        lib = _Lib(path)
    except (OSError, AttributeError, CustomAllReduceError) as e:
        _load_error[""] = _load_error[path] = f"{path}: {e}"
        return None
    _loaded[path] = lib
    return lib


def unavailable_reason() -> str:
    return _load_error.get("", "")


def size_ok(nbytes: int, max_size: int) -> bool:
    """The kernels move 16-byte vectors and stage at most max_size bytes."""
    return 0 < nbytes <= max_size and nbytes % 16 == 0


def pair_pending(per_rank: Sequence[Sequence[object]]) -> tuple[list[object], int]:
    """Rank-major list of every rank's recorded graph buffers, and the count per rank.

    Every rank must have captured the same all-reduces in the same order; otherwise
    slot i would join unrelated buffers (the CUDA 700 class of bugs in FastDeploy's
    SOT + graph work), so a mismatch is an error here, before anything is registered.
    """
    counts = [len(p) for p in per_rank]
    if len(set(counts)) > 1:
        raise CustomAllReduceError(f"ranks captured different numbers of custom all-reduces: {counts}")
    return [x for p in per_rank for x in p], (counts[0] if counts else 0)


def tensor_info(x) -> tuple[int, int, str]:
    """(device pointer, element count, dtype name) of a torch / paddle / cupy array."""
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        return int(x.data.ptr), int(x.size), str(x.dtype.name)
    if mod in ("torch", "paddle"):
        n = 1
        for d in x.shape:
            n *= int(d)
        return int(x.data_ptr()), n, str(x.dtype).rsplit(".", 1)[-1]
    raise TypeError(f"custom all-reduce takes torch, paddle or cupy arrays, got {type(x)!r}")


def current_stream(x) -> int:
    """The current stream of x's framework, as a cudaStream_t integer."""
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        import torch

        return int(torch.cuda.current_stream(x.device).cuda_stream)
    if mod == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    if mod == "paddle":
        import paddle

        stream = paddle.device.current_stream()
        # Paddle 3.x has `cuda_stream` on the stream; 2.6 only on its `stream_base`.
        return int(getattr(stream, "cuda_stream", None) or stream.stream_base.cuda_stream)
    raise TypeError(f"no stream for {type(x)!r}")


class CustomAllReduce:
    """One rank of a custom all-reduce group.

    With `exchange` (an allgather of bytes across the ranks' processes) peers are
    opened through CUDA IPC; with world_size 1 no exchange is needed (loopback).
    `local_group()` builds all ranks in one process instead (one GPU per rank with
    P2P, or the single-GPU simulation used by tools/gpu/allreduce_harness.py).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        exchange: Exchange | None = None,
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        max_blocks: int = 0,
        lib: _Lib | None = None,
        _defer_peers: bool = False,
    ):
        if world_size not in SUPPORTED_WORLD_SIZES:
            raise ValueError(f"world_size must be one of {SUPPORTED_WORLD_SIZES}, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.rank, self.world_size, self.exchange = rank, world_size, exchange
        self._lib = lib if lib is not None else load_library()
        if self._lib is None:
            raise CustomAllReduceError(f"custom all-reduce library unavailable: {unavailable_reason()}")
        self._ctx = self._lib.create(rank, world_size, staging_bytes, max_blocks)
        self.max_size = self._lib.max_size(self._ctx)
        self._capturing = False
        if _defer_peers:
            return
        if exchange is not None:
            handles = list(exchange(self._lib.ipc_handle(self._ctx)))
            if len(handles) != world_size:
                raise CustomAllReduceError(f"exchange returned {len(handles)} handles for world_size {world_size}")
            self._lib.open_peers_ipc(self._ctx, handles)
        elif world_size == 1:
            self._lib.set_peers_local(self._ctx, [self._lib.shared_base(self._ctx)])
        else:
            raise ValueError("world_size > 1 needs an exchange (or CustomAllReduce.local_group)")

    @classmethod
    def local_group(cls, world_size: int, **kw) -> list["CustomAllReduce"]:
        """All ranks in this process, peers by plain pointers (every rank's buffers on the
        current device: the single-GPU simulation; set devices yourself for P2P)."""
        group = [cls(r, world_size, None, _defer_peers=True, **kw) for r in range(world_size)]
        bases = [g._lib.shared_base(g._ctx) for g in group]
        for g in group:
            g._lib.set_peers_local(g._ctx, bases)
        return group

    @staticmethod
    def is_available(lib: _Lib | None = None) -> bool:
        """The library loads and sees at least one CUDA device."""
        lib = lib if lib is not None else load_library()
        if lib is None:
            return False
        try:
            return lib.device_count() > 0
        except CustomAllReduceError as e:
            _load_error[""] = str(e)
            return False

    def should_use(self, nbytes: int) -> bool:
        """Custom all-reduce for this message, or the caller's NCCL fallback.

        The same answer inside and outside capture: FastDeploy's `if capturing: return
        True` sent captured messages above max_size to the custom kernel (its CUDA 700s
        at large --max-num-batched-tokens).
        """
        return self._ctx is not None and size_ok(nbytes, self.max_size)

    @property
    def one_shot_max(self) -> int:
        return self._lib.one_shot_max(self._ctx)

    @one_shot_max.setter
    def one_shot_max(self, nbytes: int) -> None:
        self._lib.set_one_shot_max(self._ctx, nbytes)

    # --- buffers ----------------------------------------------------------------
    def register_buffer(self, ptr: int) -> None:
        """Register a long-lived input buffer (same role on every rank): no staging copy."""
        if self.exchange is None:
            if self.world_size != 1:
                raise ValueError("register_buffer across processes needs an exchange")
            self._lib.register_buffer_local(self._ctx, [ptr])
            return
        h, off = self._lib.buffer_ipc_meta(ptr)
        metas = [_split_meta(b, 1) for b in self.exchange(h + off.to_bytes(8, "little", signed=True))]
        self._lib.register_buffer_ipc(self._ctx, ptr, [m[0][0] for m in metas], [m[1][0] for m in metas])

    def begin_capture(self) -> None:
        """From now on, all-reduces on a capturing stream record their inputs."""
        self._lib.begin_capture(self._ctx)
        self._capturing = True

    def end_capture(self, register: bool = True) -> int:
        """Stop recording; with register, exchange and register what was recorded (all
        ranks together). Without, drop it (a failed capture). Returns the count."""
        self._capturing = False
        self._lib.end_capture(self._ctx)
        if not register:
            self._lib.drop_pending(self._ctx)
            return 0
        return self.register_graph_buffers()

    @contextlib.contextmanager
    def capture(self) -> Iterator["CustomAllReduce"]:
        """Wrap a CUDA-graph capture; on exit, register the captured inputs of all ranks.

        Every rank must enter and leave together (the exit exchanges addresses).
        """
        self.begin_capture()
        try:
            yield self
        except BaseException:
            self.end_capture(register=False)
            raise
        self.end_capture()

    def register_graph_buffers(self) -> int:
        """Exchange and register the inputs recorded by captures; returns how many."""
        own = self._lib.pending_buffers(self._ctx)
        if self.exchange is None:
            if self.world_size != 1:
                raise ValueError("graph registration across processes needs an exchange")
            flat, n = pair_pending([own])
            self._lib.register_graph_local(self._ctx, flat, n)
            return n
        metas = [self._lib.buffer_ipc_meta(p) for p in own]
        blob = b"".join(h + off.to_bytes(8, "little", signed=True) for h, off in metas)
        per_rank = [_split_meta(b, len(b) // (IPC_HANDLE_BYTES + 8)) for b in self.exchange(blob)]
        pairs, n = pair_pending([list(zip(*m)) for m in per_rank])
        self._lib.register_graph_ipc(self._ctx, [h for h, _ in pairs], [o for _, o in pairs], n)
        return n

    # --- the collective ------------------------------------------------------------
    def all_reduce(self, inp, out=None, *, stream: int | None = None, algo: str = "auto"):
        """out = sum over ranks of inp (torch / paddle / cupy arrays on this rank's GPU).

        out defaults to inp (in place, through the staging buffer). Inside capture()
        pass a separate out so the graph reads inp directly.
        """
        if out is None:
            out = inp
        ip, n, dt = tensor_info(inp)
        op, n_out, dt_out = tensor_info(out)
        if (n, dt) != (n_out, dt_out):
            raise ValueError(f"out must match inp: {(n, dt)} vs {(n_out, dt_out)}")
        if dt not in DTYPES:
            raise TypeError(f"custom all-reduce supports {sorted(DTYPES)}, got {dt}")
        if stream is None:
            stream = current_stream(inp)
        self.all_reduce_ptr(ip, op, n, dt, stream, algo)
        return out

    def all_reduce_ptr(self, inp: int, out: int, numel: int, dtype: str, stream: int, algo: str = "auto") -> None:
        self._lib.all_reduce(self._ctx, inp, out, numel, DTYPES[dtype], stream, ALGOS[algo])

    def gather_ptr(self, inp: int, out: int, rows: int, in_row_bytes: int, out_row_bytes: int, root: int,
                   stream: int) -> None:
        """All-gather (root -1) or broadcast from `root` of `rows` rows through the staging buffers, eager or
        inside a capture alike (fdar_gather): `rows * in_row_bytes` at most `max_size`; callers split larger ones."""
        self._lib.gather(self._ctx, inp, out, rows, in_row_bytes, out_row_bytes, root, stream)

    # --- diagnostics -----------------------------------------------------------------
    def device_errors(self, clear: bool = False) -> list[str]:
        bits = self._lib.device_errors(self._ctx, clear)
        return [msg for bit, msg in DEVICE_ERRORS.items() if bits & bit]

    def stats(self) -> dict[str, int]:
        return self._lib.stats(self._ctx)

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self._lib.destroy(self._ctx)
            self._ctx = None

    def __del__(self):  # best effort; call close() after the device is idle
        try:
            self.close()
        except Exception:
            pass


def _split_meta(blob: bytes, n: int) -> tuple[list[bytes], list[int]]:
    """n records of (64-byte IPC handle, little-endian int64 offset)."""
    step = IPC_HANDLE_BYTES + 8
    if len(blob) != n * step:
        raise CustomAllReduceError(f"IPC metadata of {len(blob)} bytes, expected {n} records of {step}")
    hs = [blob[i * step: i * step + IPC_HANDLE_BYTES] for i in range(n)]
    offs = [int.from_bytes(blob[i * step + IPC_HANDLE_BYTES: (i + 1) * step], "little", signed=True) for i in range(n)]
    return hs, offs


@contextlib.contextmanager
def capture_local_group(group: Sequence[CustomAllReduce]) -> Iterator[Sequence[CustomAllReduce]]:
    """capture() for a local_group: all ranks begin together, register together."""
    for g in group:
        g._lib.begin_capture(g._ctx)
        g._capturing = True
    try:
        yield group
    except BaseException:
        for g in group:
            g._capturing = False
            g._lib.end_capture(g._ctx)
            g._lib.drop_pending(g._ctx)
        raise
    for g in group:
        g._capturing = False
        g._lib.end_capture(g._ctx)
    register_local_group(group)


def register_buffer_local_group(group: Sequence[CustomAllReduce], ptrs: Sequence[int]) -> None:
    """register_buffer for a local_group: ptrs[r] is rank r's buffer."""
    for g in group:
        g._lib.register_buffer_local(g._ctx, list(ptrs))


def register_local_group(group: Sequence[CustomAllReduce]) -> int:
    flat, n = pair_pending([g._lib.pending_buffers(g._ctx) for g in group])
    for g in group:
        g._lib.register_graph_local(g._ctx, flat, n)
    return n
