"""The `moe_bench` section of tools/gpu/e2e_harness.py and its roofline (tools/gpu/moe_roofline.py), on CPU: the
section runs end to end at toy sizes (`--quick`), and the roofline counts what the real models hold."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("moe_roofline", os.path.join(ROOT, "tools", "gpu", "moe_roofline.py"))
moe_roofline = importlib.util.module_from_spec(_spec)
sys.modules["moe_roofline"] = moe_roofline  # its dataclasses look their module up
_spec.loader.exec_module(moe_roofline)


def test_expected_experts_touched():
    f = moe_roofline.expected_experts_touched
    assert f(128, 8, 1) == pytest.approx(8) and f(64, 6, 0) == 0 and f(0, 0, 50) == 0
    assert f(128, 8, 256) == pytest.approx(128, abs=1e-4)  # a batch of 256 touches every expert
    assert 8 < f(128, 8, 4) < 32


def write(tmp_path, name, cfg):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_qwen3_30b_a3b_counts(tmp_path):
    cfg = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
               intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
               head_dim=128, vocab_size=151936, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
               moe_intermediate_size=768, norm_topk_prob=True)
    c = moe_roofline.ModelCosts.from_dir(write(tmp_path, "q", cfg))
    assert c.num_moe_layers == 48 and c.top_k == 8
    assert c.total_params / 1e9 == pytest.approx(30.53, abs=0.01)  # Qwen3-30B-A3B's 30.5B
    one, full = c.step([(1023, 1, True)]), c.step([(1023, 1, True)] * 256)
    # batch 1: 8 experts per layer; batch 256: all 128 (58 GB of experts) and the KV of 256 x 1024 tokens
    assert one[0] < 7e9 and full[0] > 80e9
    # A prefill step is compute-bound only with enough tokens per expert: 8,192 tokens (512 per expert) are;
    # 2,048 (128 per expert: 128 FLOPs per 2-byte weight, below the H100 ridge of 263 FLOPs per byte) are not.
    for rows, compute_bound in (([(0, 2048, True)] * 4, True), ([(0, 2048, True)], False)):
        nbytes, flops = c.step(rows)
        assert (flops / moe_roofline.BF16_FLOPS_PER_S > nbytes / moe_roofline.HBM_BYTES_PER_S) == compute_bound


def run_section_quick_on_cpu(tmp_path, section: str, **env) -> dict:
    """tools/gpu/e2e_harness.py `section` --quick with the device set to the CPU: its results file, after checking
    that it ran without errors."""
    env = {**os.environ, "FDLITE_E2E_DEVICE": "cpu", **env}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu", "e2e_harness.py"), section, "--quick",
                           "--out", str(tmp_path / "out"), "--models", str(tmp_path / "models")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "out" / f"{section}.json").read_text())
    assert res["errors"] == []
    return res


def test_harness_section_runs_quick_on_cpu(tmp_path):
    res = run_section_quick_on_cpu(tmp_path, "moe_bench")
    for name in ("ernie45_21b_a3b", "qwen3_30b_a3b", "qwen3_4b_dense"):
        assert os.listdir(tmp_path / "models" / f"{name}-quick-config-only") == ["config.json"]  # no weights
        proto, prefill = res["results"][f"protocol_{name}"], res["results"][f"prefill_heavy_{name}"]
        assert proto["output_tokens"] == proto["requested_output_tokens"]
        assert proto["roofline"]["steps_logged"] == proto["steps"] and proto["roofline"]["step_roofline_s"] > 0
        assert prefill["roofline"]["flop_roofline_s"] > 0 and prefill["output_tokens"] == 8 * prefill["requests"]


@pytest.mark.parametrize("job,kv", [("prefill_heavy", None), ("protocol", None), ("protocol", "fp8")])
def test_step_times_section_runs_quick_on_cpu(tmp_path, job, kv):
    """e2e_harness.py's `step_times`: the job async (wall time only), then with every step timed; the timed steps are
    all of the job's steps, grouped by kind, and their sum fits in the job's wall time. FDLITE_STEP_TIMES_KV=fp8: the
    same over an FP8 KV cache, its results named for it."""
    # the shape by its full name, or by a word only it holds (moe_bench's --cases form)
    env = {"FDLITE_STEP_TIMES_KV": kv} if kv else {}
    res = run_section_quick_on_cpu(tmp_path, "step_times", FDLITE_STEP_TIMES_JOB=job,
                                   FDLITE_PROFILE_MODEL="qwen3_4b_dense" if job == "protocol" else "qwen3_4b", **env)
    tag = f"{job}_qwen3_4b_dense" + (f"_kv_{kv}" if kv else "")
    assert sorted(res["results"]) == sorted(f"{p}_{tag}" for p in ("async", "sync_timed"))
    timed = res["results"][f"sync_timed_{tag}"]
    assert res["results"][f"async_{tag}"]["generate_s"] > 0
    assert timed["kv_cache_dtype"] == (kv or "auto")  # the engine's cache, not just the results' name
    kinds = timed["by_kind"]
    assert sum(k["steps"] for k in kinds.values()) == timed["steps"] > 1
    assert 0 < timed["execute_s"] <= timed["generate_s"]
    prefill = sum(v["steps"] for k, v in kinds.items() if k == "with prefill tokens")
    decode = sum(v["steps"] for k, v in kinds.items() if k.startswith("decode <="))
    # 8 short prompts: one or two prefill steps, then the decode-only steps of their 8+ output tokens
    assert 1 <= prefill <= 2 and decode >= 7
    # the decode steps' fit: one per decode-only step; with its constant term, the parts add up to their time
    fit = timed["decode_fit"]
    assert fit["steps"] == decode
    assert fit["fixed_s"] + fit["rows_s"] + fit["kv_s"] == pytest.approx(fit["seconds"], abs=2e-3)
    assert fit["residual_rms_ms"] >= 0 and "kv_GB_s" in fit
    # the raw steps come back, one per step, and the fits by row count take the decode steps of their range
    assert len(timed["steps_raw"]) == timed["steps"]
    assert sum(t == d for t, d, _, _ in timed["steps_raw"]) == decode
    small = timed["decode_fit_by_rows"]["1-64"]
    assert small["steps"] == sum(1 for t, d, _, _ in timed["steps_raw"] if t == d and 1 <= d <= 64)


@pytest.mark.parametrize("value,why", [("llama3_70b", "names no shape"), ("qwen3", "names more than one shape")])
def test_step_times_section_names_the_shapes_for_a_bad_model(tmp_path, value, why):
    """An FDLITE_PROFILE_MODEL that is no shape (or several) stops the section at once with the known names."""
    env = {**os.environ, "FDLITE_E2E_DEVICE": "cpu", "FDLITE_PROFILE_MODEL": value}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu", "e2e_harness.py"), "step_times", "--quick",
                           "--out", str(tmp_path / "out"), "--models", str(tmp_path / "models")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert f"FDLITE_PROFILE_MODEL={value!r} {why}" in proc.stderr
    assert "llama31_8b_dense" in proc.stderr and "qwen3_06b" in proc.stderr
    assert not (tmp_path / "models").exists()  # nothing built
