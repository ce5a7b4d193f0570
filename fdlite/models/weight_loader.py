"""Load `*.safetensors` (single file or sharded with an index) into a decoder model, in either layout.

Two layouts, told apart from the files (`detect_layout`), never from a flag: Hugging Face's (`-PT`
repositories; `model.` names, [out, in] linear weights) and Paddle's (`-Paddle` repositories, what
FastDeploy users have on disk: an `ernie.`-style prefix, [in, out] weights, q/k/v and gate/up fused
into `qkv_proj` / `up_gate_proj`). A Paddle name is spelled the Hugging Face way first (prefix,
fused tensors split into their parts), then both follow one route; shapes are checked in the
checkpoint's own orientation and a mismatch names the tensor and the layout.

MoE checkpoints store one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...); each lands in its
slice [e] of the stacked parameters of `fdlite/layers/moe.py` ([experts, in, out] on CPU, [experts, out, in]
on GPU: `FusedMoE.weight_out_in`), each rank reading its columns of every expert. ERNIE's q/k rows are reordered within each head (`_deinterleave`, see
`DecoderSpec.rope_interleaved`).

Checkpoint names map onto the model's parameters one to one, except that q/k/v and gate/up are
stacked into the fused `qkv_proj` / `gate_up_proj` matrices, and linear weights land in the device's
orientation (`Linear.weight_out_in`: [in, out] on CPU, [out, in] on GPU). Every checkpoint tensor must
land somewhere and every parameter must be filled: a missing, unexpected or wrongly shaped tensor is an
error that names it. Shapes in messages are the checkpoint's.

How the bytes move (issue 24: loading runs at the speed of memory, not of Paddle's CPU kernels). Each
file is memory-mapped (`SafetensorsFile`: the header parsed here, every tensor a numpy view of the
mapping, bfloat16 as its uint16 bits, nothing read before it is used), and each tensor, or this rank's
slice of it, is written once into its place in the parameter, which is allocated empty and written
nowhere else:

- GPU: a piece of a parameter stored [out, in] (every GPU `Linear`, the embedding, norms, biases) is a
  run of whole rows, so a plain host-to-device copy at an offset from the mapped file: no host copy, no
  Paddle op (on the Hoppers Paddle's kernels do nothing). Only where the bytes differ from the
  parameter's is a host array made first, with numpy: another dtype (`_convert`), a Paddle-layout
  ([in, out]) weight transposed, ERNIE's q/k rows reordered. The copies of one checkpoint tensor go in
  one `copy_from_host_many` call. The MoE experts ([E, out, in] on the GPU) are whole rows too: each expert's
  gate, up and down rows land at their offset in the stacked parameter. Parameters whose pieces are not whole
  rows are assembled on the host, then copied once.
- CPU: numpy writes each piece straight into the parameter's memory (a DLPack view), converting
  bfloat16 bits to float32 and transposing [out, in] to [in, out] in the same pass (in column blocks,
  cache-friendly), on a few threads (numpy releases the GIL).

With tensor parallelism each rank reads only its own slice of every split tensor (a slice of the mapped
file: only those pages are touched), as `TPPartition` says: rows of q/k/v, gate/up, the embedding and the
LM head; columns of o_proj and down_proj. Norms and the row-parallel biases are read whole. The fused
matrices are assembled from the slices, so rank r's qkv_proj is [q_r | k_r | v_r], the layout its
attention splits; the last rank's vocabulary rows past the vocabulary are zeros.
"""

from __future__ import annotations

import glob
import json
import mmap
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import paddle

from fdlite.kernels import gpu as gpu_ops
from fdlite.kernels import platform
from fdlite.layers.linear import Linear
from fdlite.layers.moe import FusedMoE
from fdlite.layers.rotary import host_bits
from fdlite.models.decoder import DecoderForCausalLM
from fdlite.models.tp_partition import TPPartition

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
        raise FileNotFoundError(f"model folder {path!r} has no *.safetensors weight file (load_format='dummy' runs "
                                "a model from its config.json alone, with random weights)")
    return files


# safetensors dtype -> the numpy dtype of its bytes (bfloat16: its uint16 bits; numpy has no bfloat16).
_NUMPY = {"BF16": "<u2", "F16": "<f2", "F32": "<f4", "F64": "<f8", "I8": "i1", "U8": "u1", "I16": "<i2",
          "I32": "<i4", "I64": "<i8", "BOOL": "?"}
# Paddle dtype name -> safetensors dtype of the same bytes.
_TAG = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int8": "I8", "uint8": "U8",
        "int16": "I16", "int32": "I32", "int64": "I64", "bool": "BOOL"}


class SafetensorsFile:
    """One `*.safetensors` file, memory-mapped: its header (an 8-byte length, then JSON: each tensor's dtype,
    shape and byte range), and each tensor as a read-only numpy view of the mapping (`read`)."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + n else b""
        if isinstance(self._map, mmap.mmap) and hasattr(mmap, "MADV_WILLNEED"):
            self._map.madvise(mmap.MADV_WILLNEED)  # read ahead what is not in the page cache yet
        header.pop("__metadata__", None)
        self.header: dict = header
        self._base = 8 + n

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> list[int]:
        return list(self.header[name]["shape"])

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int = 0) -> np.ndarray:
        """Tensor `name` (elements [start, stop) along `axis`; None: whole) as a view of the mapped file:
        only the pages it covers are ever read."""
        info = self.header[name]
        if info["dtype"] not in _NUMPY:
            raise ValueError(f"tensor {name!r} in {os.path.basename(self.path)} has dtype {info['dtype']}, "
                             f"which fdlite does not load (supported: {', '.join(_NUMPY)})")
        dtype = np.dtype(_NUMPY[info["dtype"]])
        shape = info["shape"]
        begin, end = info["data_offsets"]
        if end == begin:
            a = np.zeros(shape, dtype)
        else:
            a = np.frombuffer(self._map, dtype, (end - begin) // dtype.itemsize, self._base + begin).reshape(shape)
        if axis is None:
            return a
        return a[start:stop] if axis == 0 else a[:, start:stop]


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


def detect_layout(files: list, model: DecoderForCausalLM, linear_params: dict[str, bool]) -> Layout:
    """The checkpoint's layout, from its names and shapes (headers only, no tensor data read).

    Names: anything but `model.` / `lm_head.` as the first component is a Paddle-style prefix. Shapes:
    the first non-square linear weight whose shape is its Hugging Face shape reversed says [in, out]
    (Paddle checkpoints with Hugging Face names exist too); with none, the names decide."""
    prefix = "model"
    shapes = {}
    for file in files:
        f = SafetensorsFile(file) if isinstance(file, str) else file
        for name in f.keys():
            if _ignored(name):
                continue
            head = name.split(".", 1)[0]
            if head not in ("model", "lm_head"):
                prefix = head
            shapes[name] = f.shape(name)
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
    out_in: the parameter is stored [out, in] already (`Linear.weight_out_in`, `FusedMoE.weight_out_in`)."""
    local = list(param.shape)[1:] if r.expert else list(param.shape)
    if (linear or r.expert) and not out_in:
        local = local[::-1]
    if r.axis is not None:
        local[r.axis] = r.full
    return local


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




def _deinterleave(a: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
    """Reorder each head's features (0, 1, 2, 3, ...) -> (0, 2, ..., 1, 3, ...) along `axis`: an interleaved
    rotary pair (2i, 2i + 1) lands on (i, i + d/2), where the halves layout rotates it."""
    n = a.shape[axis]
    idx = np.arange(n).reshape(-1, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)
    return np.take(a, idx, axis=axis)


# ------------------------------------------------------------------ numpy writes with dtype conversion
_BLOCK = 64  # columns per block of a transposing write: a few cache lines of each source row


def _convert(dst: np.ndarray, dst_tag: str, src: np.ndarray, src_tag: str) -> None:
    """dst[...] = src converted from safetensors dtype `src_tag` to `dst_tag` (bfloat16 as uint16 bits both ways:
    widening is a shift, narrowing rounds to nearest even as Paddle's cast does)."""
    if src_tag == dst_tag:
        np.copyto(dst, src)
    elif src_tag == "BF16" and dst_tag == "F32":
        np.left_shift(src, 16, out=dst.view(np.uint32), dtype=np.uint32)
    elif src_tag == "BF16":
        np.copyto(dst, (src.astype(np.uint32) << 16).view(np.float32), casting="unsafe")
    elif dst_tag == "BF16":
        dst[...] = host_bits(src.astype(np.float32), "bfloat16")
    else:
        np.copyto(dst, src, casting="unsafe")


def _write(dst: np.ndarray, dst_tag: str, src: np.ndarray, src_tag: str) -> None:
    """`_convert`, in blocks of columns when `src` is a transposed view (rows of `dst` read a column of the
    checkpoint each: whole-array, that walks the source with a stride of one row per element)."""
    if src.ndim == 2 and not src.flags.c_contiguous and src.shape[1] > _BLOCK and src.strides[0] < src.strides[1]:
        for j in range(0, src.shape[1], _BLOCK):
            _convert(dst[:, j:j + _BLOCK], dst_tag, src[:, j:j + _BLOCK], src_tag)
    else:
        _convert(dst, dst_tag, src, src_tag)


_WORKERS = max(1, min(8, os.cpu_count() or 1))  # threads for numpy writes
_CHUNK_BYTES = 8 << 20  # a thread's share of a large write, at least


def _write_chunks(dst: np.ndarray, dst_tag: str, src: np.ndarray, src_tag: str) -> list[tuple]:
    """`_write`'s arguments for pieces of a large write, split along axis 0 (rows of the destination)."""
    rows = dst.shape[0] if dst.ndim else 1
    n = max(1, min(rows, dst.nbytes // _CHUNK_BYTES, 4 * _WORKERS))
    if n == 1:
        return [(dst, dst_tag, src, src_tag)]
    step = -(-rows // n)
    return [(dst[i:i + step], dst_tag, src[i:i + step], src_tag) for i in range(0, rows, step)]


def _dtype_name(param: paddle.Tensor) -> str:
    return str(param.dtype).replace("paddle.", "")


# ------------------------------------------------------------------ destinations
class _Writer:
    """Writes pieces of parameters (numpy arrays in the parameter's orientation) into their places; every
    parameter is allocated once, empty, by `_allocate`. Large numpy writes run in row chunks on a few threads
    (numpy releases the GIL)."""

    def __init__(self, params: dict):
        self.params = params
        self.staged: dict[str, np.ndarray] = {}  # parameter -> its value assembled on the host
        self.pool = ThreadPoolExecutor(max_workers=_WORKERS) if _WORKERS > 1 else None
        self.jobs: list = []

    def write(self, dst: np.ndarray, dst_tag: str, src: np.ndarray, src_tag: str, wait: bool) -> None:
        """`_write`, on the pool when large; wait: before returning (else by `join`)."""
        if self.pool is None or src.nbytes < (1 << 20):
            _write(dst, dst_tag, src, src_tag)
            return
        jobs = [self.pool.submit(_write, *args) for args in _write_chunks(dst, dst_tag, src, src_tag)]
        if wait:
            for job in jobs:
                job.result()
        else:
            self.jobs.extend(jobs)

    def join(self) -> None:
        try:
            for job in self.jobs:
                job.result()
        finally:
            self.jobs.clear()

    def close(self) -> None:
        try:
            self.join()
        finally:
            if self.pool is not None:
                self.pool.shutdown()

    def _allocate(self, name: str) -> paddle.Tensor:
        param = self.params[name]
        if not param._is_initialized():
            # An allocation, no kernel, handed to the parameter as Paddle's own initializers (2.6 and 3.x) hand
            # theirs over.
            paddle.empty(param.shape, dtype=param.dtype)._share_underline_tensor_to(param)
        return param

    def stage(self, name: str) -> np.ndarray:
        if name not in self.staged:
            param = self.params[name]
            self.staged[name] = np.empty(param.shape, np.dtype(_NUMPY[_TAG[_dtype_name(param)]]))
        return self.staged[name]


class HostWriter(_Writer):
    """CPU: numpy writes straight into each parameter's memory (DLPack view); a dtype without DLPack (bfloat16)
    is assembled on the host and set once."""

    def __init__(self, params: dict):
        super().__init__(params)
        self.views: dict[str, np.ndarray | None] = {}

    def view(self, name: str) -> np.ndarray:
        if name not in self.views:
            param = self._allocate(name)
            try:
                self.views[name] = np.from_dlpack(param.detach())
            except Exception:  # noqa: BLE001 - no DLPack for this dtype (bfloat16) or this Paddle
                self.views[name] = None
        v = self.views[name]
        return v if v is not None else self.stage(name)

    def put(self, name: str, region, value: np.ndarray, tag: str) -> None:
        """region: a function of the parameter's full array -> the piece's place in it."""
        self.write(region(self.view(name)), _TAG[_dtype_name(self.params[name])], value, tag, wait=False)

    def done(self, name: str) -> None:
        pass

    def finish(self) -> None:
        self.close()
        for name, value in self.staged.items():
            self.params[name].set_value(value)


class DeviceWriter(_Writer):
    """GPU: each piece that is whole rows of its parameter is one host-to-device copy at its offset, from the
    mapped file when its bytes are the parameter's already; other parameters are assembled on the host and
    copied once when complete (`done`)."""

    def __init__(self, params: dict):
        super().__init__(params)
        self.copies: list[tuple[int, np.ndarray, int]] = []  # (device address, host bytes, size)

    def put_rows(self, name: str, first_element: int, value: np.ndarray, tag: str) -> None:
        """value: whole rows of the parameter (row-major), starting at flat element `first_element`."""
        param = self._allocate(name)
        dst_tag = _TAG[_dtype_name(param)]
        if dst_tag != tag or not value.flags.c_contiguous:
            host = np.empty(value.shape, np.dtype(_NUMPY[dst_tag]))
            self.write(host, dst_tag, value, tag, wait=True)
            value = host
        if value.nbytes:
            self.copies.append((param.data_ptr() + first_element * value.itemsize, value, value.nbytes))

    def put(self, name: str, region, value: np.ndarray, tag: str) -> None:
        self.write(region(self.stage(name)), _TAG[_dtype_name(self.params[name])], value, tag, wait=True)

    def flush(self) -> None:
        if self.copies:
            gpu_ops.copy_from_host_many([d for d, _, _ in self.copies], [h.ctypes.data for _, h, _ in self.copies],
                                        [n for _, _, n in self.copies])
            self.copies.clear()  # the runtime staged pageable sources before returning: they may go

    def done(self, name: str) -> None:
        """Every piece of `name` has arrived: a parameter assembled on the host goes to the device."""
        value = self.staged.pop(name, None)
        if value is not None:
            self.put_rows(name, 0, value, _TAG[_dtype_name(self.params[name])])
            self.flush()

    def finish(self) -> None:
        try:
            self.flush()
        finally:
            self.close()


# ------------------------------------------------------------------ the loader
def load_weights(model: DecoderForCausalLM, path: str) -> None:
    """Fill every parameter of `model` from the checkpoint in `path` (either layout, detected; see `Layout`)."""
    params = dict(model.named_parameters())
    # linear weight, or stacked expert weight -> stored [out, in] (the GPU's orientation) rather than [in, out]
    linear_params = {f"{name}.weight": layer.weight_out_in for name, layer in model.named_sublayers()
                     if isinstance(layer, Linear)}
    linear_params.update({f"{name}.{w}": layer.weight_out_in for name, layer in model.named_sublayers()
                          if isinstance(layer, FusedMoE) for w in ("gate_up_proj", "down_proj")})
    files = [SafetensorsFile(f) for f in weight_files(path)]
    layout = detect_layout(files, model, linear_params)
    # target param -> {piece: checkpoint name (Hugging Face spelling)} still to fill
    pending = checkpoint_pieces(params)
    offsets = _piece_offsets(pending, model)
    # stored [in, out]: CPU linear weights and experts; the output axis is then the last
    in_out = {name: name in linear_params and not linear_params[name] for name in params}
    gpu = platform.is_gpu()
    writer = DeviceWriter(params) if gpu else HostWriter(params)

    try:
        for f in files:
            for ckpt_name in f.keys():
                if _ignored(ckpt_name):
                    continue
                shape = f.shape(ckpt_name)
                tag = f.dtype(ckpt_name)
                for r, ax, start, stop in _reads(ckpt_name, shape, layout, model, params, linear_params, f.path):
                    src = f.read(ckpt_name, ax, start, stop)  # checkpoint orientation, a view of the file
                    ckpt_in_out = layout.transposed and src.ndim == 2 and (r.target in linear_params or r.expert)
                    if r.head_dim:
                        src = _deinterleave(src, 1 if ckpt_in_out else 0, r.head_dim)
                    _place(writer, gpu, r, src, tag, ckpt_in_out, in_out[r.target], offsets, params[r.target])
                    pending[r.target].pop(r.piece, None)
                    if not pending[r.target]:
                        writer.done(r.target)
                if gpu:
                    writer.flush()  # this tensor's copies, in one call
    finally:
        writer.finish()

    missing = [ckpt for per_param in pending.values() for ckpt in per_param.values()]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        spelled = "" if not layout.transposed else f" (Hugging Face names; this checkpoint's prefix is {layout.prefix!r})"
        raise ValueError(f"missing tensor {shown}{more}{spelled} in the weights of {path!r}")
    if gpu and paddle.is_compiled_with_cuda():
        paddle.device.cuda.synchronize()  # a failed copy shows here, not in the first step


def checkpoint_pieces(params: dict) -> dict[str, dict]:
    """param name -> {piece: the checkpoint tensor (Hugging Face spelling) that fills it}: one piece (None) for
    most, q/k/v and gate/up for the fused matrices, (expert, part) for the stacked experts."""
    pieces: dict[str, dict] = {name: {None: name} for name in params}
    for name in params:
        for ckpt, fused, _ in _FUSED:
            if name.endswith(fused + "weight") or name.endswith(fused + "bias"):
                pieces[name] = {p: name.replace(f, c) for c, f, p in _FUSED if f == fused}
                break
        for ckpt, model_name in _RENAMED:
            if name.endswith(model_name):
                pieces[name] = {None: name[: -len(model_name)] + ckpt}
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            base = name[: -len("experts.gate_up_proj")] if name.endswith("gate_up_proj") else name[: -len("experts.down_proj")]
            kinds = ("gate", "up") if name.endswith("gate_up_proj") else ("down",)
            pieces[name] = {(e, i): f"{base}experts.{e}.{k}_proj.weight"
                            for e in range(params[name].shape[0]) for i, k in enumerate(kinds)}
    return pieces


def _piece_offsets(pending: dict, model) -> dict:
    """param -> {piece: offset along the parameter's output axis} for the fused (stacked) parameters: pieces
    sit side by side in piece order ([q | k | v], [gate | up]; per expert for the experts' pieces (e, i))."""
    out = {}
    for name, per in pending.items():
        if len(per) < 2:
            continue
        offs, at = {}, {}
        for piece in sorted(per, key=lambda p: (p[0], p[1]) if isinstance(p, tuple) else (0, p)):
            group = piece[0] if isinstance(piece, tuple) else None
            offs[piece] = at.get(group, 0)
            r = route(per[piece], model)
            at[group] = offs[piece] + (r.stop - r.start)
        out[name] = offs
    return out


def _place(writer, gpu: bool, r: Route, src: np.ndarray, tag: str, ckpt_in_out: bool, in_out: bool, offsets: dict,
           param: paddle.Tensor) -> None:
    """Write piece `src` (checkpoint orientation) of parameter `r.target` into its place."""
    value = src.T if src.ndim == 2 and ckpt_in_out != in_out else src  # the parameter's orientation
    e = r.piece[0] if r.expert else None
    group = list(param.shape)[1:] if r.expert else list(param.shape)  # param[e] for an expert's piece
    out_axis = 1 if len(group) == 2 and in_out else 0
    off = offsets.get(r.target, {}).get(r.piece, 0)
    n = value.shape[out_axis]
    tail = group[out_axis] - off - n if r.piece is None else 0  # the last rank's rows past the vocabulary

    def region(full: np.ndarray, lo: int = off, hi: int = off + n):
        g = full[e] if e is not None else full
        return g[lo:hi] if out_axis == 0 else g[:, lo:hi]

    if gpu and out_axis == 0 and r.target not in writer.staged:
        # whole rows: one copy at the rows' offset (the element offset of row `off` of param[e])
        row = int(np.prod(group[1:], dtype=np.int64)) if len(group) > 1 else 1
        base = (e or 0) * int(np.prod(group, dtype=np.int64))
        writer.put_rows(r.target, base + off * row, value, tag)
        if tail > 0:
            writer.put_rows(r.target, base + (off + n) * row, np.zeros([tail, *value.shape[1:]], value.dtype), tag)
        return
    writer.put(r.target, region, value, tag)
    if tail > 0:
        shape = list(value.shape)
        shape[out_axis] = tail
        writer.put(r.target, lambda full: region(full, off + n, off + n + tail), np.zeros(shape, value.dtype), tag)
