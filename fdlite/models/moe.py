"""The MoE layer of a decoder (routed experts plus optional shared experts), and which layers have one.

`MoESpec` reads a family's config keys into one shape: ERNIE 4.5 (`moe_num_experts`, `moe_k`,
`moe_num_shared_experts`, MoE layers from `moe_layer_start_index` to `moe_layer_end_index` every
`moe_layer_interval`, weights always renormalised, the router and its score-correction bias in
float32) and Qwen3-MoE (`num_experts`, `num_experts_per_tok`, `norm_topk_prob`, MoE layers every
`decoder_sparse_step` except `mlp_only_layers`). The other layers keep a dense MLP of
`intermediate_size`.

`MoEBlock` computes the routed experts (`fdlite/layers/moe.py`, one partial sum per rank), all-reduces it, and
adds the shared experts (a dense MLP of `moe_intermediate_size * moe_num_shared_experts`, whose
row-parallel down projection does its own all-reduce): two all-reduces per MoE layer under tensor
parallelism. On the GPU with one rank the shared experts run first and their output goes into the routed
experts' per-token sum (`gpu.moe_experts`' `shared`), which saves an add pass over [T, hidden].
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle
from paddle import nn

from fdlite.distributed.communicator import tensor_parallel_all_reduce
from fdlite.models.decoder import DecoderMLP
from fdlite.models.model_config import ModelConfig
from fdlite.models.tp_partition import TPPartition
from fdlite.kernels import gpu as gpu_ops
from fdlite.kernels import platform
from fdlite.layers.moe import FusedMoE


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    num_shared_experts: int
    renormalize: bool
    correction_bias: bool
    norm_min: float
    gate_dtype: str | None  # None: the model's dtype
    moe_layers: frozenset[int]

    @classmethod
    def ernie(cls, cfg: ModelConfig) -> MoESpec:
        raw, n = cfg.raw, cfg.num_hidden_layers
        experts = raw.get("moe_num_experts", 64)
        if isinstance(experts, list):  # ERNIE-VL's per-modality counts; text experts first
            experts = experts[0]
        end = raw.get("moe_layer_end_index", -1)
        end = n - 1 if end is None or end < 0 else end
        start, interval = raw.get("moe_layer_start_index", 1), raw.get("moe_layer_interval", 1)
        layers = frozenset(i for i in range(n) if (i + 1) % interval == 0 and start <= i <= end)
        # Paddle configs say whether the checkpoint has the correction bias; transformers always has one.
        return cls(experts, raw.get("moe_k", 6), raw.get("moe_num_shared_experts", 0) or 0, True,
                   bool(raw.get("moe_use_aux_free", True)), float(raw.get("moe_norm_min", 1e-12)), "float32",
                   layers)

    @classmethod
    def qwen3(cls, cfg: ModelConfig) -> MoESpec:
        raw, n = cfg.raw, cfg.num_hidden_layers
        experts = raw.get("num_experts", raw.get("num_local_experts", 128))
        step, dense = raw.get("decoder_sparse_step", 1) or 1, set(raw.get("mlp_only_layers") or [])
        layers = frozenset(i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0)
        return cls(experts, raw.get("num_experts_per_tok", 8), 0, bool(raw.get("norm_topk_prob", False)), False,
                   0.0, None, layers)


class MoEBlock(nn.Layer):
    def __init__(self, cfg: ModelConfig, spec: MoESpec, dtype: str, tp: TPPartition):
        super().__init__()
        self.tp_size = tp.size
        inter = cfg.moe_intermediate_size // tp.size
        self.experts = FusedMoE(spec.num_experts, spec.top_k, cfg.hidden_size, inter, dtype, spec.renormalize,
                                spec.correction_bias, spec.norm_min, spec.gate_dtype)
        self.shared_experts = (DecoderMLP(cfg, dtype, tp, inter * spec.num_shared_experts)
                               if spec.num_shared_experts else None)
        self.on_gpu = platform.is_gpu()  # decided once, as CustomOp does

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        # Folded only with one rank: under tensor parallelism the routed partial sums are reduced before the shared
        # output (reduced already) may be added.
        if self.on_gpu and self.tp_size == 1 and self.shared_experts is not None:
            return self.experts(x, shared=self.shared_experts(x))
        y = self.experts(x)
        if self.tp_size > 1:
            y = tensor_parallel_all_reduce(y)
        if self.shared_experts is None:
            return y
        shared = self.shared_experts(x)
        if self.on_gpu:  # Paddle's own add does nothing on sm_90 (fdlite/kernels/gpu.py)
            gpu_ops.add_(y, shared)
            return y
        return y + shared


class MoEDecoderMixin:
    """`make_mlp` for MoE families: an `MoEBlock` on the spec's MoE layers, a dense MLP elsewhere."""

    def moe_spec(self) -> MoESpec:
        raise NotImplementedError

    def make_mlp(self, layer_id: int) -> nn.Layer:
        spec = getattr(self, "_moe_spec", None) or self.moe_spec()
        self._moe_spec = spec
        if layer_id in spec.moe_layers:
            return MoEBlock(self.config, spec, self.dtype, self.tp)
        return DecoderMLP(self.config, self.dtype, self.tp)
