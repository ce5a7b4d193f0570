"""The C++ CPU paged attention (fdlite/kernels/csrc_cpu/paged_attention_cpu.cc): build, load, call.

Why C++: Paddle has no CPU paged attention, and the Paddle-op chain of `fdlite/layers/attention.py` copies every
row's whole context out of the cache and dispatches ~10 ops per layer; the op reads K/V in place.

Built on first use with the host C++ compiler straight into one shared library (no setuptools, no
generated module, as `fdlite/kernels/build.py` does for the CUDA ops), cached on disk under a key of
(source, flags, Paddle version, compiler version) by `fdlite/kernels/native.py`: later processes load it in
milliseconds (`is_cached()` tells whether this one will have to compile). `-mavx2 -mfma` are added only when
this CPU has them (never -march=native: the cache may be shared between machines, and the flags are part of
the key).

Environment (fdlite/envs.py):
- FDLITE_CPU_ATTENTION: `auto` (default: the C++ op, or the reference when it cannot be built),
  `reference` (always the Paddle-op reference), `cpp` (the C++ op, and an error when it cannot be built).
- FDLITE_CPU_OPS_CACHE: cache folder (default ~/.cache/fdlite/ops_cpu; a temp folder if that is read-only).
- CXX: the compiler (default g++, else c++).
- OMP_NUM_THREADS: the op's threads (OpenMP: Intel's libiomp5 where Paddle ships it, the pool its MKL
  uses, else libgomp). Paddle sets it to 1 at import when it is unset.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

from fdlite import envs
from fdlite.kernels import native

logger = logging.getLogger("fdlite")

SOURCE = native.CPU_ATTENTION_SOURCE
LIB_NAME = native.CPU_ATTENTION_LIB
MODE_ENV = "FDLITE_CPU_ATTENTION"
OP = "fdl_cpu_paged_attention"

_lock = threading.Lock()
_state: dict = {}

BuildError = native.BuildError


def mode() -> str:
    """auto, reference or cpp (ValueError for anything else)."""
    return envs.get(MODE_ENV)


def cache_root() -> Path:
    """Not under $FDLITE_CACHE (the test suite points that at a fresh folder per session; the library
    depends on the source and the toolchain only, so one build serves every session)."""
    return native.cache_root(native.CPU_OPS_CACHE_ENV)


def _compiler() -> str:
    for c in (envs.CXX, "g++", "c++"):
        if c and shutil.which(c):
            return shutil.which(c)
    raise BuildError("no C++ compiler (set CXX, or install g++)")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compile_flags() -> list[str]:
    flags = ["-std=c++17", "-O3", "-fPIC", "-shared", "-fopenmp", "-w", "-DPADDLE_NO_PYTHON"]
    if {"avx2", "fma"} <= _cpu_flags():
        flags += ["-mavx2", "-mfma"]
    return flags


def _paddle_paths() -> tuple[str, str, str]:
    import paddle  # noqa: PLC0415

    base = os.path.join(os.path.dirname(paddle.__file__), "base")
    if not os.path.isfile(os.path.join(base, "libpaddle.so")):
        raise BuildError(f"libpaddle.so not found in {base}")
    return paddle.sysconfig.get_include(), base, paddle.__version__


def _compiler_version(cxx: str) -> str:
    return native.tool_version(cxx)


def _command() -> tuple[list[str], str]:
    """The compile command (without its output) and the cache key."""
    cxx = _compiler()
    include, base, version = _paddle_paths()
    libs = os.path.join(os.path.dirname(base), "libs")
    cmd = [cxx, *compile_flags(), f"-I{include}", f"-I{os.path.join(include, 'third_party')}", str(SOURCE),
           f"-L{base}", "-l:libpaddle.so", f"-Wl,-rpath,{base}", f"-Wl,-rpath,{libs}"]
    if os.path.isfile(os.path.join(libs, "libphi.so")):  # Paddle 2.6 keeps the custom-op API in libphi
        cmd += [f"-L{libs}", "-l:libphi.so"]
    if os.path.isfile(os.path.join(libs, "libiomp5.so")):
        # Paddle's MKL runs on Intel's OpenMP, whose workers spin between calls: a second (GNU) pool
        # would fight them for the cores. Named before the -lgomp that -fopenmp appends, libiomp5
        # provides the GOMP_* entry points, so the op's parallel loops run on MKL's threads.
        cmd += [f"-L{libs}", "-l:libiomp5.so"]
    return cmd, native.cache_key([SOURCE], cmd, version, _compiler_version(cxx))


def is_cached() -> bool:
    """Whether the compiled op is in the cache already (or loaded), so `load()` will not compile it. Cheap: no
    compiler run but `--version`. False also when it cannot be built here, or when
    FDLITE_CPU_ATTENTION=reference asks for no op at all."""
    if _state.get("ok"):
        return True
    try:
        if mode() == "reference":
            return False
        _, key = _command()
    except Exception:  # noqa: BLE001 - no compiler, no Paddle, a bad mode: nothing cached to load
        return False
    return native.find_cached(cache_root(), key, LIB_NAME) is not None


def build(force: bool = False) -> str:
    """Path of the compiled library (cached; compiled on first use, ~6 s)."""
    cmd, key = _command()

    def compile_(work: str, out: str) -> None:
        native.run([*cmd, "-o", out], tail=4000)

    return native.build_library("the CPU attention op", LIB_NAME, key, cache_root(), compile_, force=force)


def load() -> bool:
    """Register the op once per process; False (and the reason in `status()`) when it cannot be built."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        m = mode()
        if m == "reference":
            _state.update(ok=False, reason=f"{MODE_ENV}=reference")
        else:
            try:
                path = build()
                _state.update(ok=True, path=path, run=native.load_paddle_ops(path))
            except Exception as e:  # noqa: BLE001 - any failure means the reference path
                if m == "cpp":
                    raise
                _state.update(ok=False, reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        if _state["ok"]:
            logger.debug("CPU paged attention: C++ op (%s)", _state["path"])
        else:
            logger.info("CPU paged attention: Paddle-op reference (%s)", _state["reason"])
        return _state["ok"]


def status() -> dict:
    load()
    return dict(_state)


def available() -> bool:
    return _state["ok"] if "ok" in _state else load()


def paged_attention(q, k_cache, v_cache, block_tables, rows, lens, scale: float, per_token: bool,
                    num_threads: int = 0):
    """q [T, h, d] float32 -> [T, h * d]; see the C++ file for `rows` / `lens` in each mode. The caches are
    float32 tensors, or `Fp8Cache`s (fdlite/kvcache/fp8_cache.py: e4m3 bytes and their scales)."""
    import paddle  # noqa: PLC0415 (this module loads without Paddle's import cost until an op runs)

    if not isinstance(k_cache, paddle.Tensor):  # an Fp8Cache
        return _state["run"](OP + "_fp8", q, k_cache.data, k_cache.scale, v_cache.data, v_cache.scale, block_tables,
                             rows, lens, float(scale), bool(per_token), int(num_threads))[0]
    return _state["run"](OP, q, k_cache, v_cache, block_tables, rows, lens, float(scale), bool(per_token),
                         int(num_threads))[0]
