"""The C++ CPU paged attention (fdlite/kernels/csrc_cpu/paged_attention_cpu.cc): build, load, call.

Why C++: Paddle has no CPU paged attention, and the Paddle-op chain of `fdlite/layers/attention.py` copies every
row's whole context out of the cache and dispatches ~10 ops per layer; the op reads K/V in place.

Built on first use with the host C++ compiler straight into one shared library (no setuptools, no
generated module, as `fdlite/kernels/build.py` does for the CUDA ops), cached on disk under a key of
(source, flags, Paddle version, compiler version): later processes load it in milliseconds. `-mavx2
-mfma` are added only when this CPU has them (never -march=native: the cache may be shared between
machines, and the flags are part of the key).

Environment:
- FDLITE_CPU_ATTENTION: `auto` (default: the C++ op, or the reference when it cannot be built),
  `reference` (always the Paddle-op reference), `cpp` (the C++ op, and an error when it cannot be built).
- FDLITE_CPU_OPS_CACHE: cache folder (default ~/.cache/fdlite/ops_cpu; a temp folder if that is read-only).
- CXX: the compiler (default g++, else c++).
- OMP_NUM_THREADS: the op's threads (OpenMP: Intel's libiomp5 where Paddle ships it, the pool its MKL
  uses, else libgomp). Paddle sets it to 1 at import when it is unset.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger("fdlite")

SOURCE = Path(__file__).resolve().parent / "csrc_cpu" / "paged_attention_cpu.cc"
LIB_NAME = "libfdlite_cpu_ops.so"
MODE_ENV = "FDLITE_CPU_ATTENTION"
OP = "fdl_cpu_paged_attention"

_lock = threading.Lock()
_state: dict = {}


class BuildError(RuntimeError):
    pass


def mode() -> str:
    m = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if m not in ("auto", "reference", "cpp"):
        raise ValueError(f"{MODE_ENV}={m!r}: expected auto, reference or cpp")
    return m


def cache_root() -> Path:
    """Not under $FDLITE_CACHE (the test suite points that at a fresh folder per session; the library
    depends on the source and the toolchain only, so one build serves every session)."""
    if os.environ.get("FDLITE_CPU_OPS_CACHE"):
        return Path(os.environ["FDLITE_CPU_OPS_CACHE"])
    return Path(os.path.expanduser("~")) / ".cache" / "fdlite" / "ops_cpu"


def _compiler() -> str:
    for c in (os.environ.get("CXX"), "g++", "c++"):
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
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout.split("\n")[0]
    except OSError:
        return "?"


def build(force: bool = False) -> str:
    """Path of the compiled library (cached; compiled on first use, ~6 s)."""
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
    key = hashlib.sha256(SOURCE.read_bytes() + repr((cmd, version, _compiler_version(cxx))).encode()).hexdigest()[:20]
    dest_dir = cache_root() / key
    dest = dest_dir / LIB_NAME
    if dest.is_file() and not force:
        return str(dest)
    try:
        dest_dir.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: build for this machine's temp folder instead
        dest_dir = Path(tempfile.gettempdir()) / f"fdlite-ops_cpu-{os.getuid()}" / key
        dest = dest_dir / LIB_NAME
        if dest.is_file() and not force:
            return str(dest)
        dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fdlite_cpu_ops_", dir=dest_dir) as work:
        tmp = os.path.join(work, LIB_NAME)
        r = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"compile failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-4000:]}")
        os.replace(tmp, dest)  # atomic: a concurrent loader sees no library or the whole one
    return str(dest)


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
                import paddle  # noqa: PLC0415
                from paddle.utils.cpp_extension import load_op_meta_info_and_register_op  # noqa: PLC0415

                path = build()
                load_op_meta_info_and_register_op(path)
                _state.update(ok=True, path=path, run=paddle._C_ops._run_custom_op)
            except Exception as e:  # noqa: BLE001 - any failure means the reference path
                if m == "cpp":
                    raise
                _state.update(ok=False, reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        if _state["ok"]:
            logger.info("CPU paged attention: C++ op (%s)", _state["path"])
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
    """q [T, h, d] float32 -> [T, h * d]; see the C++ file for `rows` / `lens` in each mode."""
    return _state["run"](OP, q, k_cache, v_cache, block_tables, rows, lens, float(scale), bool(per_token),
                         int(num_threads))[0]
