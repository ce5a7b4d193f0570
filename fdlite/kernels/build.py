"""Build fdlite's GPU ops (fdlite/kernels/csrc/ops_*.cu) into one Paddle custom-op library.

The ops are hand-written CUDA because PyPI's paddlepaddle-gpu carries no sm_90 code: on Hopper every
Paddle built-in kernel silently does nothing, so fdlite brings every kernel of its GPU forward, as
FastDeploy does with its compiled custom_ops.

Why a hand build (nvcc per source, then g++ -shared) with an on-disk cache, rather than
`paddle.utils.cpp_extension` (which `fdlite/kernels/setup_ops.py` keeps using for install-time builds):

- cpp_extension passes no `-gencode` flags, so nvcc's default target (sm_75 SASS + PTX that the
  driver JIT-compiles at load) would run on Hopper; here the targets are explicit
  (`FDLITE_CUDA_ARCHS`, default "90a": Hopper with its arch-specific wgmma, which the prefill attention
  and the MoE GEMMs use; sm_90a code runs on compute capability 9.0 only, so other GPUs need their own entry, e.g. "80;90a").
- It runs setuptools and writes a generated Python module per op (16.9 s for two ops; docs/design.md, "The GPU host framework"), one
  translation unit after another; here the sources compile in parallel and nothing but the .so is
  made, with the same flags against Paddle 2.6 and 3.x headers.
- The result is cached under a key of (sources, flags, Paddle version, nvcc version): the first
  use on a machine compiles (about a minute), every later process loads the cached library in
  milliseconds. The first use can also be done ahead: `python -m fdlite.kernels.build`
  (or tools/gpu/build_ops.sh). The cache, the key, the atomic rename and the lock against concurrent
  builds are `fdlite/kernels/native.py`'s, shared with the CPU attention op.

Environment (fdlite/envs.py): FDLITE_OPS_CACHE (cache root, default ~/.cache/fdlite/ops), NVCC / CUDA_HOME
(the compiler), FDLITE_CUDA_ARCHS ("90;100"), FDLITE_CUBLAS_INCLUDE / FDLITE_CUBLAS_LIB (where cuBLASLt
is, when it is not beside nvcc or in the nvidia-* wheels), FDLITE_GPU_OPS_LIB (a prebuilt library: no build).

Run as a script (`python fdlite/kernels/build.py`, as tools/gpu/compile_check.sh does) it imports neither
the fdlite package nor Paddle (with --compile-only): envs.py and native.py are loaded by path.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

if __package__:
    from fdlite import envs
    from fdlite.kernels import native
else:  # run as a script or loaded by path: no import of the fdlite package (hence of Paddle)
    import importlib.util

    # As a script, sys.path[0] is this folder, whose platform.py would shadow the standard library's
    # `platform` (which Paddle imports): drop it.
    _here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _here]
    native = sys.modules.get("fdlite_native")
    if native is None:
        _spec = importlib.util.spec_from_file_location("fdlite_native", Path(__file__).resolve().parent / "native.py")
        native = sys.modules["fdlite_native"] = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(native)
    envs = native.envs

CSRC = native.CSRC
SOURCES = native.GPU_OPS_SOURCES
HEADERS = native.GPU_OPS_HEADERS
LIB_NAME = native.GPU_OPS_LIB
LIB_ENV = native.GPU_OPS_LIB_ENV  # a prebuilt library: skip the build
BuildError = native.BuildError


@dataclass
class Toolchain:
    nvcc: str
    cuda_include: str
    cudart_lib: str | None       # directory of libcudart.so (None: compile only)
    cublas_include: str | None
    cublas_lib: str | None       # directory of libcublasLt.so*
    paddle_include: str
    paddle_lib: str | None       # directory of libpaddle.so (None: compile only)
    paddle_version: str
    archs: list[str] = field(default_factory=lambda: ["90a"])


def _site_dirs() -> list[str]:
    dirs = []
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p and p not in dirs:
            dirs.append(p)
    for p in sys.path:
        if p.endswith("site-packages") and os.path.isdir(p) and p not in dirs:
            dirs.append(p)
    return dirs


def find_nvcc() -> str:
    cands = [envs.NVCC]
    if envs.CUDA_HOME:
        cands.append(os.path.join(envs.CUDA_HOME, "bin", "nvcc"))
    cands.append(shutil.which("nvcc"))
    for d in _site_dirs():
        cands += sorted(glob.glob(os.path.join(d, "nvidia", "cu*", "bin", "nvcc")), reverse=True)
    cands.append("/usr/local/cuda/bin/nvcc")
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise BuildError("nvcc not found: set NVCC or CUDA_HOME (or pip install nvidia-cuda-nvcc)")


def _cuda_root(nvcc: str) -> str:
    """The toolkit nvcc belongs to (nvcc may be a wrapper script: ask it)."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, check=False).stderr
        for line in out.splitlines():
            if line.startswith("#$ TOP="):
                return os.path.realpath(line.split("=", 1)[1].strip())
    except OSError:
        pass
    return str(Path(os.path.realpath(nvcc)).parent.parent)


def _first_dir(paths: list[str], marker: str) -> str | None:
    for p in paths:
        if p and os.path.exists(os.path.join(p, marker)):
            return p
    return None


def _lib_dir(paths: list[str], pattern: str) -> str | None:
    for p in paths:
        if p and glob.glob(os.path.join(p, pattern)):
            return p
    return None


def _nvidia_dirs(sub: str) -> list[str]:
    out = []
    for d in _site_dirs():
        out += sorted(glob.glob(os.path.join(d, "nvidia", "*", sub)))
    return out


def find_toolchain(paddle_include: str | None = None, link: bool = True) -> Toolchain:
    """Locate nvcc, CUDA/cuBLAS headers and libraries, and Paddle's headers and libpaddle.so.

    `paddle_include` (compile checks against another Paddle's headers) skips importing paddle.
    """
    nvcc = find_nvcc()
    root = _cuda_root(nvcc)
    cuda_incs = [os.path.join(root, "include"), os.path.join(root, "targets", "x86_64-linux", "include")]
    cuda_include = _first_dir(cuda_incs + _nvidia_dirs("include"), "cuda_runtime.h")
    if cuda_include is None:
        raise BuildError(f"cuda_runtime.h not found beside {nvcc}")
    cublas_include = _first_dir([envs.FDLITE_CUBLAS_INCLUDE] + cuda_incs + _nvidia_dirs("include"),
                                "cublasLt.h")
    lib_dirs = [os.path.join(root, "lib64"), os.path.join(root, "lib"), os.path.join(root, "targets", "x86_64-linux", "lib")]
    cublas_lib = _lib_dir([envs.FDLITE_CUBLAS_LIB] + lib_dirs + _nvidia_dirs("lib"), "libcublasLt.so*")
    cudart_lib = _lib_dir(lib_dirs + _nvidia_dirs("lib"), "libcudart.so*")
    if paddle_include is None:
        import paddle  # noqa: PLC0415 - only needed for a real build

        paddle_include = paddle.sysconfig.get_include()
        base = os.path.join(os.path.dirname(paddle.__file__), "base")
        paddle_lib = base if os.path.isfile(os.path.join(base, "libpaddle.so")) else None
        version = paddle.__version__
    else:
        paddle_lib, version = None, "headers:" + os.path.realpath(paddle_include)
    archs = list(envs.FDLITE_CUDA_ARCHS)
    tc = Toolchain(nvcc, cuda_include, cudart_lib, cublas_include, cublas_lib, paddle_include, paddle_lib, version, archs)
    if link:
        missing = [n for n, v in (("libcudart", tc.cudart_lib), ("libcublasLt", tc.cublas_lib),
                                  ("libpaddle.so", tc.paddle_lib)) if v is None]
        if missing:
            raise BuildError(f"cannot link the ops library: {', '.join(missing)} not found")
    if tc.cublas_include is None:
        raise BuildError("cublasLt.h not found: set FDLITE_CUBLAS_INCLUDE (or pip install nvidia-cublas)")
    return tc


def arch_flags(archs: list[str]) -> list[str]:
    """nvcc's targets for `archs`, and the define that lets the host side launch the wgmma kernels when sm_90a
    code is among them (wgmma.cuh: wgmma_ready); shared by this build and setup_ops.py."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    if "90a" in archs:
        flags.append("-DFDL_HAVE_SM90A")
    return flags


def nvcc_flags(tc: Toolchain) -> list[str]:
    p = tc.paddle_include
    incs = [p, os.path.join(p, "third_party")]
    # Paddle 3.x with PADDLE_WITH_CUDA includes its ATen-compatible headers too.
    compat = os.path.join(p, "paddle", "phi", "api", "include", "compat")
    if os.path.isdir(compat):
        incs += [compat, os.path.join(compat, "torch", "csrc", "api", "include")]
    incs += [tc.cuda_include, tc.cublas_include, str(CSRC)]
    flags = ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
             "-DPADDLE_WITH_CUDA", "-DEIGEN_USE_GPU", "-DPADDLE_WITH_CUSTOM_KERNEL", "-DPADDLE_NO_PYTHON",
             "-Xptxas", "-warn-spills", "-w"]
    flags += arch_flags(tc.archs)
    flags += [f"-I{d}" for d in dict.fromkeys(incs)]
    return flags


def _so_name(libdir: str, stem: str) -> str:
    """The file to link against (-l:NAME): libX.so if present, else the highest libX.so.N."""
    if os.path.exists(os.path.join(libdir, stem + ".so")):
        return stem + ".so"
    names = sorted(os.path.basename(f) for f in glob.glob(os.path.join(libdir, stem + ".so.*")))
    if not names:
        raise BuildError(f"{stem}.so not found in {libdir}")
    return min(names, key=len)


def link_command(tc: Toolchain, objects: list[str], out: str) -> list[str]:
    base = tc.paddle_lib
    libs_dir = os.path.join(os.path.dirname(base), "libs")
    cmd = [envs.CXX or "g++", "-shared", "-o", out, *objects,
           f"-L{base}", "-l:libpaddle.so", f"-Wl,-rpath,{base}", f"-Wl,-rpath,{libs_dir}",
           f"-L{tc.cudart_lib}", "-l:" + _so_name(tc.cudart_lib, "libcudart"), f"-Wl,-rpath,{tc.cudart_lib}",
           f"-L{tc.cublas_lib}", "-l:" + _so_name(tc.cublas_lib, "libcublasLt"),
           "-l:" + _so_name(tc.cublas_lib, "libcublas"), f"-Wl,-rpath,{tc.cublas_lib}"]
    # The custom-op API (OpMetaInfoBuilder, CustomOpKernelContext) lives in libphi in Paddle 2.6:
    # name it, so that every symbol resolves at link time (checked with -Wl,--no-undefined).
    if os.path.isfile(os.path.join(libs_dir, "libphi.so")):
        cmd += [f"-L{libs_dir}", "-l:libphi.so", "-Wl,--no-undefined", f"-Wl,-rpath-link,{libs_dir}"]
    return cmd


def _nvcc_version(nvcc: str) -> str:
    return native.tool_version(nvcc, line=-1)


def cache_key(tc: Toolchain) -> str:
    return native.cache_key([CSRC / name for name in SOURCES + HEADERS], nvcc_flags(tc), tc.paddle_version,
                            _nvcc_version(tc.nvcc), tc.cublas_lib, tc.cudart_lib)


def cache_root() -> Path:
    return native.cache_root(native.GPU_OPS_CACHE_ENV)


def is_cached() -> bool:
    """Whether `build()` would load a library without compiling (a prebuilt one, or this toolchain's cached
    build); False also when the toolchain cannot be found."""
    if native.named_library(LIB_ENV)[0] is not None:
        return True
    try:
        tc = find_toolchain()
    except (BuildError, ImportError):
        return False
    return native.find_cached(cache_root(), cache_key(tc), LIB_NAME) is not None


def _run(cmd: list[str], verbose: bool) -> str:
    return native.run(cmd, verbose)


def compile_objects(tc: Toolchain, workdir: str, jobs: int | None = None, verbose: bool = False,
                    sources: list[str] | None = None) -> tuple[list[str], str]:
    """nvcc -c every source in parallel; returns (object paths, ptxas resource report)."""
    flags = nvcc_flags(tc) + ["--resource-usage"]
    srcs = sources or SOURCES

    def one(name: str) -> tuple[str, str]:
        obj = os.path.join(workdir, name.replace(".cu", ".o"))
        return obj, _run([tc.nvcc, *flags, "-c", str(CSRC / name), "-o", obj], verbose)

    with cf.ThreadPoolExecutor(max_workers=jobs or min(len(srcs), os.cpu_count() or 1)) as ex:
        results = list(ex.map(one, srcs))
    return [o for o, _ in results], "".join(r for _, r in results)


def build(force: bool = False, jobs: int | None = None, verbose: bool = False, out_dir: str | None = None) -> str:
    """Path of the built library (cached; compiled on first use)."""
    if not force and out_dir is None:
        path, why = native.named_library(LIB_ENV)
        if path is not None:
            return path
        if why:
            raise BuildError(why)
    tc = find_toolchain()

    def compile_(work: str, out: str) -> dict[str, str]:
        objects, report = compile_objects(tc, work, jobs, verbose)
        _run(link_command(tc, objects, out), verbose)
        return {"ptxas_report.txt": report}

    return native.build_library("the GPU ops", LIB_NAME, cache_key(tc), cache_root(), compile_, force=force,
                                dest_dir=out_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the library into this directory instead of the cache")
    ap.add_argument("--force", action="store_true", help="rebuild even when cached")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--verbose", "-v", action="store_true")
    ap.add_argument("--compile-only", metavar="PADDLE_INCLUDE",
                    help="only compile every source against these Paddle headers (no Paddle import, no link)")
    args = ap.parse_args(argv)
    try:
        if args.compile_only:
            tc = find_toolchain(paddle_include=args.compile_only, link=False)
            with tempfile.TemporaryDirectory(prefix="fdlite_ops_cc_") as work:
                objs, report = compile_objects(tc, work, args.jobs, args.verbose)
                spills = [ln.strip() for ln in report.splitlines() if "spill" in ln and " 0 bytes spill stores" not in ln]
                print(f"compiled {len(objs)} sources for sm_{','.join(tc.archs)} with {_nvcc_version(tc.nvcc)} "
                      f"against {args.compile_only}; kernels with spills: {len(spills)}")
            return 0
        print(build(force=args.force, jobs=args.jobs, verbose=args.verbose, out_dir=args.out))
        return 0
    except BuildError as e:
        print(f"build failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
