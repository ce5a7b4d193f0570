"""Without the C++ CPU attention (no compiler, or FDLITE_CPU_ATTENTION=reference) the reference runs.

Runs whether or not the op can be built here: the build is made to fail on purpose.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fdlite.kernels import cpu_attention
from fdlite.layers.attention import paged_attention, reference_attention
from test_cpu_attention_op import make_case

paddle.set_device("cpu")


@pytest.fixture
def fresh_state(monkeypatch):
    saved = dict(cpu_attention._state)
    cpu_attention._state.clear()
    yield
    cpu_attention._state.clear()
    cpu_attention._state.update(saved)


def _no_compiler():
    raise cpu_attention.BuildError("no C++ compiler (simulated)")


def _check_reference_runs():
    q, kc, vc, meta = make_case([(1, 30), (1, 70), (9, 40)], 8, 4, 32, 16)
    t = q.shape[0]
    k_new, v_new = paddle.randn([t, 4, 32]), paddle.randn([t, 4, 32])
    got = paged_attention(q, k_new, v_new, kc, vc, meta, 32**-0.5).numpy()
    np.testing.assert_array_equal(got, reference_attention(q, kc, vc, meta, 32**-0.5).numpy())


def test_no_compiler_falls_back(fresh_state, monkeypatch, caplog):
    monkeypatch.delenv(cpu_attention.MODE_ENV, raising=False)
    monkeypatch.setattr(cpu_attention, "_compiler", _no_compiler)
    with caplog.at_level("INFO", logger="fdlite"):
        assert cpu_attention.load() is False
    assert "no C++ compiler" in cpu_attention.status()["reason"]
    assert any("Paddle-op reference" in r.getMessage() for r in caplog.records)
    _check_reference_runs()


def test_reference_forced_by_env(fresh_state, monkeypatch):
    monkeypatch.setenv(cpu_attention.MODE_ENV, "reference")
    assert cpu_attention.load() is False
    assert cpu_attention.status()["reason"] == f"{cpu_attention.MODE_ENV}=reference"
    _check_reference_runs()


def test_cpp_mode_raises_when_unbuildable(fresh_state, monkeypatch):
    monkeypatch.setenv(cpu_attention.MODE_ENV, "cpp")
    monkeypatch.setattr(cpu_attention, "_compiler", _no_compiler)
    with pytest.raises(cpu_attention.BuildError):
        cpu_attention.load()
