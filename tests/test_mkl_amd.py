"""MKL's AMD fast path: `MKL_DEBUG_CPU_TYPE=5` is set only when it should be (vendor, user value, import order)."""

import os
import subprocess
import sys

from fdlite import mkl_amd
from fdlite.mkl_amd import FAST_VALUE, VAR, decide

AMD = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx fma avx2 bmi2\n"
AMD_NO_AVX2 = AMD.replace(" avx2", "")
INTEL = AMD.replace("AuthenticAMD", "GenuineIntel").replace("AMD EPYC", "Intel(R) Xeon(R)")
# A flag that merely contains "avx2" is not avx2.
AMD_AVX2_LOOKALIKE = AMD.replace(" avx2", " avx2x")


def test_amd_with_avx2_gets_the_fast_path():
    d = decide(AMD, {}, paddle_imported=False)
    assert d.set_value == FAST_VALUE and d.log is None


def test_other_cpus_are_left_alone():
    for info in (INTEL, AMD_NO_AVX2, AMD_AVX2_LOOKALIKE, "", "garbage without fields"):
        d = decide(info, {}, paddle_imported=False)
        assert d.set_value is None and d.log is None, info


def test_user_value_wins_whatever_the_cpu_and_order():
    for value in ("5", "4", ""):
        for paddle_imported in (False, True):
            d = decide(AMD, {VAR: value}, paddle_imported)
            assert d.set_value is None and d.log is None


def test_paddle_imported_first_logs_how_to_get_the_fast_path():
    d = decide(AMD, {}, paddle_imported=True)
    # Still set (it works until Paddle's first matmul), and the log line says how to be sure.
    assert d.set_value == FAST_VALUE
    assert "import fdlite first" in d.log and f"{VAR}={FAST_VALUE}" in d.log
    assert decide(INTEL, {}, paddle_imported=True).log is None


def test_apply_uses_this_process(monkeypatch):
    monkeypatch.setattr(mkl_amd, "_read_cpuinfo", lambda: AMD)
    monkeypatch.delenv(VAR, raising=False)
    assert mkl_amd.apply().set_value == FAST_VALUE and os.environ[VAR] == FAST_VALUE
    monkeypatch.setenv(VAR, "4")
    assert mkl_amd.apply().set_value is None and os.environ[VAR] == "4"
    monkeypatch.delenv(VAR)
    monkeypatch.setattr(mkl_amd, "_read_cpuinfo", lambda: INTEL)
    mkl_amd.apply()
    assert VAR not in os.environ


_PROBE = """
import logging, os, sys
logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
if sys.argv[1] == "paddle-first":
    import paddle
import fdlite
print("VALUE", os.environ.get("MKL_DEBUG_CPU_TYPE"))
"""


def _probe(order: str, env_value: str | None) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != VAR}  # this test process set it on import
    if env_value is not None:
        env[VAR] = env_value
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root
    out = subprocess.run([sys.executable, "-c", _PROBE, order], env=env, capture_output=True, text=True, check=True)
    value = [line for line in out.stdout.splitlines() if line.startswith("VALUE")][0].split()[1]
    return value, out.stderr


def test_real_import_order_in_a_subprocess():
    cpuinfo = mkl_amd._read_cpuinfo()
    expected = FAST_VALUE if mkl_amd.is_amd_with_avx2(cpuinfo) else "None"
    value, err = _probe("fdlite-first", None)
    assert value == expected and "LOG" not in err
    value, err = _probe("paddle-first", None)
    assert value == expected
    assert ("import fdlite first" in err) == (expected == FAST_VALUE)
    value, err = _probe("fdlite-first", "4")
    assert value == "4" and "LOG" not in err
