"""Every environment variable fdlite reads, with its default and what it does; read here and nowhere else.

The model is vLLM's `vllm/envs.py` (and FastDeploy's `fastdeploy/envs.py`): one table, name -> (default, help),
and an accessor per name, `fdlite.envs.FDLITE_CACHE`. A value is read from the environment at its first
access and cached; `refresh()` forgets the cached values (the test suite calls it whenever it changes the
environment: see tests/env_patch.py). Unset and empty mean the default.

New behaviour switches belong in `EngineConfig` (fdlite/config.py); a variable here is a location, a
toolchain setting, or a debug switch. The C++ sources read no environment: fdlite/kernels/gpu.py passes
FDLITE_PDL, FDLITE_GEMV, FDLITE_ATTN_MMA, FDLITE_DECODE_MMA and FDLITE_DECODE_SPLIT_KEYS to the ops library once, when it
loads it (`fdl_set_options`).

fdlite also *sets* two variables for the libraries it drives, which are not options: MKL_DEBUG_CPU_TYPE
(fdlite/mkl_amd.py, before Paddle loads MKL) and PADDLE_DISTRI_BACKEND (fdlite/distributed/parallel_state.py, after
reading the user's choice of it here).

This module imports nothing of fdlite (nor Paddle): fdlite/kernels/build.py and the all-reduce loader load it by
path where Paddle is missing (tools/gpu/compile_check.sh, tools/gpu/allreduce_harness.py).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable


def _flag(v: str) -> bool:
    return v.strip().lower() not in ("0", "false", "no", "off")


def _int(v: str) -> int:
    return int(v.strip())


def _path(v: str) -> str:
    return os.path.expanduser(v.strip())


def _zero_one_two(v: str) -> int:
    m = int(v.strip())
    if m not in (0, 1, 2):
        raise ValueError("expected 0, 1 or 2")
    return m


def _lower(v: str) -> str:
    return v.strip().lower()


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(v: str) -> str:
        v = v.strip().lower() or allowed[0]
        if v not in allowed:
            raise ValueError(f"expected {', '.join(allowed[:-1])} or {allowed[-1]}")
        return v

    return parse


def _list(v: str) -> list[str]:
    return [a.strip() for a in v.split(";") if a.strip()]


@dataclass(frozen=True)
class Var:
    default: str  # the value an unset (or empty) variable takes, as it would be written; "" = unset
    help: str
    parse: Callable[[str], Any] = str


VARIABLES: dict[str, Var] = {
    # --- where things are kept
    "FDLITE_CACHE": Var("~/.cache/fdlite", "Folder of fdlite's cached files: the built-in default model "
                        "(`default-model-v1`) is written there once.", _path),
    "FDLITE_OPS_CACHE": Var("~/.cache/fdlite/ops", "Build cache of the GPU ops library (fdlite/kernels/build.py); "
                            "one sub-folder per key of sources, flags, nvcc and Paddle versions.", _path),
    "FDLITE_CPU_OPS_CACHE": Var("~/.cache/fdlite/ops_cpu", "Build cache of the C++ CPU attention op "
                                "(fdlite/kernels/cpu_attention.py); a temp folder is used if it is read-only.",
                                _path),
    # --- prebuilt native libraries
    "FDLITE_GPU_OPS_LIB": Var("", "A prebuilt GPU ops library (libfdlite_gpu_ops.so, or the setup_ops.py "
                              "extension) to load instead of building one into FDLITE_OPS_CACHE.", _path),
    "FDLITE_OPS_LIB": Var("", "The custom all-reduce library (libfdlite_allreduce.so or the setup_ops.py "
                          "extension); unset: fdlite/kernels/lib/libfdlite_allreduce.so if present.", _path),
    # --- building the GPU ops
    "FDLITE_CUDA_ARCHS": Var("90a", "';'-separated compute capabilities the GPU ops are compiled for "
                             "(e.g. \"90;100\").", _list),
    "FDLITE_CUBLAS_INCLUDE": Var("", "Folder of cublasLt.h when it is not beside nvcc or in the nvidia-* wheels.",
                                 _path),
    "FDLITE_CUBLAS_LIB": Var("", "Folder of libcublasLt.so when it is not beside nvcc or in the nvidia-* wheels.",
                             _path),
    "NVCC": Var("", "The CUDA compiler (unset: $CUDA_HOME/bin/nvcc, nvcc on PATH, the nvidia-cuda-nvcc wheel, "
                "/usr/local/cuda/bin/nvcc).", _path),
    "CUDA_HOME": Var("", "CUDA toolkit root, where nvcc is looked for when NVCC is unset.", _path),
    "CXX": Var("", "Host C++ compiler for the native builds (unset: g++, else c++).", str.strip),
    # --- native code choices
    "FDLITE_CPU_ATTENTION": Var("auto", "CPU paged attention: auto (the C++ op, or the Paddle-op reference when "
                                "it cannot be built), reference, or cpp (the C++ op or an error).",
                                _choice("auto", "reference", "cpp")),
    "FDLITE_GPU_OPS_CHECKS": Var("1", "0 turns off the argument checks of the GPU op wrappers "
                                 "(fdlite/kernels/gpu.py: tens of microseconds of host time per eager op).", _flag),
    "FDLITE_PDL": Var("2", "Programmatic dependent launch of the GPU ops on sm_90+: 0 never, 1 every launch that "
                      "allows it, 2 only after another fdlite kernel (passed to the library at load).", _zero_one_two),
    "FDLITE_GEMV": Var("1", "0 turns off the decode GEMV (batches of at most 4 rows go to cuBLASLt instead; "
                       "passed to the library at load).", _flag),
    "FDLITE_ATTN_MMA": Var("2", "bf16/fp16 prefill attention kernel: 2 wgmma where the library has sm_90a code and "
                           "the GPU is sm_90 (else mma.sync), 1 mma.sync, 0 the CUDA-core tile kernel (for "
                           "side-by-side measurements; passed to the library at load).", _zero_one_two),
    "FDLITE_DECODE_MMA": Var("1", "0 sends bf16/fp16 decode attention to the CUDA-core kernel instead of the "
                             "tensor-core (mma.sync) one (for side-by-side measurements; passed to the library at "
                             "load).", _flag),
    "FDLITE_DECODE_SPLIT_KEYS": Var("512", "GPU decode attention in decode-only steps: a row longer than this many keys "
                                    "gets ceil(keys / this) KV splits, up to 4 (at least the count the shapes "
                                    "give), so long rows do not form the tail; over an FP8 cache twice this many keys "
                                    "(the same bytes a split); 0 = the shapes' count for every row "
                                    "(0 or a multiple of 64 up to 4096; for side-by-side measurements; passed to the "
                                    "library at load).", _int),
    "FDLITE_CUDAGRAPH_BACKEND": Var("", "`eager` replaces CUDA graph capture by fdlite's eager-replay stand-in "
                                    "(fdlite/graph/eager_replay.py), on any device: for CPU tests.", _lower),
    # --- debugging
    "FDLITE_INCREMENTAL_DETOKENIZE": Var("0", "1 gives every sequence a detokenizer fed token by token, as "
                                         "streaming does (for tests of the incremental path).", _flag),
    "FDLITE_DEBUG_POISON_FREED_BLOCKS": Var("0", "1 fills every KV cache block no one may read (never written, "
                                            "freed, evicted) with NaN keys, so a stale read shows in the outputs; "
                                            "slow, for tests.", _flag),
    # --- set by `python -m paddle.distributed.launch`
    "PADDLE_TRAINER_ID": Var("0", "This process's rank in a multi-process launch (set by the launcher).", _int),
    "PADDLE_TRAINERS_NUM": Var("1", "Number of processes of a multi-process launch (set by the launcher).", _int),
    "PADDLE_DISTRI_BACKEND": Var("auto", "Backend of the launch's process group (Paddle's variable): auto lets fdlite "
                                 "pick gloo on CPU and for ranks that name their GPU, NCCL otherwise.", _lower),
}

_lock = threading.Lock()
_cache: dict[str, Any] = {}


def get(name: str) -> Any:
    """The parsed value of `name` (one of VARIABLES), read from the environment once and cached."""
    try:
        return _cache[name]
    except KeyError:
        pass
    var = VARIABLES[name]
    raw = os.environ.get(name) or var.default
    try:
        value = var.parse(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r}: {e}") from None
    with _lock:
        return _cache.setdefault(name, value)


def refresh(*names: str) -> None:
    """Forget the cached values (of `names`, or all): the next access reads the environment again."""
    with _lock:
        if names:
            for n in names:
                _cache.pop(n, None)
        else:
            _cache.clear()


def describe() -> str:
    """The table as Markdown: name, default, help."""
    lines = ["| variable | default | what it does |", "| --- | --- | --- |"]
    for name, var in VARIABLES.items():
        lines.append(f"| `{name}` | {f'`{var.default}`' if var.default else '(unset)'} | {var.help} |")
    return "\n".join(lines)


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(VARIABLES))


if TYPE_CHECKING:
    FDLITE_CACHE: str
    FDLITE_OPS_CACHE: str
    FDLITE_CPU_OPS_CACHE: str
    FDLITE_GPU_OPS_LIB: str
    FDLITE_OPS_LIB: str
    FDLITE_CUDA_ARCHS: list[str]
    FDLITE_CUBLAS_INCLUDE: str
    FDLITE_CUBLAS_LIB: str
    NVCC: str
    CUDA_HOME: str
    CXX: str
    FDLITE_CPU_ATTENTION: str
    FDLITE_GPU_OPS_CHECKS: bool
    FDLITE_PDL: int
    FDLITE_GEMV: bool
    FDLITE_ATTN_MMA: int
    FDLITE_DECODE_MMA: bool
    FDLITE_DECODE_SPLIT_KEYS: int
    FDLITE_CUDAGRAPH_BACKEND: str
    FDLITE_INCREMENTAL_DETOKENIZE: bool
    FDLITE_DEBUG_POISON_FREED_BLOCKS: bool
    PADDLE_TRAINER_ID: int
    PADDLE_TRAINERS_NUM: int
    PADDLE_DISTRI_BACKEND: str


if __name__ == "__main__":
    print(describe())
