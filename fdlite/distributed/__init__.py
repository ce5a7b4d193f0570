"""Tensor parallelism across processes started by `paddle.distributed.launch`."""
