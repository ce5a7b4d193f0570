"""Build fdlite's GPU ops (fdlite/kernels/csrc/ops_*.cu) into one Paddle custom-op library.

The ops are hand-written CUDA because PyPI's paddlepaddle-gpu carries no sm_90 code: on Hopper every
Paddle built-in kernel silently does nothing, so fdlite brings every kernel of its GPU forward, as
FastDeploy does with its compiled custom_ops.

Why a hand build (nvcc per source, then g++ -shared) with an on-disk cache, rather than
`paddle.utils.cpp_extension` (which `fdlite/kernels/setup_ops.py` keeps using for install-time builds):

- cpp_extension passes no `-gencode` flags, so nvcc's default target (sm_75 SASS + PTX that the
  driver JIT-compiles at load) would run on Hopper; here the targets are explicit
  (`FDLITE_CUDA_ARCHS`, default "90").
- It runs setuptools and writes a generated Python module per op (17 s for two ops in SPIKE2), one
  translation unit after another; here the sources compile in parallel and nothing but the .so is
  made, with the same flags against Paddle 2.6 and 3.x headers.
- The result is cached under a key of (sources, flags, Paddle version, nvcc version): the first
  use on a machine compiles (about a minute), every later process loads the cached library in
  milliseconds. The first use can also be done ahead: `python -m fdlite.kernels.build`
  (or tools/gpu/build_ops.sh).

Environment: FDLITE_OPS_CACHE (cache root, default ~/.cache/fdlite/ops), NVCC / CUDA_HOME (the
compiler), FDLITE_CUDA_ARCHS ("90;100"), FDLITE_CUBLAS_INCLUDE / FDLITE_CUBLAS_LIB (where cuBLASLt
is, when it is not beside nvcc or in the nvidia-* wheels).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ["ops_basic.cu", "ops_norm.cu", "ops_linear.cu", "ops_rope_cache.cu", "ops_attention.cu",
           "ops_sampling.cu", "ops_capi.cu"]
HEADERS = ["ops_common.cuh"]
LIB_NAME = "libfdlite_gpu_ops.so"
LIB_ENV = "FDLITE_GPU_OPS_LIB"  # a prebuilt library: skip the build


class BuildError(RuntimeError):
    pass


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
    archs: list[str] = field(default_factory=lambda: ["90"])


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
    cands = [os.environ.get("NVCC")]
    if os.environ.get("CUDA_HOME"):
        cands.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
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
    cublas_include = _first_dir([os.environ.get("FDLITE_CUBLAS_INCLUDE", "")] + cuda_incs + _nvidia_dirs("include"),
                                "cublasLt.h")
    lib_dirs = [os.path.join(root, "lib64"), os.path.join(root, "lib"), os.path.join(root, "targets", "x86_64-linux", "lib")]
    cublas_lib = _lib_dir([os.environ.get("FDLITE_CUBLAS_LIB", "")] + lib_dirs + _nvidia_dirs("lib"), "libcublasLt.so*")
    cudart_lib = _lib_dir(lib_dirs + _nvidia_dirs("lib"), "libcudart.so*")
    if paddle_include is None:
        import paddle  # noqa: PLC0415 - only needed for a real build

        paddle_include = paddle.sysconfig.get_include()
        base = os.path.join(os.path.dirname(paddle.__file__), "base")
        paddle_lib = base if os.path.isfile(os.path.join(base, "libpaddle.so")) else None
        version = paddle.__version__
    else:
        paddle_lib, version = None, "headers:" + os.path.realpath(paddle_include)
    archs = [a.strip() for a in os.environ.get("FDLITE_CUDA_ARCHS", "90").split(";") if a.strip()]
    tc = Toolchain(nvcc, cuda_include, cudart_lib, cublas_include, cublas_lib, paddle_include, paddle_lib, version, archs)
    if link:
        missing = [n for n, v in (("libcudart", tc.cudart_lib), ("libcublasLt", tc.cublas_lib),
                                  ("libpaddle.so", tc.paddle_lib)) if v is None]
        if missing:
            raise BuildError(f"cannot link the ops library: {', '.join(missing)} not found")
    if tc.cublas_include is None:
        raise BuildError("cublasLt.h not found: set FDLITE_CUBLAS_INCLUDE (or pip install nvidia-cublas)")
    return tc


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
    flags += [f"-gencode=arch=compute_{a},code=sm_{a}" for a in tc.archs]
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
    cmd = [os.environ.get("CXX", "g++"), "-shared", "-o", out, *objects,
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
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout.strip().splitlines()[-1]
    except OSError:
        return "?"


def cache_key(tc: Toolchain) -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(repr((nvcc_flags(tc), tc.paddle_version, _nvcc_version(tc.nvcc), tc.cublas_lib, tc.cudart_lib)).encode())
    return h.hexdigest()[:20]


def cache_root() -> Path:
    return Path(os.environ.get("FDLITE_OPS_CACHE") or Path.home() / ".cache" / "fdlite" / "ops")


def _run(cmd: list[str], verbose: bool) -> str:
    if verbose:
        print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout + r.stderr


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
    env = os.environ.get(LIB_ENV)
    if env and not force and out_dir is None:
        if not os.path.isfile(env):
            raise BuildError(f"${LIB_ENV}={env} does not exist")
        return env
    tc = find_toolchain()
    key = cache_key(tc)
    dest_dir = Path(out_dir) if out_dir else cache_root() / key
    dest = dest_dir / LIB_NAME
    if dest.is_file() and not force and out_dir is None:
        return str(dest)
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fdlite_ops_") as work:
        objects, report = compile_objects(tc, work, jobs, verbose)
        tmp = os.path.join(work, LIB_NAME)
        _run(link_command(tc, objects, tmp), verbose)
        (dest_dir / "ptxas_report.txt").write_text(report)
        os.replace(tmp, dest)  # atomic: a concurrent loader sees the old library or the whole new one
    return str(dest)


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
