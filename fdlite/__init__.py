"""fdlite: offline batch inference for LLMs on PaddlePaddle, with vLLM's API names."""

import importlib as _importlib
import logging as _logging
import warnings as _warnings

# Before anything imports Paddle: MKL's fast GEMM path on AMD CPUs (see fdlite/mkl_amd.py).
from fdlite import mkl_amd as _mkl_amd

_mkl_amd.apply()

# Paddle warns on import about a C++ build cache that only matters when compiling custom ops.
_warnings.filterwarnings("ignore", message="No ccache found")

__version__ = "0.1.0"

# The public names, imported on first use: `import fdlite` (and `fdlite --help`) must not pay for
# Paddle's import; `from fdlite import LLM` imports it then.
_LAZY = {
    "LLM": "fdlite.llm",
    "SamplingParams": "fdlite.sampling_params",
    "RequestOutput": "fdlite.outputs",
    "CompletionOutput": "fdlite.outputs",
    "Logprob": "fdlite.outputs",
    "EngineConfig": "fdlite.config",
    "GraphOptimizationConfig": "fdlite.config",
}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fdlite' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


_logging.getLogger("fdlite").addHandler(_logging.NullHandler())
