"""Load `*.safetensors` (single file or sharded with an index) into a decoder model, in either layout.

Two layouts, told apart from the files (`detect_layout`), never from a flag: Hugging Face's (`-PT`
repositories; `model.` names, [out, in] linear weights) and Paddle's (`-Paddle` repositories, what
FastDeploy users have on disk: an `ernie.`-style prefix, [in, out] weights, q/k/v and gate/up fused
into `qkv_proj` / `up_gate_proj`). A Paddle name is spelled the Hugging Face way first (prefix,
fused tensors split into their parts), then both follow one route; shapes are checked in the
checkpoint's own orientation and a mismatch names the tensor and the layout.

MoE checkpoints store one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...); they are
stacked into the [experts, in, out] parameters of `fdlite/layers/moe.py`, each rank reading its columns of
every expert. ERNIE's q/k rows are reordered within each head (`_deinterleave`, see
`DecoderSpec.rope_interleaved`).

Checkpoint names map onto the model's parameters one to one, except that q/k/v and gate/up are
stacked into the fused `qkv_proj` / `gate_up_proj` matrices, and linear weights land in the device's
orientation (`Linear.weight_out_in`: [in, out] on CPU, [out, in] on GPU), transposed when the checkpoint's
differs, straight into the parameter (`_fill`: loading
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
import re
import struct
from dataclasses import dataclass

import numpy as np
import paddle
from safetensors import safe_open

from fdlite.models.decoder import DecoderForCausalLM
from fdlite.models.tp_partition import TPPartition
from fdlite.kernels import platform
from fdlite.layers.linear import Linear

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
class Layout:
    """How a checkpoint spells the model: Hugging Face's (`model.` names, linear weights [out, in]) or
    Paddle's (`ernie.`-style prefix, [in, out] weights, fused `qkv_proj` / `up_gate_proj`)."""

    transposed: bool   # linear weights stored [in, out]
    prefix: str        # the first name component in place of `model.`

    @property
    def name(self) -> str:
        return "Paddle ([in, out] weights)" if self.transposed else "Hugging Face ([out, in] weights)"


@dataclass(frozen=True)
class Route:
    """Where one checkpoint tensor goes, and which part of it this rank reads (axes in [out, in] orientation)."""

    target: str                 # model parameter
    piece: object = None        # key among the pieces stacked into the parameter; None: the whole parameter
    axis: int | None = None     # checkpoint axis split across ranks; None: read whole
    start: int = 0
    stop: int = 0
    full: int = 0               # the checkpoint's length along `axis`
    expert: bool = False        # a slice [e] of a stacked [experts, ...] parameter (piece = (e, part))
    head_dim: int = 0           # > 0: rows are heads of this size, interleaved rope -> halves (see DecoderSpec)


# (checkpoint infix, fused infix, piece): the stacked matrices.
_FUSED = [
    ("self_attn.q_proj.", "self_attn.qkv_proj.", 0),
    ("self_attn.k_proj.", "self_attn.qkv_proj.", 1),
    ("self_attn.v_proj.", "self_attn.qkv_proj.", 2),
    ("mlp.gate_proj.", "mlp.gate_up_proj.", 0),
    ("mlp.up_proj.", "mlp.gate_up_proj.", 1),
    ("mlp.shared_experts.gate_proj.", "mlp.shared_experts.gate_up_proj.", 0),
    ("mlp.shared_experts.up_proj.", "mlp.shared_experts.gate_up_proj.", 1),
]
# Paddle checkpoints' fused tensors (infix -> the Hugging Face parts, in column order: FastDeploy's
# `up_gate_proj` holds the gate columns first, as its swiglu reads them).
_PADDLE_FUSED = [
    ("self_attn.qkv_proj.", ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.")),
    ("up_gate_proj.", ("gate_proj.", "up_proj.")),
]
# Parameters named differently in the model than in checkpoints.
_RENAMED = [
    ("mlp.gate.weight", "mlp.experts.gate.weight"),
    ("mlp.moe_statics.e_score_correction_bias", "mlp.experts.e_score_correction_bias"),
]
_EXPERT = re.compile(r"^(.*\.mlp\.)experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def _mlp_width(name: str, cfg) -> int:
    """The full intermediate size of the MLP `name` belongs to."""
    if ".shared_experts." in name:
        return cfg.moe_intermediate_size * (cfg.raw.get("moe_num_shared_experts") or 0)
    if ".experts." in name:
        return cfg.moe_intermediate_size
    return cfg.intermediate_size


def route(name: str, model: DecoderForCausalLM) -> Route:
    """The `Route` of checkpoint tensor `name` (Hugging Face spelling) for this model's rank."""
    tp: TPPartition = model.tp
    cfg = model.config
    q_full = cfg.num_attention_heads * cfg.head_dim
    m = _EXPERT.match(name)
    if m:
        prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
        full = cfg.moe_intermediate_size
        if kind == "down":
            return Route(f"{prefix}experts.down_proj", (e, 0), 1, *tp.shard(full), full, expert=True)
        return Route(f"{prefix}experts.gate_up_proj", (e, 0 if kind == "gate" else 1), 0, *tp.shard(full), full,
                     expert=True)
    for ckpt, model_name in _RENAMED:
        if name.endswith(ckpt):
            return Route(name[: -len(ckpt)] + model_name)
    interleaved = model.spec.rope_interleaved
    spans = {  # checkpoint infix -> (this rank's range along axis 0, full length)
        "q_proj": (tp.q_range, q_full),
        "k_proj": (tp.kv_range, cfg.num_key_value_heads * cfg.head_dim),
        "v_proj": (tp.kv_range, cfg.num_key_value_heads * cfg.head_dim),
    }
    for ckpt, fused, piece in _FUSED:
        if ckpt in name:
            kind = ckpt.split(".")[-2]
            if kind in spans:
                (start, stop), full = spans[kind]
            else:
                full = _mlp_width(name, cfg)
                start, stop = tp.shard(full)
            head_dim = cfg.head_dim if interleaved and kind in ("q_proj", "k_proj") else 0
            return Route(name.replace(ckpt, fused), piece, 0, start, stop, full, head_dim=head_dim)
    if name.endswith("self_attn.o_proj.weight"):
        return Route(name, None, 1, *tp.q_range, q_full)
    if name.endswith("down_proj.weight"):
        full = _mlp_width(name, cfg)
        return Route(name, None, 1, *tp.shard(full), full)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return Route(name, None, 0, *tp.vocab_range, cfg.vocab_size)
    return Route(name, None)


def _ignored(name: str) -> bool:
    # ERNIE's multi-token-prediction layers (`mtp_*`) serve speculative decoding, which fdlite does not do.
    return name.endswith(_IGNORED_SUFFIXES) or ".mtp" in name or name.startswith("mtp")


def detect_layout(files: list[str], model: DecoderForCausalLM, linear_params: dict[str, bool]) -> Layout:
    """The checkpoint's layout, from its names and shapes (headers only, no tensor data read).

    Names: anything but `model.` / `lm_head.` as the first component is a Paddle-style prefix. Shapes:
    the first non-square linear weight whose shape is its Hugging Face shape reversed says [in, out]
    (Paddle checkpoints with Hugging Face names exist too); with none, the names decide."""
    prefix = "model"
    shapes = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():
                if _ignored(name):
                    continue
                head = name.split(".", 1)[0]
                if head not in ("model", "lm_head"):
                    prefix = head
                shapes[name] = list(f.get_slice(name).get_shape())
    params = dict(model.named_parameters())
    for name, shape in shapes.items():
        canon = "model." + name.split(".", 1)[1] if name.split(".", 1)[0] == prefix else name
        if len(shape) != 2 or shape[0] == shape[1] or any(p in canon for p, _ in _PADDLE_FUSED):
            continue
        r = route(canon, model)
        if r.target not in params or (r.target not in linear_params and not r.expert):
            continue
        hf = _expected(r, params[r.target], True, linear_params.get(r.target, False))
        if shape == hf:
            return Layout(False, prefix)
        if shape == hf[::-1]:
            return Layout(True, prefix)
    return Layout(prefix != "model", prefix)


def _expected(r: Route, param: paddle.Tensor, linear: bool, out_in: bool = False) -> list[int]:
    """The checkpoint tensor's full shape in Hugging Face orientation ([out, in] for linear weights).
    out_in: the parameter is stored [out, in] already (`Linear.weight_out_in`)."""
    local = list(param.shape)[1:] if r.expert else list(param.shape)
    if (linear and not out_in) or r.expert:
        local = local[::-1]
    if r.axis is not None:
        local[r.axis] = r.full
    return local


def _read(f, name: str, ax: int | None, start: int, stop: int, file: str) -> paddle.Tensor:
    """Elements [start, stop) along axis `ax` (None: whole) of tensor `name`: only those bytes are read."""
    whole = ax is None or (start == 0 and stop == f.get_slice(name).get_shape()[ax])
    if f.get_slice(name).get_dtype() == "BF16" and not hasattr(paddle.base.core, "frombuffer"):
        return _read_bf16_bits(file, name, None if whole else (ax, start, stop))
    if whole:
        return f.get_tensor(name)
    part = f.get_slice(name)
    index = (slice(start, stop),) if ax == 0 else (slice(None), slice(start, stop))
    # A copy: with safetensors 0.8 and Paddle 3.3.1, two live slices of one tensor abort the process at
    # exit ("The deleter of the pointer is not found", measured); a copy owns its memory.
    return part[index].clone()


def _read_bf16_bits(file: str, name: str, r: tuple[int, int, int] | None) -> paddle.Tensor:
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
        ax, start, stop = r
        bits = bits[start:stop] if ax == 0 else bits[:, start:stop]
    return paddle.to_tensor(np.ascontiguousarray(bits), place=paddle.CPUPlace())


def _deinterleave(t: paddle.Tensor, axis: int, head_dim: int) -> paddle.Tensor:
    """Reorder each head's features (0, 1, 2, 3, ...) -> (0, 2, ..., 1, 3, ...) along `axis`: an interleaved
    rotary pair (2i, 2i + 1) lands on (i, i + d/2), where the halves layout rotates it."""
    n = t.shape[axis]
    idx = np.arange(n).reshape(-1, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)
    return paddle.index_select(t, paddle.to_tensor(idx, dtype="int64", place=paddle.CPUPlace()), axis=axis)


def _reads(ckpt_name: str, shape: list[int], layout: Layout, model, params, linear_params, file):
    """[(Route, checkpoint axis, start, stop)] that tensor `ckpt_name` of `shape` feeds, shape-checked."""
    name = ckpt_name
    if layout.prefix != "model" and name.split(".", 1)[0] == layout.prefix:
        name = "model." + name.split(".", 1)[1]
    parts = [name]
    for fused, split in _PADDLE_FUSED:
        if fused in name:
            parts = [name.replace(fused, part) for part in split]
            break
    out, expected, offset = [], None, 0
    for part in parts:
        if part == "lm_head.weight" and model.lm_head is None:
            return []  # tied: some exporters still write the copy
        r = route(part, model)
        if r.target not in params:
            raise ValueError(f"unexpected tensor {ckpt_name!r} in {os.path.basename(file)}: "
                             f"{model.config.architecture} has no such weight")
        linear = r.target in linear_params
        want = _expected(r, params[r.target], linear, linear_params.get(r.target, False))
        ax = r.axis
        if layout.transposed and len(want) == 2 and (linear or r.expert):
            want, ax = want[::-1], None if ax is None else 1 - ax
        if len(parts) > 1:  # a Paddle fused tensor: the parts side by side along its last (output) axis
            last = len(want) - 1
            if expected is None:
                expected = list(want)
                expected[last] = 0
            expected[last] += want[last]
            start, stop = (r.start, r.stop) if r.axis is not None else (0, want[last])
            out.append((r, last, offset + start, offset + stop))
            offset += want[last]
        else:
            expected = want
            out.append((r, ax, r.start, r.stop))
    if shape != expected:
        raise ValueError(f"tensor {ckpt_name!r} in {os.path.basename(file)} has shape {shape}, expected {expected} "
                         f"from config.json (checkpoint layout: {layout.name})")
    return out


def load_weights(model: DecoderForCausalLM, path: str) -> None:
    """Fill every parameter of `model` from the checkpoint in `path` (either layout, detected; see `Layout`)."""
    params = dict(model.named_parameters())
    # linear weight -> stored [out, in] (the GPU's orientation) rather than [in, out]
    linear_params = {f"{name}.weight": layer.weight_out_in for name, layer in model.named_sublayers()
                     if isinstance(layer, Linear)}
    expert_params = {name for name in params if name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    files = weight_files(path)
    layout = detect_layout(files, model, linear_params)
    # target param -> {piece: checkpoint name (Hugging Face spelling)} still to fill
    pending: dict[str, dict] = {name: {None: name} for name in params}
    for name in params:
        for ckpt, fused, _ in _FUSED:
            if name.endswith(fused + "weight") or name.endswith(fused + "bias"):
                pending[name] = {p: name.replace(f, c) for c, f, p in _FUSED if f == fused}
                break
        for ckpt, model_name in _RENAMED:
            if name.endswith(model_name):
                pending[name] = {None: name[: -len(model_name)] + ckpt}
        if name in expert_params:
            base = name[: -len("experts.gate_up_proj")] if name.endswith("gate_up_proj") else name[: -len("experts.down_proj")]
            kinds = ("gate", "up") if name.endswith("gate_up_proj") else ("down",)
            pending[name] = {(e, i): f"{base}experts.{e}.{k}_proj.weight"
                             for e in range(params[name].shape[0]) for i, k in enumerate(kinds)}
    parts: dict[str, dict] = {name: {} for name in params}

    for file in files:
        # Host tensors (device="cpu"): stacking, casting and transposing run on the CPU whatever the device.
        with safe_open(file, framework="paddle", device="cpu") as f:
            for ckpt_name in f.keys():
                if _ignored(ckpt_name):
                    continue
                shape = list(f.get_slice(ckpt_name).get_shape())
                for r, ax, start, stop in _reads(ckpt_name, shape, layout, model, params, linear_params, file):
                    param = params[r.target]
                    tensor = _read(f, ckpt_name, ax, start, stop, file)
                    if tensor.dtype != param.dtype:
                        tensor = tensor.astype(param.dtype)
                    if r.head_dim:
                        tensor = _deinterleave(tensor, 1 if layout.transposed and tensor.ndim == 2 else 0, r.head_dim)
                    if r.piece is None and r.axis is not None and ax is not None:
                        # the parameter's shape in the checkpoint's orientation
                        flip = r.target in linear_params and linear_params[r.target] == layout.transposed
                        local = list(param.shape)[::-1] if flip else list(param.shape)
                        if tensor.shape[ax] < local[ax]:
                            # The last rank's vocabulary rows: zero padding up to vocab_per_rank.
                            pad = list(tensor.shape)
                            pad[ax] = local[ax] - tensor.shape[ax]
                            tensor = paddle.concat([tensor, paddle.zeros(pad, dtype=tensor.dtype)], axis=ax)
                    parts[r.target][r.piece] = tensor  # checkpoint orientation; transposed once, into the parameter
                    pending[r.target].pop(r.piece, None)

    missing = [ckpt for per_param in pending.values() for ckpt in per_param.values()]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        spelled = "" if not layout.transposed else f" (Hugging Face names; this checkpoint's prefix is {layout.prefix!r})"
        raise ValueError(f"missing tensor {shown}{more}{spelled} in the weights of {path!r}")

    fill = _fill_from_host if platform.is_gpu() else _fill
    with paddle.no_grad():
        for name, param in params.items():
            got = parts.pop(name)
            if name in expert_params:
                value = paddle.stack([_value({p: got[(e, p)] for (e2, p) in got if e2 == e}, True, layout)
                                      for e in range(param.shape[0])])
                fill(param, value)
            else:
                fill(param, _value(got, name in linear_params, layout, linear_params.get(name, False)))


def _value(got: dict, linear: bool, layout: Layout, out_in: bool = False) -> paddle.Tensor:
    """One parameter's value in its own orientation from its checkpoint pieces: pieces stack along the
    output axis (axis 0 of [out, in] and of a bias, axis 1 of [in, out]); a linear weight whose checkpoint
    orientation differs from the parameter's (`out_in`) is returned as a transposed view, copied once into
    the parameter by `_fill`."""
    if None in got:
        value = got[None]
    else:
        axis = 1 if layout.transposed and linear else 0
        value = paddle.concat([got[p] for p in sorted(got)], axis=axis)
    return value.t() if linear and out_in == layout.transposed else value


def _fill(param: paddle.Tensor, value: paddle.Tensor) -> None:
    """Write `value` into the parameter, with one copy per byte where possible: a transposed view is a
    strided copy into the parameter, with no transposed temporary. The parameter was created empty
    (`LazyGuard`), so this is its first and only allocation."""
    paddle.assign(value, output=param)


def _fill_from_host(param: paddle.Tensor, value: paddle.Tensor) -> None:
    """GPU: the value is assembled with Paddle's CPU kernels (the checkpoint tensors are host tensors), then
    one host-to-device copy into the parameter. No GPU kernel of Paddle's runs: on the Hoppers they do nothing."""
    param.set_value(value.contiguous().numpy())  # bfloat16 travels as its uint16 bits, read back as bfloat16
