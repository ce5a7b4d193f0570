"""All-reduce across tensor-parallel ranks: NCCL through `paddle.distributed`, or fdlite's custom one."""

from fdlite.kernels.allreduce.capture import capture_custom_allreduce, is_capturing_custom_allreduce

__all__ = ["capture_custom_allreduce", "is_capturing_custom_allreduce"]
