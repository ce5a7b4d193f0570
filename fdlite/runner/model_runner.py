"""The model runner: builds the model, owns the KV cache, runs one step and samples.

One code path for CPU and GPU: the device is picked once from what Paddle was built with, and
GPU-only work (CUDA graphs, CUDA memory statistics) is switched by that capability.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import paddle

from fdlite.config import EngineConfig
from fdlite.kvcache.block_allocator import blocks_for
from fdlite.kvcache.cache_tensors import KVCache, bytes_per_block
from fdlite.models.model_config import ModelConfig
from fdlite.models.registry import model_class
from fdlite.models.weight_loader import load_weights
from fdlite.ops.sampler import Sampler, SamplerOutput, SamplingRow
from fdlite.runner.input_batch import ModelInputs, build_inputs
from fdlite.runner.sequence import Sequence

logger = logging.getLogger("fdlite")

DEFAULT_CPU_KV_BYTES = 1 << 30


def select_device() -> str:
    device = "gpu" if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0 else "cpu"
    paddle.set_device(device)
    return device


def resolve_dtype(requested: str, checkpoint_dtype: str, device: str) -> str:
    """`auto` follows config.json; Paddle's CPU kernels have no half-precision matmul, so CPU computes in float32."""
    dtype = checkpoint_dtype if requested == "auto" else requested
    if dtype not in ("float32", "bfloat16", "float16"):
        dtype = "float32"
    if device == "cpu" and dtype != "float32":
        if requested != "auto":
            raise ValueError(
                f"dtype={requested!r} cannot run on CPU: Paddle's CPU build has no {requested} matmul kernel; "
                "use dtype='float32' or 'auto'"
            )
        logger.info("checkpoint dtype is %s; computing in float32 on CPU (no half-precision CPU matmul in Paddle)", dtype)
        dtype = "float32"
    return dtype


@dataclass
class StepResult:
    inputs: ModelInputs
    sampled: SamplerOutput | None


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, model_config: ModelConfig):
        self.config = config
        self.model_config = model_config
        self.device = select_device()
        self.dtype = resolve_dtype(config.dtype, model_config.torch_dtype, self.device)
        if config.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) exceeds the model's max_position_embeddings "
                f"({model_config.max_position_embeddings})"
            )
        self.model = model_class(model_config.architecture)(model_config, self.dtype, config.max_model_len)
        load_weights(self.model, model_path)
        self.model.eval()
        self.sampler = Sampler()
        self.kv_cache: KVCache | None = None

    @property
    def bytes_per_block(self) -> int:
        c = self.model_config
        return bytes_per_block(c.num_hidden_layers, self.config.block_size, c.num_key_value_heads, c.head_dim, self.dtype)

    def num_blocks_from_budget(self) -> int:
        """Blocks that fit the configured budget (CPU; GPU sizing from profiling comes with the graph pipeline)."""
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        budget = self.config.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
        num_blocks = budget // self.bytes_per_block
        if self.config.kv_cache_memory_bytes is None:
            # More than max_num_seqs full-length sequences can never be resident at once.
            num_blocks = min(num_blocks, self.config.max_num_seqs * blocks_for(self.config.max_model_len, self.config.block_size))
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> KVCache:
        need = blocks_for(self.config.max_model_len, self.config.block_size)
        if num_blocks < need:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {self.config.block_size} tokens, fewer than the "
                f"{need} one max_model_len={self.config.max_model_len} sequence needs; raise the cache budget "
                "or lower max_model_len"
            )
        c = self.model_config
        self.kv_cache = KVCache.allocate(num_blocks, self.config.block_size, c.num_hidden_layers,
                                         c.num_key_value_heads, c.head_dim, self.dtype)
        return self.kv_cache

    @paddle.no_grad()
    def forward(self, inputs: ModelInputs) -> paddle.Tensor:
        """Hidden states of the flat batch -> logits of the rows that sample."""
        inputs.meta.caches = self.kv_cache.caches
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if not inputs.sample_seqs:
            return None
        return self.model.compute_logits(paddle.gather(hidden, inputs.logits_indices))

    def execute(self, rows: list[tuple[Sequence, int]], eos_token_ids: set[int]) -> StepResult:
        inputs = build_inputs(rows, self.config.block_size)
        logits = self.forward(inputs)
        if logits is None:
            return StepResult(inputs, None)
        sample_rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator) for s in inputs.sample_seqs]
        return StepResult(inputs, self.sampler(logits, sample_rows, eos_token_ids))
