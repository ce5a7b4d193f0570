"""RMSNorm, optionally fused with the residual add before it (vLLM's `fused_add_rms_norm`).

`norm(x)` returns the normalised x; `norm(x, residual)` returns (norm(x + residual), x + residual), the
pattern every decoder layer repeats. CPU: computed in float32 like Hugging Face's `*RMSNorm` (then
cast back, then scaled). GPU: one kernel; the fused form writes both results in place into x and
residual (no allocation, nothing read twice).
"""

import paddle
from paddle import nn

from fdlite.kernels import gpu as gpu_ops
from fdlite.kernels.custom_op import CustomOp


class RMSNorm(CustomOp):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: str = "float32"):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([hidden_size], dtype=dtype, default_initializer=nn.initializer.Constant(1.0))

    def forward_cpu(self, x: paddle.Tensor, residual: paddle.Tensor | None = None):
        if residual is not None:
            residual = x + residual
            x = residual
        h = x.astype("float32")
        # square, not pow(2): Paddle's CPU pow kernel is ~30x slower at decode sizes (150 vs 5 us for [256, 32]).
        h = h * paddle.rsqrt(paddle.square(h).mean(axis=-1, keepdim=True) + self.eps)
        out = self.weight * h.astype(x.dtype)
        return out if residual is None else (out, residual)

    def forward_gpu(self, x: paddle.Tensor, residual: paddle.Tensor | None = None):
        if residual is None:
            return gpu_ops.rms_norm(x, self.weight, self.eps)
        gpu_ops.fused_add_rms_norm_(x, residual, self.weight, self.eps)
        return x, residual
