"""`load_format="dummy"`: an engine from config.json alone, with seeded pseudo-random weights
(fdlite/models/dummy_weights.py)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from fdlite import LLM, SamplingParams
from fdlite.cli import main as cli_main
from fdlite.default_model import CONFIG as DEFAULT_CONFIG
from fdlite.jobs.job_config import JobConfigError, load_job
from fdlite.models import dummy_weights
from fdlite.models.model_config import ModelConfig
from fdlite.models.registry import model_class
from fdlite.models.tp_partition import TPPartition
from hf_models import MOE_FAMILIES, add_qwen3_tokenizer

PROMPTS = [[5, 6, 7, 8], list(range(20, 60)), [300, 2, 9]]
OPTIONS = dict(skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_model_len=128)
FAMILIES = ("qwen3", "ernie45", *MOE_FAMILIES)


@pytest.fixture(scope="module")
def config_only(model_dirs, tmp_path_factory):
    """family -> a folder holding only the family's config.json (no weights, no tokenizer)."""
    root = tmp_path_factory.mktemp("config_only")
    out = {}
    for fam in FAMILIES:
        os.makedirs(root / fam)
        shutil.copyfile(os.path.join(model_dirs[fam], "config.json"), root / fam / "config.json")
        out[fam] = str(root / fam)
    return out


def generate(path: str, seed: int = 0, **sampling) -> tuple[list[list[int]], list]:
    with LLM(path, load_format="dummy", seed=seed, **OPTIONS) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(**{"temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": 2,
                                              **sampling}), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_dummy_engine_runs_from_config_alone_and_repeats_for_a_seed(config_only, family):
    assert os.listdir(config_only[family]) == ["config.json"]
    tokens, logprobs = generate(config_only[family])
    vocab = ModelConfig.from_dir(config_only[family]).vocab_size
    assert [len(t) for t in tokens] == [6] * len(PROMPTS)
    assert all(0 <= t < vocab for row in tokens for t in row)
    values = [lp.logprob for row in logprobs for step in row for lp in step.values()]
    assert values and np.isfinite(values).all()
    again, _ = generate(config_only[family])
    assert again == tokens
    sampled = generate(config_only[family], temperature=0.8, seed=7)[0]
    assert generate(config_only[family], temperature=0.8, seed=7)[0] == sampled


def test_another_seed_is_another_model(config_only):
    assert generate(config_only["qwen3_moe"], seed=0)[0] != generate(config_only["qwen3_moe"], seed=1)[0]


def build(path: str, rank: int = 0, size: int = 1):
    cfg = ModelConfig.from_dir(path)
    return model_class(cfg.architecture)(cfg, "float32", 128, TPPartition.of(cfg, rank, size))


@pytest.mark.parametrize("family", ["ernie45", "ernie45_moe"])
def test_values_norms_one_biases_zero_weights_at_initializer_range(config_only, family):
    model = build(config_only[family])
    dummy_weights.fill_dummy_weights(model, seed=3)
    params = {k: v.numpy() for k, v in model.named_parameters()}
    std = ModelConfig.from_dir(config_only[family]).raw["initializer_range"]
    norms = [k for k in params if "norm" in k]
    biases = [k for k in params if k.endswith("bias")]
    assert norms and biases  # ERNIE here: biases on every projection (and the router's correction bias for MoE)
    for k in norms:
        assert (params[k] == 1).all(), k
    for k in biases:
        assert not params[k].any(), k
    weights = [k for k in params if k not in norms and k not in biases]
    everything = np.concatenate([params[k].ravel() for k in weights])
    assert abs(everything.std() - std) < 0.05 * std and abs(everything.mean()) < 0.05 * std
    # Each parameter starts at its own offset in the block: no two share their first values.
    heads = {params[k].ravel()[:8].tobytes() for k in weights}
    assert len(heads) == len(weights)
    # Rows of a matrix are not copies of each other (the block's length is prime).
    m = params[weights[1]].reshape(params[weights[1]].shape[0], -1)
    assert len({r.tobytes() for r in m}) == m.shape[0]


def test_initializer_range_default():
    assert dummy_weights.dummy_std({}) == 0.02
    assert dummy_weights.dummy_std({"initializer_range": 0.006}) == 0.006


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_tensor_parallel_ranks_fill_their_own_shards_and_share_the_router(config_only, family):
    per_rank = []
    for rank in (0, 1):
        model = build(config_only[family], rank, 2)
        dummy_weights.fill_dummy_weights(model, seed=0)
        per_rank.append({k: v.numpy() for k, v in model.named_parameters()})
    zero, one = per_rank
    routers = [k for k in zero if k.endswith("experts.gate.weight")]
    assert routers
    for k in routers:  # replicated: every rank must route the same tokens to the same experts
        np.testing.assert_array_equal(zero[k], one[k])
    split = [k for k in zero if k.endswith(("qkv_proj.weight", "o_proj.weight", "experts.gate_up_proj",
                                            "experts.down_proj", "embed_tokens.weight"))]
    assert split
    for k in split:
        assert zero[k].shape == one[k].shape and not np.array_equal(zero[k], one[k]), k


def test_bad_load_format_is_refused_naming_the_option(config_only):
    with pytest.raises(ValueError, match="load_format must be auto .* or dummy .*got 'pt'"):
        LLM(config_only["qwen3"], load_format="pt", **OPTIONS)


def test_without_dummy_a_config_only_folder_says_how(config_only):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors.*load_format='dummy'"):
        LLM(config_only["qwen3"], **OPTIONS)


@pytest.fixture(scope="module")
def config_and_tokenizer(tmp_path_factory):
    """The built-in model's config.json (Qwen3's vocabulary) and the Qwen3 tokenizer, no weights."""
    path = tmp_path_factory.mktemp("config_tok")
    (path / "config.json").write_text(json.dumps(DEFAULT_CONFIG))
    return add_qwen3_tokenizer(str(path))


def test_command_line_and_yaml_take_load_format(config_and_tokenizer, tmp_path, capsys):
    # The tokenizer is still loaded (skip_tokenizer_init is not implied): text in, text out.
    rc = cli_main(["generate", "Hello", "--model", config_and_tokenizer, "--load-format", "dummy", "--max-tokens", "3",
                   "--temperature", "0", "--max-model-len", "64", "--max-num-seqs", "2"])
    assert rc == 0 and capsys.readouterr().out.strip()
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {config_and_tokenizer}\nload_format: dummy\ninput: in.jsonl\noutput: o.jsonl\n")
    assert load_job(str(job)).engine.load_format == "dummy"
    job.write_text("load_format: random\ninput: in.jsonl\noutput: o.jsonl\n")
    with pytest.raises(JobConfigError, match="load_format must be auto"):
        load_job(str(job))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_path_copies_the_cpu_values_in_the_gpu_layout_without_paddle_kernels(config_only, monkeypatch, dtype):
    """The GPU branch (emulated: fdlite's host-to-device copy is a memmove here) writes each parameter's flat
    values, in its dtype's bits (bfloat16: the float32 values rounded on the host), with no Paddle kernel."""
    import gpu_emulator
    from fdlite.layers.rotary import host_bits
    from test_gpu_path_cpu import _forbid_builtin_compute

    path = config_only["qwen3_moe"]
    cpu = build(path)
    dummy_weights.fill_dummy_weights(cpu, seed=5)
    want = {k: v.numpy().ravel() for k, v in cpu.named_parameters()}
    calls = gpu_emulator.install(monkeypatch)
    cfg = ModelConfig.from_dir(path)
    gpu = model_class(cfg.architecture)(cfg, dtype, 128, TPPartition.single(cfg))
    _forbid_builtin_compute(monkeypatch)
    dummy_weights.fill_dummy_weights(gpu, seed=5)
    got = {k: v for k, v in gpu.named_parameters()}
    assert got.keys() == want.keys() and calls["copy_from_host_many"] == len(got)
    assert list(got["model.layers.1.mlp.experts.gate_up_proj"].shape) == [8, 64, 64]  # [E, 2 * I, hidden]
    for k, param in got.items():
        bits = param.numpy().ravel()
        expect = host_bits(want[k], dtype)
        assert bits.dtype == expect.dtype and np.array_equal(bits, expect), k
