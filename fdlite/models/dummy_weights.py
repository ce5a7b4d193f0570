"""`load_format="dummy"` (vLLM's name): every parameter filled with seeded pseudo-random values instead of a checkpoint.

What it is for: running a model of any size from its config.json alone (a 30B MoE without 61 GB of files), to
measure speed and memory. The text is noise; every kernel, shape and byte the real model moves is the same.

The values, per parameter:
- RMSNorm weights 1 and biases 0 (the ERNIE router's score-correction bias included), as a model's init has them;
- everything else (projections, experts, routers, embedding, LM head): normal with standard deviation the config's
  `initializer_range` (transformers' init; 0.02 where the config has none). Not vLLM's uniform in [-1e-3, 1e-3]:
  with std 0.02 a linear layer of width 2,048-4,096 keeps its activations' scale (sqrt(in) * 0.02 is about 1),
  so the router's logits and the LM head's are spread out as a trained model's are; with vLLM's range they
  come out about 0.03 apart, routing and greedy picks are decided by rounding, and bf16 and fp32 or two batch
  compositions part after a few tokens, which makes a dummy model useless for checking that two runs agree.

How, so that a 30B model costs seconds, not minutes of `standard_normal` (about 4 ns a value): one block of
`BLOCK` values is drawn once per engine (from `seed`) and converted once per parameter dtype; each parameter is
that block tiled from its own offset (a hash of the seed, its name and, for the parameters tensor parallelism
splits, the rank), so parameters differ and each element still follows the distribution. The block's length is a
prime, so no row length of a weight divides it and rows of a matrix are not copies of each other.
- GPU: the tiles are host-to-device copies straight out of the block (one `copy_from_host_many` call per
  parameter, the loader's copy): no host array per parameter, no Paddle kernel (on the lent Hoppers Paddle's
  own GPU kernels do nothing); the cost is the copy bandwidth.
- CPU: numpy copies of the block into each parameter's memory (`HostWriter`, as the loader writes).

Tensor parallelism: each rank fills its own shard of the split parameters (a different offset per rank: the
shards are different values), and the same values on every rank for the replicated ones (the MoE router:
ranks must route alike). A tp=N dummy model is therefore not the tp=1 dummy model split, as in vLLM.
"""

from __future__ import annotations

import hashlib

import numpy as np
import paddle

from fdlite.kernels import platform
from fdlite.layers.norm import RMSNorm
from fdlite.layers.rotary import host_bits
from fdlite.models.decoder import DecoderForCausalLM
from fdlite.models.weight_loader import _TAG, DeviceWriter, HostWriter, _dtype_name, checkpoint_pieces, route

BLOCK = 4_194_301  # the largest prime below 2**22: 8 MiB of bfloat16, drawn in about 0.1 s
DEFAULT_STD = 0.02  # transformers' initializer_range default


def dummy_std(raw_config: dict) -> float:
    """The weights' standard deviation: the config's `initializer_range`, else 0.02."""
    value = raw_config.get("initializer_range")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else DEFAULT_STD


class _Blocks:
    """The random block in each dtype, twice over (`ext`): any window of BLOCK values is one contiguous slice."""

    def __init__(self, seed: int, std: float):
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0x64756D6D79]))  # "dummy"
        self.values = rng.standard_normal(BLOCK, dtype=np.float32) * np.float32(std)
        self.ext: dict[str, np.ndarray] = {}

    def get(self, dtype: str) -> np.ndarray:
        if dtype not in self.ext:
            block = host_bits(self.values, dtype)
            self.ext[dtype] = np.concatenate([block, block])
        return self.ext[dtype]


def _offset(seed: int, name: str, rank: int | None) -> int:
    """Where in the block parameter `name` starts (stable across processes: not Python's salted `hash`)."""
    key = f"{seed}/{name}/{'' if rank is None else rank}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % BLOCK


def _tiles(n: int, offset: int) -> list[tuple[int, int, int]]:
    """(first element in the parameter, first in `ext`, count) covering n elements of the block tiled from offset."""
    return [(start, offset, min(BLOCK, n - start)) for start in range(0, n, BLOCK)]


def _split_by_tp(pieces: dict, model: DecoderForCausalLM) -> bool:
    """True when tensor parallelism gives each rank its own part of the parameter (the loader's routes say so)."""
    return any(route(ckpt, model).axis is not None for ckpt in pieces.values())


def fill_dummy_weights(model: DecoderForCausalLM, seed: int) -> None:
    """Fill every parameter of `model` (this rank's shards) as the module docstring says; nothing is read from disk."""
    params = dict(model.named_parameters())
    norms = {f"{name}.weight" for name, layer in model.named_sublayers() if isinstance(layer, RMSNorm)}
    blocks = _Blocks(seed, dummy_std(model.config.raw))
    pieces = checkpoint_pieces(params)
    gpu = platform.is_gpu()
    writer = DeviceWriter(params) if gpu else HostWriter(params)
    try:
        for name, param in params.items():
            dtype = _dtype_name(param)
            if dtype not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"load_format='dummy' cannot fill parameter {name!r} of dtype {dtype} (float32, "
                                 "bfloat16 and float16 only)")
            tag = _TAG[dtype]
            n = int(np.prod(param.shape, dtype=np.int64))
            if name in norms or name.endswith("bias"):
                value = host_bits(np.full(n, 1.0 if name in norms else 0.0, np.float32), dtype)
                if gpu:
                    writer.put_rows(name, 0, value, tag)
                else:
                    writer.put(name, lambda full: full.reshape(-1), value, tag)
            else:
                rank = model.tp.rank if _split_by_tp(pieces[name], model) else None
                ext = blocks.get(dtype)
                if gpu:
                    for first, at, count in _tiles(n, _offset(seed, name, rank)):
                        writer.put_rows(name, first, ext[at:at + count], tag)
                else:
                    flat = writer.view(name).reshape(-1)
                    for first, at, count in _tiles(n, _offset(seed, name, rank)):
                        flat[first:first + count] = ext[at:at + count]
            if gpu:
                writer.flush()  # this parameter's copies, in one call
    finally:
        writer.finish()
    if gpu and paddle.is_compiled_with_cuda():
        paddle.device.cuda.synchronize()  # a failed copy shows here, not in the first step
