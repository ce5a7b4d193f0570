"""Load Hugging Face `*.safetensors` (single file or sharded with an index) into a decoder model.

Checkpoint names map onto the model's parameters one to one, except that q/k/v and gate/up are
stacked into the fused `qkv_proj` / `gate_up_proj` matrices, and linear weights are transposed
from Hugging Face's [out, in] to Paddle's [in, out]. Shapes in messages are the checkpoint's. Every checkpoint tensor must land
somewhere and every parameter must be filled: a missing, unexpected or wrongly shaped tensor is an
error that names it.
"""

from __future__ import annotations

import glob
import json
import os

import paddle
from safetensors import safe_open

from fdlite.models.decoder import DecoderForCausalLM, Linear

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


def _stacked_targets(model: DecoderForCausalLM) -> list[tuple[str, str, int, int]]:
    """(checkpoint infix, fused infix, row start, row end) for the fused matrices."""
    attn = model.model.layers[0].self_attn
    q, kv = attn.q_size, attn.kv_size
    inter = model.config.intermediate_size
    return [
        ("self_attn.q_proj.", "self_attn.qkv_proj.", 0, q),
        ("self_attn.k_proj.", "self_attn.qkv_proj.", q, q + kv),
        ("self_attn.v_proj.", "self_attn.qkv_proj.", q + kv, q + 2 * kv),
        ("mlp.gate_proj.", "mlp.gate_up_proj.", 0, inter),
        ("mlp.up_proj.", "mlp.gate_up_proj.", inter, 2 * inter),
    ]


def load_weights(model: DecoderForCausalLM, path: str) -> None:
    params = dict(model.named_parameters())
    linear_weights = {f"{name}.weight" for name, layer in model.named_sublayers() if isinstance(layer, Linear)}
    stacked = _stacked_targets(model) if model.model.layers else []
    # target param -> {(row start, row end): checkpoint name} still to fill
    pending: dict[str, dict[tuple[int, int] | None, str]] = {}
    for name in params:
        pending[name] = {None: name}
        for ckpt, fused, start, end in stacked:
            if fused in name:
                pending[name] = {(s, e): name.replace(fused, c) for c, f, s, e in stacked if f == fused}
                break
    parts: dict[str, dict] = {name: {} for name in params}

    for file in weight_files(path):
        with safe_open(file, framework="paddle") as f:
            for ckpt_name in f.keys():
                if ckpt_name.endswith(_IGNORED_SUFFIXES):
                    continue
                if ckpt_name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied: some exporters still write the copy
                target, rows = ckpt_name, None
                for ckpt, fused, start, end in stacked:
                    if ckpt in ckpt_name:
                        target, rows = ckpt_name.replace(ckpt, fused), (start, end)
                        break
                if target not in params:
                    raise ValueError(
                        f"unexpected tensor {ckpt_name!r} in {os.path.basename(file)}: "
                        f"{model.config.architecture} has no such weight"
                    )
                param = params[target]
                transposed = target in linear_weights
                expected = list(param.shape)[::-1] if transposed else list(param.shape)
                if rows is not None:
                    expected[0] = rows[1] - rows[0]
                tensor = f.get_tensor(ckpt_name)
                if list(tensor.shape) != expected:
                    raise ValueError(
                        f"tensor {ckpt_name!r} in {os.path.basename(file)} has shape {list(tensor.shape)}, "
                        f"expected {expected} from config.json"
                    )
                tensor = tensor.astype(param.dtype)
                parts[target][rows] = tensor.t().contiguous() if transposed else tensor
                pending[target].pop(rows, None)

    missing = [ckpt for per_param in pending.values() for ckpt in per_param.values()]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"missing tensor {shown}{more} in the weights of {path!r}")

    with paddle.no_grad():
        for name, param in params.items():
            got = parts[name]
            axis = 1 if name in linear_weights else 0  # fused along the output dimension
            value = got[None] if None in got else paddle.concat([got[r] for r in sorted(got)], axis=axis)
            param.set_value(value)
    model.finalize_weights()
