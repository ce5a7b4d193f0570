"""CPU-side tests of the custom all-reduce's Python face (no GPU, no CUDA needed).

The kernels themselves are tested on the GPU machine by tools/gpu/allreduce_harness.py;
here: the ctypes signature table against the C header, the loader's behaviour with no
or a broken library, the size / fallback rule, and the capture bookkeeping (who is
told what, in which order) with a fake library standing in for the C ABI.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fdlite.kernels.allreduce import custom_all_reduce as car

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "fdlite" / "kernels" / "csrc" / "custom_all_reduce_capi.h"


# --- the C header and the ctypes table ------------------------------------------------

def _header_prototypes() -> dict[str, tuple[str, list[str]]]:
    text = re.sub(r"/\*.*?\*/", " ", HEADER.read_text(), flags=re.S)
    protos = {}
    for m in re.finditer(r"FDAR_API\s+([\w\s\*]+?)\s*\b(fdar_\w+)\s*\(([^)]*)\)\s*;", text):
        ret, name, args = m.group(1).strip(), m.group(2), m.group(3).strip()
        params = [] if args in ("", "void") else [a.strip() for a in args.split(",")]
        protos[name] = (ret, params)
    return protos


def _ctype_matches(c_decl: str, ct) -> bool:
    decl = c_decl.replace("const", "").strip()
    if "*" in decl:
        return ct in (ctypes.c_void_p, ctypes.c_char_p) or (isinstance(ct, type) and issubclass(ct, ctypes._Pointer))
    base = decl.split()[0]
    return {"int": ctypes.c_int, "int64_t": ctypes.c_int64}.get(base) is ct


def test_signature_table_matches_header():
    protos = _header_prototypes()
    assert len(protos) >= 25, "header parse found too few prototypes"
    assert set(protos) == set(car._SIGNATURES), set(protos) ^ set(car._SIGNATURES)
    for name, (ret, params) in protos.items():
        res, args = car._SIGNATURES[name]
        assert len(params) == len(args), f"{name}: {len(params)} C params vs {len(args)} ctypes"
        assert _ctype_matches(ret + (" x" if "*" not in ret else ""), res), f"{name}: return {ret} vs {res}"
        for p, a in zip(params, args):
            assert _ctype_matches(p, a), f"{name}: param {p!r} vs {a}"


def test_header_constants_match_python():
    text = HEADER.read_text()
    consts = dict(re.findall(r"#define (FDAR_\w+) (\d+)", text))
    assert int(consts["FDAR_ABI_VERSION"]) == car.ABI_VERSION
    assert int(consts["FDAR_IPC_HANDLE_BYTES"]) == car.IPC_HANDLE_BYTES
    assert {k: int(consts["FDAR_" + v]) for k, v in
            {"bfloat16": "BF16", "float16": "FP16", "float32": "FP32"}.items()} == car.DTYPES
    assert [int(consts[f"FDAR_ALGO_{a.upper()}"]) for a in car.ALGOS] == list(car.ALGOS.values())
    assert [int(consts[f"FDAR_STAT_{s.upper()}"]) for s in car.STATS] == list(range(len(car.STATS)))


# --- loader ------------------------------------------------------------------------------

def test_missing_library_is_reported_not_raised(monkeypatch, tmp_path):
    missing = tmp_path / "nope.so"
    monkeypatch.setenv(car.LIB_ENV, str(missing))
    assert car.find_library() == (None, f"${car.LIB_ENV}={missing} does not exist")
    assert car.load_library() is None
    assert str(missing) in car.unavailable_reason()
    assert car.CustomAllReduce.is_available() is False
    with pytest.raises(car.CustomAllReduceError, match="unavailable"):
        car.CustomAllReduce(0, 1)


def test_broken_library_is_reported_not_raised(monkeypatch, tmp_path):
    bad = tmp_path / "libfdlite_allreduce.so"
    bad.write_bytes(b"not an ELF file")
    monkeypatch.setenv(car.LIB_ENV, str(bad))
    assert car.find_library()[0] == str(bad)
    assert car.load_library() is None
    assert str(bad) in car.unavailable_reason()
    assert car.CustomAllReduce.is_available() is False


def test_size_rule():
    m = 8 << 20
    assert car.size_ok(16, m) and car.size_ok(4096, m) and car.size_ok(m, m)
    assert not car.size_ok(0, m)
    assert not car.size_ok(8, m)          # below one 16-byte vector
    assert not car.size_ok(4096 + 8, m)   # not a whole number of vectors
    assert not car.size_ok(m + 16, m)     # above the staging buffer: NCCL fallback


def test_pair_pending_rank_major_and_mismatch():
    flat, n = car.pair_pending([[1, 2, 3], [11, 12, 13]])
    assert (flat, n) == ([1, 2, 3, 11, 12, 13], 3)
    assert car.pair_pending([]) == ([], 0)
    with pytest.raises(car.CustomAllReduceError, match=r"\[2, 3\]"):
        car.pair_pending([[1, 2], [11, 12, 13]])


def test_split_meta_roundtrip_and_length_check():
    h1, h2 = bytes(range(64)), bytes(range(64, 128))
    blob = h1 + (5).to_bytes(8, "little", signed=True) + h2 + (1 << 40).to_bytes(8, "little", signed=True)
    assert car._split_meta(blob, 2) == ([h1, h2], [5, 1 << 40])
    with pytest.raises(car.CustomAllReduceError):
        car._split_meta(blob[:-1], 2)


# --- bookkeeping, with a fake C ABI ----------------------------------------------------

class FakeLib:
    """Stands in for _Lib: records calls, keeps per-ctx pending inputs like the C side."""

    def __init__(self, max_size=1 << 20):
        self.calls, self.ctxs, self._max = [], {}, max_size

    def _log(self, *a):
        self.calls.append(a)

    def device_count(self):
        return 1

    def create(self, rank, world, staging, blocks):
        ctx = 1000 + len(self.ctxs)
        self.ctxs[ctx] = {"rank": rank, "capturing": False, "pending": [], "base": 0xB000 + 0x100 * rank}
        self._log("create", rank, world, staging, blocks)
        return ctx

    def destroy(self, ctx):
        self._log("destroy", ctx)

    def max_size(self, ctx):
        return self._max

    def ipc_handle(self, ctx):
        return bytes([self.ctxs[ctx]["rank"]]) * 64

    def open_peers_ipc(self, ctx, handles):
        self._log("open_peers_ipc", ctx, list(handles))

    def shared_base(self, ctx):
        return self.ctxs[ctx]["base"]

    def set_peers_local(self, ctx, bases):
        self._log("set_peers_local", ctx, list(bases))

    def buffer_ipc_meta(self, ptr):
        return (ptr & 0xFF).to_bytes(1, "little") * 64, ptr % 7

    def register_buffer_local(self, ctx, ptrs):
        self._log("register_buffer_local", ctx, list(ptrs))

    def begin_capture(self, ctx):
        self.ctxs[ctx]["capturing"] = True
        self._log("begin_capture", ctx)

    def end_capture(self, ctx):
        self.ctxs[ctx]["capturing"] = False
        self._log("end_capture", ctx)
        return len(self.ctxs[ctx]["pending"])

    def pending_buffers(self, ctx):
        return list(self.ctxs[ctx]["pending"])

    def drop_pending(self, ctx):
        self.ctxs[ctx]["pending"].clear()
        self._log("drop_pending", ctx)

    def register_graph_local(self, ctx, flat, n):
        self._log("register_graph_local", ctx, list(flat), n)
        self.ctxs[ctx]["pending"].clear()

    def register_graph_ipc(self, ctx, handles, offsets, n):
        self._log("register_graph_ipc", ctx, list(handles), list(offsets), n)
        self.ctxs[ctx]["pending"].clear()

    def all_reduce(self, ctx, inp, out, numel, dtype, stream, algo):
        c = self.ctxs[ctx]
        if c["capturing"] and inp != out:
            c["pending"].append(inp)
        self._log("all_reduce", ctx, inp, out, numel, dtype, stream, algo)


def names(lib):
    return [c[0] for c in lib.calls]


def test_world1_loopback_needs_no_exchange():
    lib = FakeLib()
    g = car.CustomAllReduce(0, 1, lib=lib)
    assert ("set_peers_local", g._ctx, [0xB000]) in lib.calls
    assert g.should_use(4096) and not g.should_use(4100) and not g.should_use((1 << 20) + 16)
    g.close()
    assert not g.should_use(4096)  # closed: fall back


def test_bad_world_and_missing_exchange():
    with pytest.raises(ValueError):
        car.CustomAllReduce(0, 3, lib=FakeLib())
    with pytest.raises(ValueError):
        car.CustomAllReduce(2, 2, lib=FakeLib())
    with pytest.raises(ValueError, match="exchange"):
        car.CustomAllReduce(0, 2, lib=FakeLib())


class TwoRankExchange:
    """Answers for rank 0 of a 2-rank group; rank 1's contribution is scripted."""

    def __init__(self, peer_answers):
        self.sent, self.peer = [], list(peer_answers)

    def __call__(self, b):
        self.sent.append(b)
        return [b, self.peer.pop(0)]


def test_ipc_peers_opened_in_rank_order():
    lib = FakeLib()
    ex = TwoRankExchange([b"\x01" * 64])
    g = car.CustomAllReduce(0, 2, ex, lib=lib)
    assert ex.sent == [b"\x00" * 64]
    assert ("open_peers_ipc", g._ctx, [b"\x00" * 64, b"\x01" * 64]) in lib.calls


def _meta(ptr):
    return (ptr & 0xFF).to_bytes(1, "little") * 64 + (ptr % 7).to_bytes(8, "little", signed=True)


def test_capture_registers_all_ranks_after_capture():
    lib = FakeLib()
    peer_meta = b"\xAA" * 64 + (3).to_bytes(8, "little") + b"\xBB" * 64 + (9).to_bytes(8, "little")
    ex = TwoRankExchange([b"\x01" * 64, peer_meta])
    g = car.CustomAllReduce(0, 2, ex, lib=lib)
    with g.capture():
        g.all_reduce_ptr(0x5010, 0x6000, 256, "bfloat16", 7)
        g.all_reduce_ptr(0x5020, 0x5020, 256, "float32", 7)  # in place: staging, not recorded
        g.all_reduce_ptr(0x5031, 0x7000, 256, "float16", 7, algo="two_shot")
        assert "register_graph_ipc" not in names(lib)  # nothing registered before capture ends
    seq = names(lib)
    assert seq.index("begin_capture") < seq.index("all_reduce") < seq.index("end_capture") < seq.index("register_graph_ipc")
    assert ex.sent[-1] == _meta(0x5010) + _meta(0x5031)
    reg = [c for c in lib.calls if c[0] == "register_graph_ipc"][0]
    _, ctx, handles, offsets, n = reg
    assert n == 2
    assert handles == [_meta(0x5010)[:64], _meta(0x5031)[:64], b"\xAA" * 64, b"\xBB" * 64]
    assert offsets == [0x5010 % 7, 0x5031 % 7, 3, 9]
    ar = [c for c in lib.calls if c[0] == "all_reduce"]
    assert [(c[5], c[7]) for c in ar] == [(0, 0), (2, 0), (1, 2)]  # dtype and algo codes


def test_capture_with_mismatched_peer_raises_before_registering():
    lib = FakeLib()
    ex = TwoRankExchange([b"\x01" * 64, b""])  # peer captured nothing
    g = car.CustomAllReduce(0, 2, ex, lib=lib)
    with pytest.raises(car.CustomAllReduceError, match=r"\[1, 0\]"):
        with g.capture():
            g.all_reduce_ptr(0x5010, 0x6000, 256, "bfloat16", 7)
    assert "register_graph_ipc" not in names(lib)


def test_capture_failure_drops_pending_and_propagates():
    lib = FakeLib()
    g = car.CustomAllReduce(0, 1, lib=lib)
    with pytest.raises(RuntimeError, match="boom"):
        with g.capture():
            g.all_reduce_ptr(0x5010, 0x6000, 256, "bfloat16", 7)
            raise RuntimeError("boom")
    assert names(lib)[-2:] == ["end_capture", "drop_pending"]
    assert lib.pending_buffers(g._ctx) == []
    assert not g._capturing


def test_local_group_wiring_and_group_capture():
    lib = FakeLib()
    group = car.CustomAllReduce.local_group(4, lib=lib)
    bases = [0xB000 + 0x100 * r for r in range(4)]
    for g in group:
        assert ("set_peers_local", g._ctx, bases) in lib.calls
    with car.capture_local_group(group):
        for r, g in enumerate(group):
            g.all_reduce_ptr(0x1000 * (r + 1), 0x9000, 64, "float32", 0)
            g.all_reduce_ptr(0x1000 * (r + 1) + 0x10, 0x9000, 64, "float32", 0)
    regs = [c for c in lib.calls if c[0] == "register_graph_local"]
    assert len(regs) == 4
    want = [0x1000, 0x1010, 0x2000, 0x2010, 0x3000, 0x3010, 0x4000, 0x4010]
    assert all(c[2] == want and c[3] == 2 for c in regs)


def test_all_reduce_reads_tensors():
    torch = pytest.importorskip("torch")
    lib = FakeLib()
    g = car.CustomAllReduce(0, 1, lib=lib)
    x = torch.ones(64, dtype=torch.bfloat16)
    o = torch.empty_like(x)
    assert g.all_reduce(x, o, stream=5) is o
    assert lib.calls[-1] == ("all_reduce", g._ctx, x.data_ptr(), o.data_ptr(), 64, 0, 5, 0)
    g.all_reduce(x, stream=5)  # default: in place
    assert lib.calls[-1][2] == lib.calls[-1][3] == x.data_ptr()
    with pytest.raises(ValueError):
        g.all_reduce(x, torch.empty(32, dtype=torch.bfloat16), stream=5)
    with pytest.raises(TypeError):
        g.all_reduce(torch.ones(4, dtype=torch.int32), stream=5)


# --- the real library, built here (opt-in: needs nvcc; about a minute on 2 cores) -----

@pytest.mark.skipif(os.environ.get("FDLITE_TEST_BUILD") != "1" or shutil.which("nvcc") is None,
                    reason="set FDLITE_TEST_BUILD=1 (and have nvcc) to build the library")
def test_built_library_without_gpu(tmp_path, monkeypatch):
    subprocess.run(["bash", str(ROOT / "tools/gpu/build_ops.sh"), str(tmp_path)], check=True,
                   capture_output=True)
    so = tmp_path / car.LIB_NAME
    monkeypatch.setenv(car.LIB_ENV, str(so))
    lib = car.load_library()
    assert lib is not None, car.unavailable_reason()
    if lib.device_count() == 0:  # the CPU machines: clean refusal, no crash
        assert car.CustomAllReduce.is_available(lib) is False
        with pytest.raises(car.CustomAllReduceError):
            car.CustomAllReduce(0, 1, lib=lib)
    with pytest.raises(car.CustomAllReduceError) as e:
        lib.create(0, 3, 1 << 20, 0)
    assert e.value.code == 10001  # FDAR_E_ARG, checked before touching the device
