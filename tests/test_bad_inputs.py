"""Each class of bad input gets a clear error naming the problem; batch-mates still complete."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from fdlite import LLM, SamplingParams

OPTS = dict(skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_model_len=128)


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["qwen3"], **OPTS)


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def copy_with_tensors(src, dst, edit):
    """A copy of the model at `src` whose safetensors file went through `edit(tensors)`."""
    path = copy_model(src, dst)
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f)
    return path


def test_empty_and_too_long_prompts_fail_alone(llm):
    good = {"prompt_token_ids": [5, 6, 7]}
    outs = llm.generate([good, {"prompt_token_ids": []}, {"prompt_token_ids": list(range(3, 131))}, good,
                         {"prompt_token_ids": [5, 99999]}],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert outs[1].error == "prompt is empty"
    assert "128 tokens" in outs[2].error and "max_model_len=128" in outs[2].error
    assert "99999" in outs[4].error and "vocabulary" in outs[4].error
    for bad in (outs[1], outs[2], outs[4]):
        assert bad.finished and bad.outputs[0].finish_reason == "error"
    for ok in (outs[0], outs[3]):
        assert ok.error is None and len(ok.outputs[0].token_ids) == 4
    assert outs[0].outputs[0].token_ids == outs[3].outputs[0].token_ids


def test_empty_text_prompt_fails_alone():
    llm = LLM(max_num_seqs=2, max_model_len=256)  # built-in default model, real tokenizer
    outs = llm.generate(["", "Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert outs[0].error == "prompt is empty"
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 3


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(logprobs=-1), "logprobs"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_invalid_sampling_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_count_must_match(llm):
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate([[5], [6], [7]], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_unknown_option_is_named(model_dirs):
    with pytest.raises(ValueError, match="unknown option 'max_num_seq'; did you mean 'max_num_seqs'"):
        LLM(model_dirs["qwen3"], max_num_seq=4)


def test_missing_weight_file(model_dirs, tmp_path):
    path = copy_model(model_dirs["qwen3"], tmp_path / "m")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weight file"):
        LLM(path, **OPTS)


def test_missing_tensor_is_named(model_dirs, tmp_path):
    path = copy_with_tensors(model_dirs["qwen3"], tmp_path / "m",
                             lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.self_attn.k_norm.weight'"):
        LLM(path, **OPTS)


def test_wrong_tensor_shape_is_named(model_dirs, tmp_path):
    path = copy_with_tensors(model_dirs["qwen2"], tmp_path / "m",
                             lambda t: t.update({"model.layers.0.mlp.up_proj.weight": np.zeros((100, 64), np.float32)}))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.weight'.*shape \[100, 64\], expected \[128, 64\]"):
        LLM(path, **OPTS)


def test_unexpected_tensor_is_named(model_dirs, tmp_path):
    # A Qwen2 checkpoint (q/k/v biases) declared as Qwen3 (no biases, q/k norms).
    path = copy_model(model_dirs["qwen2"], tmp_path / "m")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["architectures"], cfg["model_type"] = ["Qwen3ForCausalLM"], "qwen3"
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.[qkv]_proj.bias'"):
        LLM(path, **OPTS)


def test_unknown_architecture(model_dirs, tmp_path):
    path = copy_model(model_dirs["llama"], tmp_path / "m")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["architectures"] = ["GPTBigCodeForCausalLM"]
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="unknown architecture 'GPTBigCodeForCausalLM'.*supported: .*LlamaForCausalLM"):
        LLM(path, **OPTS)


def test_missing_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(tmp_path / "nowhere"))


def test_kv_cache_too_small_for_one_sequence(model_dirs):
    with pytest.raises(ValueError, match="fewer than the 8 one max_model_len=128"):
        LLM(model_dirs["qwen3"], num_gpu_blocks_override=3, **OPTS)


def test_half_precision_on_cpu_is_refused(model_dirs):
    with pytest.raises(ValueError, match="bfloat16.*cannot run on CPU"):
        LLM(model_dirs["qwen3"], dtype="bfloat16", **OPTS)
