"""Model ids ("org/name") resolved from the Hugging Face cache, offline, in a cache folder the test builds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from fdlite.model_source import is_model_id, resolve_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_with(model_dir: str, cache: str, repo_id: str) -> str:
    """A Hugging Face hub cache holding `model_dir` as the `main` snapshot of `repo_id` (the hub's own layout)."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(COMMIT)
    shutil.copytree(model_dir, os.path.join(repo, "snapshots", COMMIT))
    return cache


def run_offline(code: str, cache: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": cache,
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_ids_and_paths_are_told_apart(tmp_path, monkeypatch):
    assert is_model_id("Qwen/Qwen3-0.6B") and is_model_id("baidu/ERNIE-4.5-0.3B-PT")
    assert not any(is_model_id(p) for p in ("/abs/path", "./Qwen/x", "~/models/x", "a/b/c", "model"))
    # A folder named like an id wins over the hub.
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"


def test_model_id_from_the_offline_cache(model_dirs, tmp_path):
    from hf_models import add_qwen3_tokenizer

    model = add_qwen3_tokenizer(shutil.copytree(model_dirs["qwen3"], str(tmp_path / "model")))
    cache = cache_with(model, str(tmp_path / "hub"), "test-org/tiny-qwen3")
    out = run_offline(
        "from fdlite import LLM, SamplingParams\n"
        "llm = LLM('test-org/tiny-qwen3', max_num_seqs=2, max_model_len=64)\n"
        "print('PATH', llm.model_path, llm.get_tokenizer() is not None)\n"
        "o = llm.generate({'prompt_token_ids': [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)\n"
        "print('TOKENS', len(o[0].outputs[0].token_ids))\n", cache)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"PATH {cache}/models--test-org--tiny-qwen3/snapshots/{COMMIT} True" in out.stdout
    assert "TOKENS 3" in out.stdout


def test_missing_id_offline_says_where_it_looked(tmp_path):
    cache = str(tmp_path / "empty-hub")
    out = run_offline("from fdlite import LLM\nLLM('Qwen/Qwen3-0.6B')\n", cache)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("FileNotFoundError: model 'Qwen/Qwen3-0.6B' is not a folder and not in the Hugging Face cache")
    assert cache in last and "HF_HUB_OFFLINE" in last and "pass the path of a model folder" in last


def test_job_file_keeps_a_model_id(tmp_path):
    from fdlite.jobs.job_config import load_job

    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "job.yaml").write_text("model: Qwen/Qwen3-0.6B\ninput: in.jsonl\noutput: out.jsonl\n")
    job = load_job(str(tmp_path / "job.yaml"))
    assert job.engine.model == "Qwen/Qwen3-0.6B"
    assert job.output == str(tmp_path / "out.jsonl")  # other paths still relative to the file
