"""CPU-side tests of fdlite's GPU ops (fdlite/kernels/csrc/ops_*.cu, fdlite/kernels/gpu.py): no GPU needed.

The kernels themselves run on the GPU machine (tools/gpu/run_ops_tests.sh, results in
docs/benchmarks.md). Here: every Python wrapper calls an op that a PD_BUILD_OP defines, with the
inputs and attributes it declares; the sampler's counter-based noise against an independent
pure-Python splitmix64; the numpy reference of the GPU sampler against fdlite's CPU sampler's
filtering rule; the build module's toolchain logic; and (opt-in, needs nvcc) the compile check of
every source against Paddle's headers with PADDLE_WITH_CUDA.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from fdlite.sample import random as noise
from fdlite.kernels import build
from fdlite.sample import sampling_ref

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "fdlite" / "kernels" / "csrc"
WRAPPERS = ROOT / "fdlite" / "kernels" / "gpu.py"


# --- the ops the sources define vs the calls the wrappers make ------------------------------

def _defined_ops() -> dict[str, tuple[int, int]]:
    """op name -> (number of inputs, number of attributes), parsed from PD_BUILD_OP chains."""
    ops = {}
    for f in build.SOURCES:
        text = (CSRC / f).read_text()
        for m in re.finditer(r"PD_BUILD_OP\((\w+)\)(.*?);", text, flags=re.S):
            name, chain = m.group(1), m.group(2)
            ins = re.search(r"\.Inputs\(\{(.*?)\}\)", chain, flags=re.S)
            attrs = re.search(r"\.Attrs\(\{(.*?)\}\)", chain, flags=re.S)
            n_in = len(re.findall(r'"[^"]+"', ins.group(1))) if ins else 0
            n_attr = len(re.findall(r'"[^"]+"', attrs.group(1))) if attrs else 0
            ops[name] = (n_in, n_attr)
    return ops


def _wrapper_calls() -> list[tuple[str, int]]:
    """(op name, number of arguments) of every _run("fdl_...", ...) call in the wrappers."""
    calls = []
    for node in ast.walk(ast.parse(WRAPPERS.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_run":
            name = node.args[0].value
            calls.append((name, len(node.args) - 1))
    return calls


def test_every_wrapper_call_matches_an_op_definition():
    ops = _defined_ops()
    calls = _wrapper_calls()
    assert len(ops) >= 15 and len(calls) >= 15
    for name, nargs in calls:
        assert name in ops, f"{name} is called but no PD_BUILD_OP defines it"
        n_in, n_attr = ops[name]
        assert nargs == n_in + n_attr, f"{name}: wrapper passes {nargs} args, op takes {n_in} inputs + {n_attr} attrs"
    assert set(ops) == {n for n, _ in calls}, f"ops without a wrapper: {set(ops) - {n for n, _ in calls}}"


def test_every_kernel_function_signature_matches_its_op():
    """The kernel function's tensor and attribute parameters line up with Inputs / Attrs."""
    for f in build.SOURCES:
        text = (CSRC / f).read_text()
        for m in re.finditer(r"PD_BUILD_OP\((\w+)\)(.*?);", text, flags=re.S):
            chain = m.group(2)
            fn = re.search(r"PD_KERNEL\((\w+)\)", chain).group(1)
            sig = re.search(rf"std::vector<paddle::Tensor> {fn}\((.*?)\)\s*\{{", text, flags=re.S).group(1)
            params = [p.strip() for p in sig.split(",") if p.strip()]
            n_tensor = sum("paddle::Tensor" in p for p in params)
            attr_types = [p.rsplit(" ", 1)[0].replace("const ", "").strip() for p in params if "paddle::Tensor" not in p]
            ins = re.search(r"\.Inputs\(\{(.*?)\}\)", chain, flags=re.S).group(1)
            attrs = re.search(r"\.Attrs\(\{(.*?)\}\)", chain, flags=re.S)
            declared = [a.split(":")[1].strip() for a in re.findall(r'"([^"]+)"', attrs.group(1))] if attrs else []
            assert n_tensor == len(re.findall(r'"[^"]+"', ins)), f"{fn}: tensor parameters vs Inputs"
            assert attr_types == declared, f"{fn}: attribute types {attr_types} vs {declared}"


# --- the sampler's noise ---------------------------------------------------------------------

M64 = (1 << 64) - 1


def _splitmix64_py(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _uniform_py(seed: int, pos: int, rnd: int) -> float:
    z = _splitmix64_py((seed & M64) ^ ((pos * 0x9E3779B97F4A7C15) & M64) ^ ((rnd * 0xD1B54A32D192ED03) & M64))
    return ((z >> 40) + 0.5) * 2.0**-24


def test_noise_matches_pure_python_and_stays_in_open_interval():
    rng = np.random.default_rng(0)
    seeds = rng.integers(-(2**63), 2**63 - 1, 500, dtype=np.int64)
    pos = rng.integers(0, 1 << 40, 500)
    for rnd in (0, 1, 9):
        got = noise.uniforms(seeds, pos, rnd, np.float32)
        want = np.array([_uniform_py(int(s), int(p), rnd) for s, p in zip(seeds, pos)], np.float32)
        assert got.dtype == np.float32 and np.array_equal(got, want)
        assert np.all((got > 0) & (got < 1))
    # splitmix64's published first output for state 0 (after one increment)
    assert int(noise.splitmix64(np.uint64(0))) == _splitmix64_py(0) == 0xE220A8397B1DCDAF


def test_noise_depends_on_seed_position_and_round_only():
    a = noise.uniforms([5, 5, 6, 6], [10, 11, 10, 11], 0, np.float32)
    assert len(set(a.tolist())) == 4
    assert noise.uniforms(5, 10, 0, np.float32) == a[0] and noise.uniforms(5, 10, 1, np.float32) != a[0]
    # The CPU sampler's float64 uniform is the same 24 bits, before the kernel's float32 rounding.
    assert np.allclose(noise.uniforms([5, 6], [10, 10], 0), a[[0, 2]], rtol=2**-23, atol=0)


# --- the GPU sampler's reference vs fdlite's CPU sampler ------------------------------------

def test_reference_thresholds_keep_what_the_cpu_sampler_keeps():
    paddle = pytest.importorskip("paddle")
    from fdlite.sample.sampler import SamplingBatch
    from sampling_helpers import probs

    rng = np.random.default_rng(3)
    rows, vocab = 40, 3000
    x = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    x[5, :10] = x[5, 10]  # ties at the top
    ks = rng.choice([0, 1, 7, 50, 2999, 5000], rows).tolist()
    ps = rng.choice([1.0, 0.95, 0.6, 0.1], rows).tolist()
    mps = rng.choice([0.0, 0.0, 0.1], rows).tolist()
    batch = SamplingBatch(temperature=np.ones(rows, np.float32), top_k=np.asarray(ks, np.int64),
                          top_p=np.asarray(ps, np.float32), min_p=np.asarray(mps, np.float32),
                          seeds=np.zeros(rows, np.uint64), positions=np.zeros(rows, np.int64),
                          num_logprobs=np.full(rows, -1, np.int64))
    cpu = probs(paddle.to_tensor(x), batch).numpy()  # the CPU sampler's distribution, by a sort
    for r in range(rows):
        thr = sampling_ref.threshold(x[r], ks[r], ps[r], mps[r])
        kept_ref = x[r] >= thr
        kept_cpu = cpu[r] > 0
        assert np.array_equal(kept_ref, kept_cpu), f"row {r}: k={ks[r]} p={ps[r]} min_p={mps[r]}"


def test_reference_sampling_draws_from_the_filtered_distribution():
    rng = np.random.default_rng(4)
    v = 30
    row = (rng.standard_normal(v) * 2).astype(np.float32)
    draws = np.array([sampling_ref.sample_row(row, 0.7, 10, 0.9, 0.0, 1234, p) for p in range(6000)])
    x = row / np.float32(0.7)
    kept = x >= sampling_ref.threshold(x, 10, 0.9, 0.0)
    pr = np.where(kept, np.exp(x.astype(np.float64) - x.max()), 0)
    pr /= pr.sum()
    freq = np.bincount(draws, minlength=v) / len(draws)
    assert kept[draws].all()
    assert 0.5 * np.abs(freq - pr).sum() < 0.03
    assert sampling_ref.sample_row(row, 0.0, 0, 1.0, 0.0, 1, 1) == int(np.argmax(row))  # greedy


# --- build module ------------------------------------------------------------------------------

def test_build_flags_name_each_arch_and_the_cache_key_follows_sources(monkeypatch, tmp_path):
    tc = build.Toolchain(nvcc="nvcc", cuda_include="/c/include", cudart_lib=None, cublas_include="/b/include",
                         cublas_lib=None, paddle_include=str(tmp_path), paddle_lib=None, paddle_version="x",
                         archs=["90", "100"])
    flags = build.nvcc_flags(tc)
    assert "-gencode=arch=compute_90,code=sm_90" in flags and "-gencode=arch=compute_100,code=sm_100" in flags
    assert "-DPADDLE_WITH_CUDA" in flags and f"-I{tmp_path}" in flags
    assert "-DFDL_HAVE_SM90A" not in flags  # no sm_90a code: the host never launches the wgmma kernels
    monkeypatch.setattr(build, "_nvcc_version", lambda nvcc: "v")
    k1 = build.cache_key(tc)
    tc.archs = ["90"]
    assert build.cache_key(tc) != k1
    tc.archs = ["90a"]
    flags = build.nvcc_flags(tc)
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags and "-DFDL_HAVE_SM90A" in flags
    assert build.Toolchain(nvcc="n", cuda_include="", cudart_lib=None, cublas_include="", cublas_lib=None,
                           paddle_include="", paddle_lib=None, paddle_version="x").archs == ["90a"]


def test_cache_key_hashes_every_header_the_gpu_sources_include():
    """A header edit must change the build cache's key (build.cache_key hashes SOURCES + HEADERS): HEADERS is the
    closure of the sources' includes."""
    seen, todo = set(), list(build.SOURCES)
    while todo:
        for inc in re.findall(r'#include\s+"([^"]+)"', (CSRC / todo.pop()).read_text()):
            if inc not in seen and (CSRC / inc).exists():
                seen.add(inc)
                todo.append(inc)
    assert sorted(build.HEADERS) == sorted(seen)


def test_so_name_prefers_plain_then_shortest_versioned(tmp_path):
    (tmp_path / "libcublasLt.so.13").write_text("")
    (tmp_path / "libcublasLt.so.13.1.0").write_text("")
    assert build._so_name(str(tmp_path), "libcublasLt") == "libcublasLt.so.13"
    (tmp_path / "libcublasLt.so").write_text("")
    assert build._so_name(str(tmp_path), "libcublasLt") == "libcublasLt.so"
    with pytest.raises(build.BuildError):
        build._so_name(str(tmp_path), "libnothing")


def test_missing_nvcc_is_a_build_error(monkeypatch):
    monkeypatch.delenv("NVCC", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.setattr(build, "_site_dirs", lambda: [])
    monkeypatch.setattr(build.os.path, "isfile", lambda p: False)
    with pytest.raises(build.BuildError, match="nvcc not found"):
        build.find_nvcc()


def test_prebuilt_library_env_is_used_as_is(monkeypatch, tmp_path):
    lib = tmp_path / build.LIB_NAME
    lib.write_bytes(b"\x7fELF")
    monkeypatch.setenv(build.LIB_ENV, str(lib))
    assert build.build() == str(lib)
    monkeypatch.setenv(build.LIB_ENV, str(tmp_path / "missing.so"))
    with pytest.raises(build.BuildError, match="does not exist"):
        build.build()


# --- compile check (opt-in: needs nvcc; minutes on 2 cores) -----------------------------------

def _have_nvcc() -> bool:
    try:
        build.find_nvcc()
        return True
    except build.BuildError:
        return False


@pytest.mark.skipif(os.environ.get("FDLITE_TEST_BUILD") != "1" or not _have_nvcc(),
                    reason="set FDLITE_TEST_BUILD=1 (and have nvcc, cublasLt.h) to compile the GPU ops for sm_90")
def test_gpu_ops_compile_for_sm90_against_paddle_headers():
    r = subprocess.run(["bash", str(ROOT / "tools" / "gpu" / "compile_check.sh")], capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert f"compiled {len(build.SOURCES)} sources for sm_90" in r.stdout


# --- wrappers refuse what the kernels cannot take, before any library is loaded ----------------

def test_wrappers_refuse_cpu_tensors_and_checks_can_be_turned_off():
    paddle = pytest.importorskip("paddle")
    import fdlite.kernels.gpu as G

    x = paddle.ones([2, 8])
    with pytest.raises(G.GpuOpsError, match="must be on the GPU"):
        G.rms_norm(x, paddle.ones([8]), 1e-6)
    with pytest.raises(G.GpuOpsError, match="must be on the GPU"):
        G.paged_attention(paddle.ones([1, 2, 64]), x, x, x, x, x, 1.0)
    G.set_checks(False)
    try:
        G._check(x, "x", ("int64",), ndim=5)  # nothing checked
    finally:
        G.set_checks(True)
    assert "path" not in G._state  # no library was built or loaded on the way


# --- host -> device copies through pinned slots ------------------------------------------------

class _FakeCapi:
    """The C entry points PinnedUploads calls, on host memory: 'device' copies are plain memmoves at call time."""

    def __init__(self):
        import ctypes

        self.ctypes, self.log, self.buffers = ctypes, [], []

    def fdl_event_create(self):
        self.log.append("event")
        return len(self.log)

    def fdl_event_synchronize(self, e):
        self.log.append(("wait", e))
        return 0

    def fdl_host_alloc(self, n):
        buf = self.ctypes.create_string_buffer(n)
        self.buffers.append(buf)
        self.log.append(("alloc", n))
        return self.ctypes.addressof(buf)

    def fdl_host_free(self, p):
        self.log.append("free")
        return 0

    def fdl_memcpy_h2d_many_pinned(self, n, table, stream, pinned, size, done):
        assert sum((table[2 * n + i] + 15) // 16 * 16 for i in range(n)) <= size  # the pieces fit the slot
        for i in range(n):
            self.ctypes.memmove(table[i], table[n + i], table[2 * n + i])
        self.log.append(("pinned", n, done))
        return 0

    def fdl_memcpy_h2d_many(self, n, table, stream):
        for i in range(n):
            self.ctypes.memmove(table[i], table[n + i], table[2 * n + i])
        self.log.append(("direct", n))
        return 0


def test_small_uploads_go_through_pinned_slots_reused_after_their_event(monkeypatch):
    """Small host -> device copies are staged in a ring of pinned slots (a pageable source may make the copy wait
    for the stream to drain); a slot is reused only after waiting for the event of the copies that read it, and
    grows when a step's inputs outgrow it. Large ones (weights) go straight."""
    from fdlite.kernels import gpu

    fake = _FakeCapi()
    monkeypatch.setattr(gpu, "capi", lambda: fake)
    monkeypatch.setattr(gpu, "current_stream_handle", lambda: 0)
    monkeypatch.setattr(gpu, "_uploads", gpu.PinnedUploads(depth=2))
    src = [np.arange(n, dtype=np.int64) for n in (3, 5, 7000)]
    dst = [np.zeros_like(a) for a in src]
    for a, d in zip(src, dst):  # 3 calls over 2 slots: the third reuses the first after its event, grown
        gpu.copy_from_host_many([d.ctypes.data], [a.ctypes.data], [a.nbytes])
    assert all(np.array_equal(a, d) for a, d in zip(src, dst))
    assert fake.log == ["event", ("alloc", 1 << 14), ("pinned", 1, 1),
                        "event", ("alloc", 1 << 14), ("pinned", 1, 4),
                        ("wait", 1), "free", ("alloc", 56016), ("pinned", 1, 1)]
    big = np.ones(gpu.PinnedUploads.MAX_BYTES // 8 + 1, dtype=np.int64)
    out = np.zeros_like(big)
    gpu.copy_from_host_many([out.ctypes.data], [big.ctypes.data], [big.nbytes])
    assert fake.log[-1] == ("direct", 1) and out.sum() == big.size
