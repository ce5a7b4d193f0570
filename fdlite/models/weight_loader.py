"""Load Hugging Face `*.safetensors` (single file or sharded with an index) into a decoder model.

Checkpoint names map onto the model's parameters one to one, except that q/k/v and gate/up are
stacked into the fused `qkv_proj` / `gate_up_proj` matrices, and linear weights are transposed
from Hugging Face's [out, in] to Paddle's [in, out], straight into the parameter (`_fill`: loading
time on CPU is mostly memory traffic and first-touch page faults, so every extra copy of 2.4 GB of
Qwen3-0.6B costs about a second). Shapes in messages are the checkpoint's. Every checkpoint tensor must land
somewhere and every parameter must be filled: a missing, unexpected or wrongly shaped tensor is an
error that names it.

With tensor parallelism each rank reads only its own slice of every split tensor
(`safe_open(...).get_slice(name)[rows]` reads just those bytes of the file), as `TPPartition` says:
rows of q/k/v, gate/up, the embedding and the LM head; columns of o_proj and down_proj. Norms and the
row-parallel biases are read whole. The fused matrices are assembled from the slices, so rank r's
qkv_proj is [q_r | k_r | v_r], the layout its attention splits.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from dataclasses import dataclass

import numpy as np
import paddle
from safetensors import safe_open

from fdlite.models.decoder import DecoderForCausalLM
from fdlite.models.tp_partition import TPPartition
from fdlite.ops import platform
from fdlite.ops.linear import Linear

# Tensors some exporters write that carry nothing the model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({os.path.join(path, name) for name in weight_map.values()})
        for file in files:
            if not os.path.isfile(file):
                raise FileNotFoundError(f"weight shard {os.path.basename(file)} listed in {index} is missing")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model folder {path!r} has no *.safetensors weight file")
    return files


@dataclass(frozen=True)
class Route:
    """Where one checkpoint tensor goes, and which part of it this rank reads."""

    target: str                 # model parameter
    piece: int | None           # position among the fused pieces ([q, k, v] / [gate, up]); None: the whole parameter
    axis: int | None = None     # checkpoint axis split across ranks; None: read whole
    start: int = 0
    stop: int = 0
    full: int = 0               # the checkpoint's length along `axis`


# (checkpoint infix, fused infix, piece): the stacked matrices.
_FUSED = [
    ("self_attn.q_proj.", "self_attn.qkv_proj.", 0),
    ("self_attn.k_proj.", "self_attn.qkv_proj.", 1),
    ("self_attn.v_proj.", "self_attn.qkv_proj.", 2),
    ("mlp.gate_proj.", "mlp.gate_up_proj.", 0),
    ("mlp.up_proj.", "mlp.gate_up_proj.", 1),
]


def route(name: str, model: DecoderForCausalLM) -> Route:
    """The `Route` of checkpoint tensor `name` for this model's rank."""
    tp: TPPartition = model.tp
    cfg = model.config
    q_full = cfg.num_attention_heads * cfg.head_dim
    spans = {  # checkpoint infix -> (this rank's range along axis 0, full length)
        "q_proj": (tp.q_range, q_full),
        "k_proj": (tp.kv_range, cfg.num_key_value_heads * cfg.head_dim),
        "v_proj": (tp.kv_range, cfg.num_key_value_heads * cfg.head_dim),
        "gate_proj": (tp.intermediate_range, cfg.intermediate_size),
        "up_proj": (tp.intermediate_range, cfg.intermediate_size),
    }
    for ckpt, fused, piece in _FUSED:
        if ckpt in name:
            (start, stop), full = spans[ckpt.split(".")[1]]
            return Route(name.replace(ckpt, fused), piece, 0, start, stop, full)
    if name.endswith("self_attn.o_proj.weight"):
        return Route(name, None, 1, *tp.q_range, q_full)
    if name.endswith("mlp.down_proj.weight"):
        return Route(name, None, 1, *tp.intermediate_range, cfg.intermediate_size)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return Route(name, None, 0, *tp.vocab_range, cfg.vocab_size)
    return Route(name, None)


def _read(f, name: str, r: Route, file: str) -> paddle.Tensor:
    """This rank's part of `name`: only those bytes are read from the file."""
    whole = r.axis is None or (r.start, r.stop) == (0, r.full)
    if f.get_slice(name).get_dtype() == "BF16" and not hasattr(paddle.base.core, "frombuffer"):
        return _read_bf16_bits(file, name, None if whole else r)
    if whole:
        return f.get_tensor(name)
    part = f.get_slice(name)
    index = (slice(r.start, r.stop),) if r.axis == 0 else (slice(None), slice(r.start, r.stop))
    # A copy: with safetensors 0.8 and Paddle 3.3.1, two live slices of one tensor abort the process at
    # exit ("The deleter of the pointer is not found", measured); a copy owns its memory.
    return part[index].clone()


def _read_bf16_bits(file: str, name: str, r: Route | None) -> paddle.Tensor:
    """A bfloat16 tensor read as its uint16 bits, which Paddle takes back as bfloat16.

    safetensors builds Paddle tensors through numpy when Paddle has no `core.frombuffer` (Paddle 2.6), and
    numpy has no bfloat16 ("data type 'bfloat16' not understood"); the file format is simple enough to read
    directly: an 8-byte header length, a JSON header with each tensor's byte range, then the data."""
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        info = json.loads(fh.read(n))[name]
    start, end = info["data_offsets"]
    bits = np.fromfile(file, dtype="<u2", count=(end - start) // 2, offset=8 + n + start).reshape(info["shape"])
    if r is not None:
        bits = bits[r.start : r.stop] if r.axis == 0 else bits[:, r.start : r.stop]
    return paddle.to_tensor(np.ascontiguousarray(bits), place=paddle.CPUPlace())


def load_weights(model: DecoderForCausalLM, path: str) -> None:
    params = dict(model.named_parameters())
    linear_weights = {f"{name}.weight" for name, layer in model.named_sublayers() if isinstance(layer, Linear)}
    # target param -> {piece: checkpoint name} still to fill
    pending: dict[str, dict[int | None, str]] = {name: {None: name} for name in params}
    for name in params:
        for ckpt, fused, _ in _FUSED:
            if fused in name:
                pending[name] = {p: name.replace(f, c) for c, f, p in _FUSED if f == fused}
                break
    parts: dict[str, dict] = {name: {} for name in params}

    for file in weight_files(path):
        # Host tensors (device="cpu"): stacking, casting and transposing run on the CPU whatever the device.
        with safe_open(file, framework="paddle", device="cpu") as f:
            for ckpt_name in f.keys():
                if ckpt_name.endswith(_IGNORED_SUFFIXES):
                    continue
                if ckpt_name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied: some exporters still write the copy
                r = route(ckpt_name, model)
                if r.target not in params:
                    raise ValueError(
                        f"unexpected tensor {ckpt_name!r} in {os.path.basename(file)}: "
                        f"{model.config.architecture} has no such weight"
                    )
                param = params[r.target]
                transposed = r.target in linear_weights
                local = list(param.shape)[::-1] if transposed else list(param.shape)  # checkpoint orientation
                expected = list(local)
                if r.axis is not None:
                    expected[r.axis] = r.full
                shape = list(f.get_slice(ckpt_name).get_shape())
                if shape != expected:
                    raise ValueError(
                        f"tensor {ckpt_name!r} in {os.path.basename(file)} has shape {shape}, "
                        f"expected {expected} from config.json"
                    )
                tensor = _read(f, ckpt_name, r, file)
                if tensor.dtype != param.dtype:
                    tensor = tensor.astype(param.dtype)
                if r.piece is None and r.axis is not None and tensor.shape[r.axis] < local[r.axis]:
                    # The last rank's vocabulary rows: zero padding up to vocab_per_rank.
                    pad = list(tensor.shape)
                    pad[r.axis] = local[r.axis] - tensor.shape[r.axis]
                    tensor = paddle.concat([tensor, paddle.zeros(pad, dtype=tensor.dtype)], axis=r.axis)
                parts[r.target][r.piece] = tensor  # checkpoint orientation; transposed once, into the parameter
                pending[r.target].pop(r.piece, None)

    missing = [ckpt for per_param in pending.values() for ckpt in per_param.values()]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"missing tensor {shown}{more} in the weights of {path!r}")

    fill = _fill_from_host if platform.is_gpu() else _fill
    with paddle.no_grad():
        for name, param in params.items():
            fill(param, parts.pop(name), transposed=name in linear_weights)


def _fill(param: paddle.Tensor, got: dict, transposed: bool) -> None:
    """Write the checkpoint pieces of one parameter into it, with one copy per byte where possible.

    Pieces are stacked along the checkpoint's output dimension (axis 0 of [out, in], the only axis of a
    bias), then a linear weight is transposed straight into the parameter: a strided copy reading the
    [out, in] view, with no transposed temporary. The parameter was created empty (`LazyGuard`), so this
    is its first and only allocation.
    """
    value = got[None] if None in got else paddle.concat([got[p] for p in sorted(got)], axis=0)
    if transposed:
        paddle.assign(value.t(), output=param)
    else:
        param.set_value(value)


def _fill_from_host(param: paddle.Tensor, got: dict, transposed: bool) -> None:
    """GPU: stack and transpose with Paddle's CPU kernels (the checkpoint tensors are host tensors), then one
    host-to-device copy into the parameter. No GPU kernel of Paddle's runs: on the Hoppers they do nothing."""
    value = got[None] if None in got else paddle.concat([got[p] for p in sorted(got)], axis=0)
    if transposed:
        value = value.t().contiguous()
    param.set_value(value.numpy())  # bfloat16 travels as its uint16 bits, which Paddle reads back as bfloat16
