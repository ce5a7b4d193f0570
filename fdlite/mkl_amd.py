"""Put Paddle's CPU GEMM on MKL's fast path on AMD processors (`MKL_DEBUG_CPU_TYPE=5`).

Paddle 3.3.1's CPU wheel does its matmuls in MKL (libmklml_intel), which picks its kernels by CPU
vendor: on an AMD processor it takes a generic SSE path even when the CPU has AVX2. Setting
`MKL_DEBUG_CPU_TYPE=5` makes that MKL use its AVX2 kernels. Measured on a 2-core AMD EPYC, one thread,
float32 [1024, 1024] x [1024, 3072]: 22-24 GFLOP/s as shipped, 73-75 GFLOP/s with it (torch 77, numpy 83);
greedy outputs are unchanged (`benchmarks/cpu_gemm.py`, `docs/benchmarks.md`).

MKL reads the variable once, at its first GEMM, so it must be in the environment before Paddle runs
any matmul. `import fdlite` sets it (first thing in `fdlite/__init__.py`) when the CPU is AMD with AVX2
and the user has not set it. If Paddle was imported before fdlite the setting still works as long as
no matmul has run yet, which fdlite cannot know, so it then also logs how to be sure.

`decide` is a pure function of (cpu info text, environment, whether Paddle is already imported);
`apply` feeds it this process's values.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger("fdlite")

VAR = "MKL_DEBUG_CPU_TYPE"
FAST_VALUE = "5"  # MKL's AVX2 code path
CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True)
class MklDecision:
    set_value: str | None  # the value to put into the environment, or None: leave it alone
    reason: str            # why, in a few words (for tests and the log line)
    log: str | None = None  # a line to log at warning level, or None


def _first_field(cpuinfo: str, key: str) -> str:
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip()
    return ""


def is_amd_with_avx2(cpuinfo: str) -> bool:
    """True when `/proc/cpuinfo` text names an AMD processor whose flags include avx2."""
    return _first_field(cpuinfo, "vendor_id") == "AuthenticAMD" and "avx2" in _first_field(cpuinfo, "flags").split()


def decide(cpuinfo: str, environ: Mapping[str, str], paddle_imported: bool) -> MklDecision:
    """Whether to set `MKL_DEBUG_CPU_TYPE`, from the CPU, the user's environment and the import order."""
    if VAR in environ:
        return MklDecision(None, f"user set {VAR}={environ[VAR]}")
    if not is_amd_with_avx2(cpuinfo):
        return MklDecision(None, "not an AMD CPU with AVX2")
    if paddle_imported:
        return MklDecision(
            FAST_VALUE, "paddle imported first",
            log=(f"paddle was imported before fdlite: if it has already run a matmul, its MKL stays on the slow "
                 f"path of this AMD CPU (about 3x slower GEMMs); import fdlite first, or start Python with "
                 f"{VAR}={FAST_VALUE} set"),
        )
    return MklDecision(FAST_VALUE, "AMD CPU with AVX2")


def _read_cpuinfo() -> str:
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:  # not Linux: no MKL vendor problem fdlite knows how to detect
        return ""


def apply() -> MklDecision:
    """Decide for this process and act: set the variable, log the hint."""
    decision = decide(_read_cpuinfo(), os.environ, "paddle" in sys.modules)
    if decision.set_value is not None:
        os.environ[VAR] = decision.set_value
    if decision.log is not None:
        logger.warning(decision.log)
    return decision
