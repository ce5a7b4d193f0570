"""fdlite: offline batch inference for LLMs on PaddlePaddle, with vLLM's API names."""

import logging as _logging
import warnings as _warnings

# Before anything imports Paddle: MKL's fast GEMM path on AMD CPUs (see fdlite/mkl_amd.py).
from fdlite import mkl_amd as _mkl_amd

_mkl_amd.apply()

# Paddle warns on import about a C++ build cache that only matters when compiling custom ops.
_warnings.filterwarnings("ignore", message="No ccache found")

from fdlite.config import EngineConfig, GraphOptimizationConfig
from fdlite.llm import LLM
from fdlite.outputs import CompletionOutput, Logprob, RequestOutput
from fdlite.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineConfig",
           "GraphOptimizationConfig", "__version__"]

_logging.getLogger("fdlite").addHandler(_logging.NullHandler())
