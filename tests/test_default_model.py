"""fdlite.default_model: the built-in tiny Qwen3 folder is complete, deterministic, reused and loads in HF."""

import gzip
import hashlib
import json
import os
import threading

import numpy as np
import pytest
from env_patch import EnvMonkeyPatch
from safetensors.numpy import load_file

from fdlite import default_model
from fdlite.default_model import DEFAULT_MODEL_NAME, default_model_path

ASSETS = os.path.join(os.path.dirname(default_model.__file__), "assets", "qwen3_tokenizer")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    with EnvMonkeyPatch.context() as mp:
        mp.setenv("FDLITE_CACHE", str(tmp_path_factory.mktemp("fdlite_cache")))
        return default_model_path()


def _expected_names(layers):
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    return names


def test_folder_layout_and_config(model_dir):
    assert DEFAULT_MODEL_NAME == "fdlite-default-qwen3-tiny"
    assert os.path.basename(model_dir) == "default-model-v1"
    for name in default_model._FILES:
        assert os.path.isfile(os.path.join(model_dir, name)), name
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert (config["vocab_size"], config["hidden_size"], config["intermediate_size"]) == (151936, 128, 384)
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (2, 4, 2)
    assert config["head_dim"] == 64 and config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == 151645 and config["bos_token_id"] == 151643
    with open(os.path.join(model_dir, "generation_config.json")) as f:
        assert 151645 in json.load(f)["eos_token_id"]
    # No leftover temporary folders next to it.
    assert os.listdir(os.path.dirname(model_dir)) == ["default-model-v1"]


def test_weights(model_dir):
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    assert set(tensors) == _expected_names(2)  # exact HF names, no lm_head (tied)
    assert all(t.dtype == np.float32 for t in tensors.values())
    assert tensors["model.embed_tokens.weight"].shape == (151936, 128)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (256, 128)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (128, 128)
    assert tensors["model.layers.1.self_attn.o_proj.weight"].shape == (128, 256)
    assert tensors["model.layers.1.mlp.down_proj.weight"].shape == (128, 384)
    assert tensors["model.layers.1.self_attn.q_norm.weight"].shape == (64,)
    np.testing.assert_array_equal(tensors["model.norm.weight"], np.ones(128, np.float32))
    std = float(tensors["model.embed_tokens.weight"].std())
    assert 0.019 < std < 0.021


def test_tokenizer_files_are_the_shipped_qwen3_ones(model_dir):
    with gzip.open(os.path.join(ASSETS, "tokenizer.json.gz"), "rb") as f:
        shipped = f.read()
    with open(os.path.join(model_dir, "tokenizer.json"), "rb") as f:
        assert f.read() == shipped
    # The hash recorded in NOTICE is the upstream file's.
    with open(os.path.join(ASSETS, "NOTICE")) as f:
        assert hashlib.sha256(shipped).hexdigest() in f.read()


def test_deterministic_and_reused(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FDLITE_CACHE", str(tmp_path))
    other = default_model_path()
    assert other == str(tmp_path / "default-model-v1")
    a = load_file(os.path.join(model_dir, "model.safetensors"))
    b = load_file(os.path.join(other, "model.safetensors"))
    assert all(np.array_equal(a[k], b[k]) for k in a)  # seed 0: same weights on every build

    stat = os.stat(os.path.join(other, "model.safetensors"))

    def must_not_rebuild(folder):
        raise AssertionError("default model rebuilt although present")

    monkeypatch.setattr(default_model, "_write_folder", must_not_rebuild)
    assert default_model_path() == other
    assert os.stat(os.path.join(other, "model.safetensors")).st_mtime_ns == stat.st_mtime_ns


def test_incomplete_folder_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("FDLITE_CACHE", str(tmp_path))
    broken = tmp_path / "default-model-v1"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    path = default_model_path()
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["model_type"] == "qwen3"
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    assert sorted(os.listdir(tmp_path)) == ["default-model-v1"]


def test_concurrent_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("FDLITE_CACHE", str(tmp_path))
    results, errors = [], []

    def build():
        try:
            results.append(default_model_path())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert sorted(os.listdir(tmp_path)) == ["default-model-v1"]
    assert default_model._is_complete(results[0])


def test_loads_in_transformers(model_dir):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model, info = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    emb = load_file(os.path.join(model_dir, "model.safetensors"))["model.embed_tokens.weight"]
    np.testing.assert_array_equal(model.model.embed_tokens.weight.detach().numpy(), emb)
    with torch.no_grad():
        logits = model(torch.tensor([[151644, 872, 198, 6023]])).logits
    assert logits.shape == (1, 4, 151936) and torch.isfinite(logits).all()
