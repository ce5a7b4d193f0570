"""fdlite's native code in one place: which libraries there are, where their builds are cached, how a build
is made safely, and how a library is loaded.

Three libraries:
- the GPU ops (csrc/ops_*.cu, a Paddle custom-op library with a few plain C entry points): compiled with
  nvcc on first use by `fdlite/kernels/build.py`, or prebuilt ($FDLITE_GPU_OPS_LIB);
- the C++ CPU paged attention (csrc_cpu/paged_attention_cpu.cc, a Paddle custom op): compiled with the host
  C++ compiler on first use by `fdlite/kernels/cpu_attention.py`;
- the custom all-reduce (csrc/custom_all_reduce*.cu, a plain C ABI loaded with ctypes): built ahead by
  tools/gpu/build_ops.sh into fdlite/kernels/lib/, or named by $FDLITE_OPS_LIB.
`fdlite/kernels/setup_ops.py` builds all of them into one extension at install time, from the lists here.

A build on first use goes through `build_library`: the library lands in `<cache root>/<key>/`, where the key
hashes the sources, the flags, the compiler's and Paddle's versions (`cache_key`), so a change of any of them
builds anew and an unchanged one is loaded in milliseconds. The compiler writes into a temp folder inside
that folder, and the result is renamed into place (atomic: a concurrent loader sees no library or the whole
one); a file lock makes concurrent processes build once, the others waiting for and then loading that build.
A cache root that cannot be written (a read-only home) is replaced by one in the temp folder.

Like fdlite/envs.py, this module imports nothing of fdlite but envs (nor Paddle, until it loads a custom-op
library), so that build.py and the all-reduce loader can load it by path where Paddle is missing.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

if __package__:
    from fdlite import envs
else:  # loaded by path (see the module docstring): envs.py by path too, no import of the fdlite package
    envs = sys.modules.get("fdlite_envs")
    if envs is None:
        _spec = importlib.util.spec_from_file_location("fdlite_envs", Path(__file__).resolve().parent.parent / "envs.py")
        envs = importlib.util.module_from_spec(_spec)
        sys.modules["fdlite_envs"] = envs
        _spec.loader.exec_module(envs)

logger = logging.getLogger("fdlite")

KERNELS = Path(__file__).resolve().parent
CSRC = KERNELS / "csrc"
CSRC_CPU = KERNELS / "csrc_cpu"
LIB_DIR = KERNELS / "lib"  # where tools/gpu/build_ops.sh puts its libraries

# The GPU ops (build.py; setup_ops.py).
GPU_OPS_SOURCES = ["ops_basic.cu", "ops_norm.cu", "ops_linear.cu", "ops_rope_cache.cu", "ops_attention.cu",
                   "ops_sampling.cu", "ops_logits.cu", "ops_logprobs.cu", "ops_moe_route.cu", "ops_moe.cu", "ops_capi.cu"]
# Every header the sources include, directly or not: the build cache's key hashes them (a test checks the list).
GPU_OPS_HEADERS = ["ops_common.cuh", "ops_options.h", "mma_sync.cuh", "wgmma.cuh", "attention_mma.cuh",
                   "attention_decode_mma.cuh", "attention_wgmma.cuh", "moe_align.cuh", "moe_gemm.cuh",
                   "moe_gemm_mma.cuh", "moe_gemm_fma.cuh", "moe_gemm_wgmma.cuh"]
GPU_OPS_LIB = "libfdlite_gpu_ops.so"
GPU_OPS_LIB_ENV = "FDLITE_GPU_OPS_LIB"
GPU_OPS_CACHE_ENV = "FDLITE_OPS_CACHE"
# The custom all-reduce (tools/gpu/build_ops.sh; setup_ops.py adds the Paddle binding).
ALLREDUCE_SOURCES = ["custom_all_reduce.cu", "custom_all_reduce_capi.cu"]
ALLREDUCE_BINDING = "paddle_binding.cc"
ALLREDUCE_LIB = "libfdlite_allreduce.so"
ALLREDUCE_LIB_ENV = "FDLITE_OPS_LIB"
# The CPU paged attention (cpu_attention.py).
CPU_ATTENTION_SOURCE = CSRC_CPU / "paged_attention_cpu.cc"
CPU_ATTENTION_LIB = "libfdlite_cpu_ops.so"
CPU_OPS_CACHE_ENV = "FDLITE_CPU_OPS_CACHE"


class BuildError(RuntimeError):
    pass


# ------------------------------------------------------------------ where
def cache_root(var: str) -> Path:
    """The cache root a variable of fdlite/envs.py names (FDLITE_OPS_CACHE, FDLITE_CPU_OPS_CACHE)."""
    return Path(envs.get(var))


def _fallback_root(root: Path) -> Path:
    """For a cache root that cannot be written: one in this machine's temp folder, per user."""
    return Path(tempfile.gettempdir()) / f"fdlite-{root.name}-{os.getuid()}"


def find_cached(root: Path, key: str, lib_name: str) -> Path | None:
    """The library built under `key` in `root` (or its temp-folder stand-in), None when not built yet."""
    for d in (root, _fallback_root(root)):
        p = d / key / lib_name
        if p.is_file():
            return p
    return None


def named_library(var: str) -> tuple[str | None, str]:
    """(path, "$VAR") of the prebuilt library a variable names; (None, why) when it names a missing file;
    (None, "") when it is unset."""
    path = envs.get(var)
    if not path:
        return None, ""
    return (path, f"${var}") if os.path.isfile(path) else (None, f"${var}={path} does not exist")


# ------------------------------------------------------------------ the key
def tool_version(exe: str, line: int = 0) -> str:
    """One line of `exe --version` (the compiler's identity, part of the cache key)."""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False).stdout.strip()
        return out.splitlines()[line] if out else "?"
    except (OSError, IndexError):
        return "?"


def cache_key(files: Iterable[Path], *parts: object) -> str:
    """20 hex digits over the files' names and bytes and the repr of `parts` (flags, compiler and Paddle
    versions, library folders)."""
    h = hashlib.sha256()
    for f in files:
        f = Path(f)
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(repr(parts).encode())
    return h.hexdigest()[:20]


# ------------------------------------------------------------------ the build
def _lock_file(path: Path):
    """An exclusive lock held while the returned file is open (fcntl; nothing where there is none)."""
    f = open(path, "a+")  # noqa: SIM115 - closed by the caller
    try:
        import fcntl  # noqa: PLC0415

        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    except ImportError:
        pass
    return f


def build_library(what: str, lib_name: str, key: str, root: Path,
                  compile_fn: Callable[[str, str], dict[str, str] | None], force: bool = False,
                  dest_dir: str | Path | None = None) -> str:
    """Path of `lib_name` built under `key` in `root`, compiled once if it is not there yet.

    `compile_fn(work, out)` writes the library to `out` (scratch files go to `work`, a temp folder beside the
    destination, removed afterwards) and may return {file name: text} of side files (a report) to keep beside
    the library. `dest_dir`: build into that folder instead of the cache (always compiles). Raises BuildError.
    """
    if dest_dir is not None:
        dest_dir = Path(dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
        force = True
    else:
        found = find_cached(root, key, lib_name)
        if found is not None and not force:
            return str(found)
        dest_dir = root / key
        try:
            dest_dir.mkdir(parents=True, exist_ok=True)
        except OSError:  # a read-only home: build for this machine's temp folder instead
            dest_dir = _fallback_root(root) / key
            dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / lib_name
    with _lock_file(dest_dir / ".lock"):  # released when the file closes
        if dest.is_file() and not force:  # another process built it while this one waited
            return str(dest)
        logger.info("compiling %s (once; cached under %s)", what, dest_dir)
        with tempfile.TemporaryDirectory(prefix=".build_", dir=dest_dir) as work:
            tmp = os.path.join(work, lib_name)
            side = compile_fn(work, tmp) or {}
            if not os.path.isfile(tmp):
                raise BuildError(f"building {what} made no {lib_name}")
            for name, text in side.items():
                (dest_dir / name).write_text(text)
            os.replace(tmp, dest)  # atomic: a concurrent loader sees no library or the whole one
    return str(dest)


def run(cmd: list[str], verbose: bool = False, tail: int | None = None) -> str:
    """Run one compiler command; its output, or BuildError with the command and (the last `tail`
    characters of) what it printed."""
    if verbose:
        print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        out = r.stdout + "\n" + r.stderr
        raise BuildError(f"command failed ({r.returncode}): {' '.join(cmd)}\n{out[-tail:] if tail else out}")
    return r.stdout + r.stderr


# ------------------------------------------------------------------ loading
def load_ctypes(path: str, signatures: dict[str, tuple[object, list[object] | None]] | None = None,
                keep_gil: frozenset[str] = frozenset()) -> ctypes.CDLL:
    """The library at `path` through ctypes, with `signatures` (name -> (restype, argtypes)) set.

    The functions named in `keep_gil` are called without releasing the GIL (a `ctypes.PyDLL` handle): for calls
    that never block and return in microseconds, where giving the GIL up costs more than the call, since getting it
    back may wait for another thread's Python work (the engine's two threads under async scheduling).

    OSError: not a loadable library; AttributeError: a symbol of `signatures` is missing (an older build)."""
    lib = ctypes.CDLL(path)
    held = ctypes.PyDLL(path) if keep_gil else None
    for name, (res, args) in (signatures or {}).items():
        fn = getattr(held if name in keep_gil else lib, name)
        fn.restype = res
        if args is not None:
            fn.argtypes = args
        if name in keep_gil:
            setattr(lib, name, fn)
    return lib


def load_paddle_ops(path: str) -> Callable:
    """Register the custom ops of the library at `path` with Paddle; returns Paddle's `_run_custom_op`
    (call it as run(op_name, *inputs, *attrs))."""
    import paddle  # noqa: PLC0415

    try:
        from paddle.utils.cpp_extension import load_op_meta_info_and_register_op as register  # noqa: PLC0415
    except ImportError:  # older layouts
        from paddle.base import core  # noqa: PLC0415

        register = core.load_op_meta_info_and_register_op
    register(path)
    run_op = getattr(getattr(paddle, "_C_ops", None), "_run_custom_op", None)
    if run_op is None:
        from paddle.base import core  # noqa: PLC0415

        run_op = core.eager._run_custom_op
    return run_op


def load_by_path(name: str, path: Path):
    """A module of this folder loaded from its file (no import of the fdlite package, hence of Paddle),
    registered in sys.modules as `name`."""
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod
