"""SwiGLU on a fused gate|up projection: silu(gate) * up (one kernel on GPU)."""

import paddle
import paddle.nn.functional as F

from fdlite.kernels import gpu as gpu_ops
from fdlite.kernels.custom_op import CustomOp


class SiluAndMul(CustomOp):
    def forward_cpu(self, gate_up: paddle.Tensor) -> paddle.Tensor:
        gate, up = paddle.chunk(gate_up, 2, axis=-1)
        return F.silu(gate) * up

    def forward_gpu(self, gate_up: paddle.Tensor) -> paddle.Tensor:
        return gpu_ops.silu_and_mul(gate_up)
