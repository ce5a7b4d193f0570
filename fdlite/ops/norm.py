"""RMSNorm, computed in float32 like Hugging Face's `*RMSNorm` (then cast back, then scaled)."""

import paddle
from paddle import nn


class RMSNorm(nn.Layer):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: str = "float32"):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([hidden_size], dtype=dtype, default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        h = x.astype("float32")
        # square, not pow(2): Paddle's CPU pow kernel is ~30x slower at decode sizes (150 vs 5 us for [256, 32]).
        h = h * paddle.rsqrt(paddle.square(h).mean(axis=-1, keepdim=True) + self.eps)
        return self.weight * h.astype(x.dtype)
