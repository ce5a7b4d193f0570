"""SwiGLU on a fused gate|up projection: silu(gate) * up."""

import paddle
import paddle.nn.functional as F


def silu_and_mul(gate_up: paddle.Tensor) -> paddle.Tensor:
    gate, up = paddle.chunk(gate_up, 2, axis=-1)
    return F.silu(gate) * up
