"""Startup cost of the model's construction and weight loading (issue 24, "ready in seconds").

The rotary cos/sin table is built once per model, for max_model_len positions, and converted on the host with
numpy; the loader copies each checkpoint tensor (or this rank's slice of it) once into its place, and on the
GPU path (emulated, `gpu_emulator.py`) straight from the memory-mapped file into the device parameter, with
no Paddle CPU kernel (cast, transpose, concat) on the way for Hugging Face checkpoints.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

import gpu_emulator
from fdlite import LLM
from fdlite.layers import rotary
from fdlite.models import decoder

OPTS = dict(skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_num_batched_tokens=96,
            kv_cache_memory_bytes=1 << 22)


def test_rotary_table_is_built_once_per_model_for_max_model_len(model_dirs, monkeypatch):
    built = []

    class Counting(rotary.RotaryEmbedding):
        def __init__(self, head_dim, max_positions, *a, **k):
            built.append(max_positions)
            super().__init__(head_dim, max_positions, *a, **k)

    monkeypatch.setattr(decoder, "RotaryEmbedding", Counting)
    llm = LLM(model_dirs["qwen3"], max_model_len=200, **OPTS)
    model = llm.runner.model
    assert built == [200]
    tables = {id(layer.self_attn.attn.rotary) for layer in model.model.layers}
    assert tables == {id(model.model.rotary_emb)} and len(model.model.layers) > 1
    assert list(model.model.rotary_emb.cos.shape) == [200, model.config.head_dim]


def test_rotary_table_in_bfloat16_is_rounded_on_the_host_as_paddle_casts():
    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * 3
    x[:4] = [np.inf, -np.inf, 3.4e38, 1e-40]
    bits = rotary.host_bits(x, "bfloat16")
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits, paddle.to_tensor(x).astype("bfloat16").numpy())
    table = rotary.RotaryEmbedding(64, 50, 10000.0, None, "bfloat16")
    assert table.cos.dtype == paddle.bfloat16 and list(table.cos.shape) == [50, 64]
    want = rotary.RotaryEmbedding(64, 50, 10000.0, None, "float32").cos.astype("bfloat16")
    np.testing.assert_array_equal(table.cos.numpy(), want.numpy())


# ---- the loader ------------------------------------------------------------------------------------

def _load(path: str, dtype: str = "float32", tp=None):
    from fdlite.models.model_config import ModelConfig
    from fdlite.models.registry import model_class
    from fdlite.models.weight_loader import load_weights

    cfg = ModelConfig.from_dir(path)
    model = model_class(cfg.architecture)(cfg, dtype, 64, tp)
    load_weights(model, path)
    return model


def _same_weights(gpu_model, cpu_model) -> None:
    """The emulated GPU model holds the CPU model's values, linear and expert weights transposed ([out, in])."""
    from fdlite.layers.linear import Linear
    from fdlite.layers.moe import FusedMoE

    linear = {f"{n}.weight" for n, l in gpu_model.named_sublayers() if isinstance(l, Linear)}
    experts = {f"{n}.{w}" for n, l in gpu_model.named_sublayers() if isinstance(l, FusedMoE)
               for w in ("gate_up_proj", "down_proj")}  # [E, out, in] on the GPU, [E, in, out] on the CPU
    cpu = {k: v.numpy() for k, v in cpu_model.named_parameters()}
    for name, p in gpu_model.named_parameters():
        got = p.numpy()
        want = cpu[name].T if name in linear else cpu[name].transpose(0, 2, 1) if name in experts else cpu[name]
        np.testing.assert_array_equal(got, want, err_msg=name)


def _nan_filled_allocations(m) -> None:
    """paddle.empty gives NaN-filled memory (fresh pages would be zeros): a byte the loader leaves unwritten shows."""
    full = paddle.full

    def empty(shape, dtype=None, name=None):
        return full(shape, float("nan") if "float" in str(dtype) else 7, dtype=dtype)

    m.setattr(paddle, "empty", empty)


def _refuse_paddle_host_ops(m) -> None:
    def refuse(name):
        def f(*a, **k):
            raise AssertionError(f"{name} ran while loading")
        return f

    for name in ("transpose", "concat", "stack", "cast", "assign", "index_select", "zeros", "to_tensor"):
        m.setattr(paddle, name, refuse(f"paddle.{name}"))
    for name in ("astype", "t", "contiguous", "set_value", "numpy", "clone"):
        m.setattr(paddle.Tensor, name, refuse(f"Tensor.{name}"))


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "qwen3_moe"])
def test_emulated_gpu_loader_copies_each_tensor_once_straight_from_the_mapped_file(model_dirs, family, monkeypatch):
    """Hugging Face layout, checkpoint dtype = model dtype: one host-to-device copy per checkpoint tensor, each
    from the memory-mapped file itself (no host copy, no numpy conversion, no Paddle op), into its rows of the
    parameter; the copies of a fused parameter's pieces together fill it exactly once."""
    from safetensors import safe_open

    from fdlite.models import weight_loader

    path = model_dirs[family]
    want = _load(path)
    gpu_emulator.install(monkeypatch)
    maps, copies = [], []
    real_init, real_copy = weight_loader.SafetensorsFile.__init__, gpu_emulator.copy_from_host_many

    def init(self, file):
        real_init(self, file)
        a = np.frombuffer(self._map, np.uint8)
        maps.append((a.ctypes.data, a.ctypes.data + a.nbytes))

    def copy_many(dst, src, nbytes):
        copies.extend(zip(dst, src, nbytes))
        real_copy(dst, src, nbytes)

    monkeypatch.setattr(weight_loader.SafetensorsFile, "__init__", init)
    monkeypatch.setattr(weight_loader.gpu_ops, "copy_from_host_many", copy_many)
    from fdlite.models.model_config import ModelConfig
    from fdlite.models.registry import model_class

    cfg = ModelConfig.from_dir(path)
    model = model_class(cfg.architecture)(cfg, "float32", 64)
    with pytest.MonkeyPatch.context() as m:
        _nan_filled_allocations(m)
        _refuse_paddle_host_ops(m)
        m.setattr(weight_loader, "_write", lambda *a: (_ for _ in ()).throw(AssertionError("a host conversion ran")))
        weight_loader.load_weights(model, path)
    with safe_open(f"{path}/model.safetensors", framework="numpy") as f:
        names = [k for k in f.keys() if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    assert len(copies) == len(names)
    assert all(any(lo <= s and s + n <= hi for lo, hi in maps) for _, s, n in copies)
    params = dict(model.named_parameters())
    assert sum(n for _, _, n in copies) == sum(int(np.prod(p.shape)) * 4 for p in params.values())
    spans = sorted((d, d + n) for d, _, n in copies)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no byte written twice
    _same_weights(model, want)


def test_emulated_gpu_loader_keeps_bfloat16_bits(tmp_path, monkeypatch):
    """A bfloat16 checkpoint into a bfloat16 model: the parameters hold the file's bits."""
    import torch
    import transformers
    from safetensors import safe_open

    from hf_models import write_random_model

    path = write_random_model(str(tmp_path / "m"), "qwen2", seed=4)
    transformers.AutoModelForCausalLM.from_pretrained(path).to(torch.bfloat16).save_pretrained(path)
    gpu_emulator.install(monkeypatch)
    model = _load(path, "bfloat16")
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        ckpt = {k: f.get_tensor(k).view(torch.int16).numpy().view(np.uint16) for k in f.keys()}
    params = {k: v.numpy() for k, v in model.named_parameters()}
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    np.testing.assert_array_equal(params[a + "qkv_proj.weight"], np.concatenate(
        [ckpt[a + "q_proj.weight"], ckpt[a + "k_proj.weight"], ckpt[a + "v_proj.weight"]]))
    np.testing.assert_array_equal(params[m + "gate_up_proj.weight"],
                                  np.concatenate([ckpt[m + "gate_proj.weight"], ckpt[m + "up_proj.weight"]]))
    np.testing.assert_array_equal(params["lm_head.weight"], ckpt["lm_head.weight"])
    np.testing.assert_array_equal(params["model.norm.weight"], ckpt["model.norm.weight"])


@pytest.mark.parametrize("family", ["qwen3_moe", "ernie45_moe", "paddle:ernie45", "paddle:ernie45_moe", "tp:qwen2"])
def test_emulated_gpu_loader_matches_the_cpu_loader(model_dirs, tmp_path, family, monkeypatch):
    """Everything that is not one plain copy per Hugging Face tensor: experts from a Paddle checkpoint, a Paddle
    checkpoint ([in, out], fused, transposed and ERNIE's rows reordered with numpy), a float32 checkpoint into
    a bfloat16 model, and a tensor-parallel rank's slices with the zero rows past the vocabulary."""
    from hf_models import save_paddle_layout

    from fdlite.models.model_config import ModelConfig
    from fdlite.models.tp_partition import TPPartition

    tp = None
    if family.startswith("paddle:"):
        path = save_paddle_layout(model_dirs[family[7:]], str(tmp_path / "p"), "ernie.")
    elif family.startswith("tp:"):
        from hf_models import write_random_model

        path = write_random_model(str(tmp_path / "tp"), family[3:], vocab_size=509)
        tp = TPPartition.of(ModelConfig.from_dir(path), 1, 2)
        assert tp.vocab_range[1] - tp.vocab_range[0] < tp.vocab_per_rank  # zero rows past the vocabulary
    else:
        path = model_dirs[family]
    want = _load(path, tp=tp)
    gpu_emulator.install(monkeypatch)
    _nan_filled_allocations(monkeypatch)
    with pytest.MonkeyPatch.context() as m:
        for name in ("transpose", "concat", "stack", "index_select"):
            m.setattr(paddle, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError("a Paddle op ran")))
        got = _load(path, tp=tp)
    _same_weights(got, want)
    half = _load(path, "bfloat16", tp=tp)
    for name, p in half.named_parameters():
        ref = dict(got.named_parameters())[name].numpy()
        if p.dtype == paddle.bfloat16:
            np.testing.assert_array_equal(p.numpy(), rotary.host_bits(ref, "bfloat16"), err_msg=name)
        else:
            np.testing.assert_array_equal(p.numpy(), ref, err_msg=name)
