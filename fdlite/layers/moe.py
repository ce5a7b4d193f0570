"""`FusedMoE`: the routed experts of a mixture-of-experts layer, from hidden states to their weighted sum.

One op for what every MoE family does between its router and the residual add: the router's logits,
top-k selection (softmax scores; ERNIE's score-correction bias shifts which experts are chosen but not
their weights; optional renormalisation of the chosen weights), then each chosen expert's SwiGLU MLP
on its tokens, weighted and summed per token. Shared experts and the all-reduce stay in the model
(`models/moe.py`).

CPU (`forward_cpu`): tokens are grouped by expert, not looped over: the k choices of all T tokens are
sorted by expert id (stable), so each expert's rows are one contiguous slice of the gathered inputs,
and each expert with tokens runs two matmuls on its slice. The Python loop is over experts (at most
`num_experts`, and only those that got tokens this step), never over tokens. The results are put back
in token order by the inverse permutation and summed over each token's k choices.

Weights are stacked per expert in the device's orientation of `Linear` (`weight_out_in`), I being this
rank's share of the expert width (tensor parallelism splits every expert's intermediate dimension like a
dense MLP's, so each rank returns a partial sum; expert parallelism, whole experts per rank, can come later):
- CPU: [in, out]: `gate_up_proj` [E, hidden, 2 * I] (gate columns first), `down_proj` [E, I, hidden], what
  Paddle's CPU matmul takes without a transposed copy;
- GPU: [out, in]: `gate_up_proj` [E, 2 * I, hidden] (gate rows first), `down_proj` [E, hidden, I]. The
  grouped GEMMs (`fdlite/kernels/csrc/ops_moe.cu`) read an expert's weights as whole rows of K (16-byte
  copies into shared memory, fed to the tensor cores without a transpose), as the decode GEMV reads the
  dense [out, in] weights; and the loader copies each expert tensor of a Hugging Face checkpoint ([out, in]
  already) straight to its rows of the stacked parameter, with no host assembly.

GPU (`forward_gpu`): fdlite's own kernels only (Paddle's built-in kernels do nothing on the lent Hoppers):
the gate through `Linear`, then `gpu.moe_route` (fp32 softmax, top-k, weights) and `gpu.moe_experts`
(tokens sorted by expert on the device, two grouped GEMMs, the weighted sum per token, plus the model's
`shared` addend when it passes one). No host read: the step is one CUDA graph whatever the routing, and
`last_counts` / `balanced_counts` stay None on the GPU.

`balanced_routing()`: the startup profiling run routes tokens round-robin to every expert (on the GPU too:
the route kernel's `balanced` mode), so the memory peak it measures is that of all experts active (a dummy batch of one token id would otherwise
route every token to the same k experts).
"""

from __future__ import annotations

import contextlib

import numpy as np
import paddle
import paddle.nn.functional as F

from fdlite.kernels import gpu as gpu_ops
from fdlite.kernels import platform
from fdlite.kernels.custom_op import CustomOp
from fdlite.layers.linear import Linear

_BALANCED = {"on": False}


@contextlib.contextmanager
def balanced_routing():
    """Within: every FusedMoE routes token t's j-th choice to expert (t * k + j) % E with equal weights."""
    _BALANCED["on"] = True
    try:
        yield
    finally:
        _BALANCED["on"] = False


class FusedMoE(CustomOp):
    """Router + routed experts. Returns this rank's partial sum (all-reduce it when tensor parallel).

    num_experts, top_k: E and k. hidden_size; intermediate_size: this rank's columns of each expert.
    renormalize: divide the k chosen weights by their sum (floored at `norm_min`). correction_bias:
    hold an [1, E] score-correction bias (ERNIE's `moe_statics.e_score_correction_bias`), added to the
    scores only to choose the experts. gate_dtype: the router's dtype (ERNIE keeps it in float32).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, dtype: str,
                 renormalize: bool, correction_bias: bool = False, norm_min: float = 0.0,
                 gate_dtype: str | None = None):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.norm_min = renormalize, norm_min
        self.gate_dtype = gate_dtype or dtype
        self._cast_for_gate = self.gate_dtype != dtype
        self.gate = Linear(hidden_size, num_experts, False, self.gate_dtype)
        self.weight_out_in = platform.is_gpu()  # the stacked experts' orientation (module docstring)
        up, down = [hidden_size, 2 * intermediate_size], [intermediate_size, hidden_size]
        if self.weight_out_in:
            up, down = up[::-1], down[::-1]
        self.gate_up_proj = self.create_parameter([num_experts, *up], dtype=dtype)
        self.down_proj = self.create_parameter([num_experts, *down], dtype=dtype)
        self.e_score_correction_bias = (self.create_parameter([1, num_experts], dtype="float32", is_bias=True)
                                        if correction_bias else None)
        # Token choices per expert in the last forward, and in the last balanced (profiling) one: for checks.
        self.last_counts: np.ndarray | None = None
        self.balanced_counts: np.ndarray | None = None

    def route(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """(topk_ids [T, k] int64, topk_weights [T, k] float32) for hidden states x [T, hidden]."""
        t = x.shape[0]
        if _BALANCED["on"]:
            ids = (paddle.arange(t * self.top_k, dtype="int64") % self.num_experts).reshape([t, self.top_k])
            return ids, paddle.full([t, self.top_k], 1.0 / self.top_k, dtype="float32")
        h = x.astype(self.gate_dtype) if self._cast_for_gate else x
        scores = F.softmax(self.gate(h).astype("float32"), axis=-1)
        choose = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        chosen, ids = paddle.topk(choose, self.top_k, axis=-1)
        # With a correction bias the chosen values are biased scores; the weights are the plain scores.
        weights = chosen if self.e_score_correction_bias is None else paddle.take_along_axis(scores, ids, axis=-1)
        if self.renormalize:
            total = weights.sum(axis=-1, keepdim=True)
            weights = weights / (paddle.clip(total, min=self.norm_min) if self.norm_min > 0 else total)
        return ids, weights

    def forward_cpu(self, x: paddle.Tensor) -> paddle.Tensor:
        ids, weights = self.route(x)
        t, k = ids.shape
        flat = ids.flatten()
        order = paddle.argsort(flat, stable=True)  # choices grouped by expert, token order within one
        counts = np.bincount(flat.numpy(), minlength=self.num_experts)  # the one host read: slice bounds
        self.last_counts = counts
        if _BALANCED["on"]:
            self.balanced_counts = counts
        rows = paddle.gather(x, order // k)  # [T * k, hidden], expert by expert
        outs, start = [], 0
        for e in np.flatnonzero(counts).tolist():
            n = int(counts[e])
            gate, up = paddle.chunk(paddle.matmul(rows[start:start + n], self.gate_up_proj[e]), 2, axis=-1)
            outs.append(paddle.matmul(F.silu(gate) * up, self.down_proj[e]))
            start += n
        y = paddle.concat(outs) if len(outs) > 1 else outs[0]
        y = y * paddle.gather(weights.flatten(), order).astype(y.dtype).unsqueeze(-1)
        # Back to (token, choice) order, then each token's k contributions summed.
        y = paddle.gather(y, paddle.argsort(order))
        return y.reshape([t, k, -1]).sum(axis=1)

    def forward_gpu(self, x: paddle.Tensor, shared: paddle.Tensor | None = None) -> paddle.Tensor:
        """shared: None, or [T, hidden] added into the per-token sum before its rounding (`MoEBlock`)."""
        h = gpu_ops.cast(x, self.gate_dtype) if self._cast_for_gate else x
        logits = self.gate(h)  # [T, E] in the gate's dtype, widened to fp32 inside the route kernel
        ids, weights = gpu_ops.moe_route(logits, self.top_k, self.renormalize, self.norm_min,
                                         self.e_score_correction_bias, balanced=_BALANCED["on"])
        return gpu_ops.moe_experts(x, ids, weights, self.gate_up_proj, self.down_proj, shared=shared)
