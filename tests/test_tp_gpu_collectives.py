"""The GPU path's tensor-parallel collectives, host side (issue 27): what `Communicator` asks fdlite's custom
all-reduce library to move, checked on CPU tensors with a stand-in library that moves real bytes.

The stand-in plays rank 0 of 2 whose peer holds its own data plus 1000: an all-reduce sums to 2x + 1000, an
all-gather puts x and x + 1000 side by side, a broadcast from the driver gives the driver's bytes. So a piece
that starts at a wrong offset, a row written at a wrong stride or a dropped tail shows in the values. The device
run (tools/gpu/e2e_harness.py, section tp) checks the kernels themselves.
"""

from __future__ import annotations

import ctypes

import numpy as np
import paddle
import pytest

from fdlite.config import EngineConfig
from fdlite.distributed import communicator as comm_mod
from fdlite.distributed.communicator import Communicator, custom_max_bytes
from fdlite.distributed.lockstep import share_sampled_tokens
from fdlite.distributed.parallel_state import ParallelState, control_backend
from fdlite.kernels import gpu as gpu_ops
from fdlite.sample.sampler import SamplerOutput

PEER_OFFSET = 1000.0


def _view(ptr: int, nbytes: int, dtype) -> np.ndarray:
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


class PeerPlusConstant:
    """A 2-rank custom all-reduce whose other rank's data is this rank's plus PEER_OFFSET (float32 only)."""

    world_size = 2

    def __init__(self, rank: int, max_size: int):
        self.rank, self.max_size, self.calls = rank, max_size, []

    def should_use(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.max_size and nbytes % 16 == 0

    def all_reduce_ptr(self, inp, out, numel, dtype, stream, algo="auto"):
        assert dtype == "float32" and numel * 4 <= self.max_size
        self.calls.append(("all_reduce", numel))
        _view(out, numel * 4, np.float32)[:] = 2 * _view(inp, numel * 4, np.float32) + PEER_OFFSET

    def all_reduce(self, inp, out, stream=None):  # the one-piece path: CustomAllReduce.all_reduce on tensors
        self.all_reduce_ptr(inp.data_ptr(), out.data_ptr(), int(np.prod(inp.shape)), "float32", 0)
        return out

    def gather_ptr(self, inp, out, rows, in_row_bytes, out_row_bytes, root, stream):
        assert rows * in_row_bytes <= self.max_size, "a piece above the staging size"
        self.calls.append(("gather", rows, root))
        if root >= 0:  # broadcast: rank 0's bytes; a non-root passes no input
            assert (inp != 0) == (root == self.rank)
            src = _view(inp, rows * in_row_bytes, np.uint8) if inp else np.full(rows * in_row_bytes, 7, np.uint8)
            _view(out, rows * out_row_bytes, np.uint8)[:] = src[: rows * out_row_bytes]
            return
        c = in_row_bytes // 4
        mine = _view(inp, rows * in_row_bytes, np.float32).reshape(rows, c)
        full = np.concatenate([mine, mine + PEER_OFFSET] if self.rank == 0 else [mine - PEER_OFFSET, mine], axis=1)
        out_view = _view(out, rows * out_row_bytes, np.float32).reshape(rows, out_row_bytes // 4)
        out_view[:] = full[:, : out_row_bytes // 4]


@pytest.fixture
def make_comm(monkeypatch):
    monkeypatch.setattr(gpu_ops, "current_stream_handle", lambda: 0)
    monkeypatch.setattr(Communicator, "_ranks_on_this_device", lambda self: 2)

    def make(max_size: int, rank: int = 0, backend: str = "gloo") -> Communicator:
        fake = PeerPlusConstant(rank, max_size)
        monkeypatch.setattr(Communicator, "_start_custom_all_reduce", lambda self, loud=True: fake)
        return Communicator(ParallelState(rank, 2, backend), "gpu", enable_custom_all_reduce=True)
    return make


def test_ranks_sharing_a_gpu_all_reduce_above_the_staging_size_in_pieces(make_comm):
    comm = make_comm(max_size=256)
    assert comm.custom_only and comm.ranks_on_device == 2
    x = paddle.to_tensor(np.arange(3 * 48, dtype=np.float32).reshape(3, 48))  # 576 bytes: pieces of 256, 256, 64
    y = comm.all_reduce(x)
    np.testing.assert_array_equal(y.numpy(), 2 * x.numpy() + PEER_OFFSET)
    assert comm.custom.calls == [("all_reduce", 64), ("all_reduce", 64), ("all_reduce", 16)]
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        comm.all_reduce(paddle.ones([3, 3]))  # 36 bytes: not the kernels' 16-byte vectors, and no NCCL here
    comm.custom.max_size = 4096
    comm.custom.calls.clear()
    np.testing.assert_array_equal(comm.all_reduce(x).numpy(), 2 * x.numpy() + PEER_OFFSET)
    assert comm.custom.calls == [("all_reduce", 144)]  # one piece when it fits


@pytest.mark.parametrize("rank", [0, 1])
def test_vocabulary_all_gather_writes_rows_of_the_unpadded_width(make_comm, rank):
    comm = make_comm(max_size=3 * 40 * 4, rank=rank)  # 3 rows of 40 columns per piece
    x = paddle.to_tensor(np.random.default_rng(rank).standard_normal((8, 40)).astype(np.float32))
    got = comm.all_gather_last_axis(x, 77).numpy()  # 80 gathered columns, the last 3 are vocabulary padding
    mine = x.numpy()
    parts = [mine, mine + PEER_OFFSET] if rank == 0 else [mine - PEER_OFFSET, mine]
    np.testing.assert_array_equal(got, np.concatenate(parts, axis=1)[:, :77])
    assert [c[1] for c in comm.custom.calls] == [3, 3, 2]


def test_sampled_ids_are_broadcast_on_the_device(make_comm, monkeypatch):
    monkeypatch.setattr(gpu_ops, "to_host", lambda t: t.numpy())
    driver = make_comm(max_size=1024, rank=0)
    ids = paddle.to_tensor(np.array([5, 17, 3], dtype=np.int64))
    out = share_sampled_tokens(driver, SamplerOutput(token_ids=[5, 17, 3], device_tokens=ids))
    assert out.token_ids == [5, 17, 3] and driver.custom.calls == [("gather", 1, 0)]
    other = make_comm(max_size=1024, rank=1)
    got = share_sampled_tokens(other, None, 3)
    # Rank 1 gets the driver's bytes (the stand-in's fill here) on the device and on the host.
    want = np.frombuffer(bytes([7]) * 24, dtype=np.int64).tolist()
    assert got.token_ids == want and got.device_tokens.numpy().tolist() == want
    assert other.custom.calls == [("gather", 1, 0)]


def test_ranks_sharing_a_gpu_need_the_custom_library(monkeypatch):
    monkeypatch.setattr(Communicator, "_ranks_on_this_device", lambda self: 2)
    with pytest.raises(ValueError, match="need enable_custom_all_reduce=True"):
        Communicator(ParallelState(0, 2, "gloo"), "gpu", enable_custom_all_reduce=False)
    monkeypatch.setattr(Communicator, "_start_custom_all_reduce", lambda self, loud=True: None)
    with pytest.raises(RuntimeError, match="NCCL cannot run two ranks on one GPU"):
        Communicator(ParallelState(0, 2, "gloo"), "gpu", enable_custom_all_reduce=True)


def test_control_backend(monkeypatch):
    monkeypatch.delenv("PADDLE_DISTRI_BACKEND", raising=False)
    assert control_backend("cpu", False) == "gloo"
    assert control_backend("gpu", False) == "nccl"  # one GPU per rank, as the launcher assigns them
    assert control_backend("gpu", True) == "gloo"  # device="gpu:N": ranks may share it
    monkeypatch.setenv("PADDLE_DISTRI_BACKEND", "nccl")
    assert control_backend("gpu", True) == "nccl"


def test_custom_all_reduce_is_on_by_default_for_gpu_ranks_only(monkeypatch, caplog):
    started = []
    monkeypatch.setattr(Communicator, "_ranks_on_this_device", lambda self: 1)
    monkeypatch.setattr(Communicator, "_start_custom_all_reduce", lambda self, loud=True: started.append(loud))
    Communicator(ParallelState(0, 2, "nccl"), "gpu")  # the default on a GPU group: tried, quietly
    Communicator(ParallelState(0, 2, "nccl"), "gpu", enable_custom_all_reduce=True)  # asked: loud
    Communicator(ParallelState(0, 2, "nccl"), "gpu", enable_custom_all_reduce=False)
    Communicator(ParallelState(0, 1, "none"), "gpu")  # one process: nothing to reduce
    Communicator(ParallelState(0, 2, "gloo"), "cpu")  # CPU: gloo
    assert started == [False, True]
    with pytest.raises(ValueError, match="enable_custom_all_reduce must be a bool"):
        EngineConfig(enable_custom_all_reduce="yes")


def test_host_collectives_of_gpu_ranks_on_gloo_use_cpu_tensors(make_comm, monkeypatch):
    """Paddle makes a collective's tensors on the expected place (the GPU); gloo takes CPU tensors only."""
    comm = make_comm(max_size=256)
    places = []
    monkeypatch.setattr(paddle.framework, "_current_expected_place", lambda: "the GPU place")
    monkeypatch.setattr(paddle.framework, "_set_expected_place", places.append)
    monkeypatch.setattr(paddle.distributed, "all_reduce",
                        lambda t, op=None, group=None: places.append(("all_reduce", t.place.is_cpu_place())))
    assert comm.reduce_int(3, "min") == 3
    assert places[1] == ("all_reduce", True) and places[-1] == "the GPU place"
    assert isinstance(places[0], paddle.CPUPlace)


def test_custom_or_nccl_by_measured_message_size():
    """Ranks on distinct GPUs (NCCL there too) measure both at startup and keep the custom kernel up to the largest
    size where it is not slower."""
    sizes = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    assert custom_max_bytes(sizes, [5, 9, 20, 70], [20, 22, 25, 60]) == 1 << 20
    assert custom_max_bytes(sizes, [5, 9, 20, 50], [20, 22, 25, 60]) == 4 << 20
    assert custom_max_bytes(sizes, [30, 9, 20, 50], [20, 22, 25, 60]) == 0  # slower at once: NCCL for everything


def test_measured_limit_sends_larger_messages_to_nccl(make_comm, monkeypatch):
    comm = make_comm(max_size=4096, backend="nccl")
    comm.custom_only = False
    comm.custom_max_bytes = 256
    sent = []
    monkeypatch.setattr(paddle.distributed.stream, "all_reduce", lambda x, use_calc_stream, **k: sent.append(x.shape))
    comm.all_reduce(paddle.ones([4, 16]))  # 256 bytes: custom
    comm.all_reduce(paddle.ones([4, 32]))  # 512 bytes: measured slower there, NCCL
    assert comm.custom.calls == [("all_reduce", 64)] and sent == [[4, 32]]
