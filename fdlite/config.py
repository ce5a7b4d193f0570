"""Every engine option, in one place, with FastDeploy's names and defaults.

`EngineConfig` is what `LLM(...)`, a YAML job and the CLI all fill: each field's help string
lives in its `metadata` and is the only copy (the CLI and the README table read it from here).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from dataclasses import dataclass, field
from typing import Any


def _opt(default: Any, help: str, **kw) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def unknown_key_error(kind: str, key: str, known: list[str]) -> ValueError:
    """A ValueError naming the unknown key and the closest known one."""
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ValueError(f"unknown {kind} '{key}'{hint}")


def build_checked(cls, values: dict[str, Any], kind: str):
    """`cls(**values)` for a dataclass, refusing first any key it has no field for (`unknown_key_error`)."""
    known = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in known:
            raise unknown_key_error(kind, key, known)
    return cls(**values)


_DEVICE_RE = re.compile(r"^(cpu|gpu)(:\d+)?$")


def parse_device(device: str | None) -> str | None:
    """A `device` value ("cpu", "gpu", "gpu:N", any case) normalised, or None; anything else is an error."""
    if device is None:
        return None
    if not isinstance(device, str) or not _DEVICE_RE.match(device.strip().lower()):
        raise ValueError(f"device must be 'cpu', 'gpu' or 'gpu:N' (or None for Paddle's current device), got {device!r}")
    return device.strip().lower()


@dataclass
class GraphOptimizationConfig:
    """FastDeploy's `graph_optimization_config`: static graph level and CUDA-graph capture."""

    graph_opt_level: int = _opt(0, "0: dynamic graph; 1: static graph via SOT; 2: static graph + CINN compiler.")
    use_cudagraph: bool | None = _opt(
        None, "Capture CUDA graphs (GPU only): decode steps per padded batch size, steps with prefill tokens per padded "
        "token count. Default: on where graphs can run (FastDeploy's default since 2.3), silently off elsewhere; "
        "true asks for them (a warning where they cannot run), false turns them off.")
    cudagraph_capture_sizes: list[int] | None = _opt(
        None, "Batch sizes to capture; default: FastDeploy's candidate list cut to [1, max_num_seqs]."
    )
    cudagraph_mixed_capture_sizes: list[int] | None = _opt(
        None, "Token counts captured for steps that hold prefill tokens (prefill and decode rows mixed, or prefill "
        "only); such a step runs in the smallest size >= its tokens, above the largest eagerly; [] for none. Default: "
        "16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192 cut to max_num_batched_tokens, "
        "and max_num_batched_tokens itself up to 8192.")
    cudagraph_only_prefill: bool = _opt(
        False, "Capture only token-count graphs (prefill and mixed steps; sizes from cudagraph_capture_sizes and "
        "max_capture_size), no decode graphs.")
    max_capture_size: int | None = _opt(None, "Largest size captured (default: max_num_seqs, or 512 for prefill).")
    verify_cudagraph: bool = _opt(
        True, "At startup, replay each captured graph on fresh inputs and fail if it disagrees with the eager forward."
    )

    def __post_init__(self) -> None:
        if self.graph_opt_level not in (0, 1, 2):
            raise ValueError(f"graph_optimization_config.graph_opt_level must be 0, 1 or 2, got {self.graph_opt_level!r}")
        if self.use_cudagraph is not None and not isinstance(self.use_cudagraph, bool):
            raise ValueError(f"graph_optimization_config.use_cudagraph must be a bool or None, got {self.use_cudagraph!r}")
        for name in ("cudagraph_only_prefill", "verify_cudagraph"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"graph_optimization_config.{name} must be a bool, got {getattr(self, name)!r}")
        for name, empty_ok in (("cudagraph_capture_sizes", False), ("cudagraph_mixed_capture_sizes", True)):
            sizes = getattr(self, name)
            if sizes is not None and (not isinstance(sizes, list) or (not sizes and not empty_ok) or any(
                    not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes)):
                what = "a list" if empty_ok else "a non-empty list"
                raise ValueError(f"graph_optimization_config.{name} must be {what} of positive ints, got {sizes!r}")
        if self.max_capture_size is not None and (
            not isinstance(self.max_capture_size, int) or isinstance(self.max_capture_size, bool) or self.max_capture_size < 1
        ):
            raise ValueError(f"graph_optimization_config.max_capture_size must be a positive int, got {self.max_capture_size!r}")

    @classmethod
    def parse(cls, value: Any) -> GraphOptimizationConfig:
        """Accept the dataclass, a dict, a JSON string or None, like FastDeploy's CLI."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"graph_optimization_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"graph_optimization_config must be a dict or JSON string, got {type(value).__name__}")
        return build_checked(cls, value, "graph_optimization_config key")


@dataclass
class EngineConfig:
    """All options of `LLM`. Names and defaults follow FastDeploy's parameter table."""

    model: str | None = _opt(None, "Model folder (Hugging Face or Paddle checkpoint layout, detected) or a Hugging Face model id such as "
                              "Qwen/Qwen3-0.6B (local cache first, else downloaded); None uses the built-in default model.")
    tokenizer: str | None = _opt(None, "Tokenizer folder or model id; defaults to the model's.")
    skip_tokenizer_init: bool = _opt(False, "Load no tokenizer: prompts must be token ids and outputs have no text.")
    generation_config: str = _opt(
        "auto", "Where requests' sampling defaults come from: auto (the model's generation_config.json sets "
        "temperature, top_p, top_k, min_p and repetition_penalty for requests that leave them unset, as in vLLM), "
        "vllm (fdlite's own defaults), or a folder holding a generation_config.json."
    )
    reasoning_parser: str | None = _opt(
        None, "Split a thinking model's <think>...</think> part of each output into CompletionOutput.reasoning_content "
        "(text keeps the answer): qwen3 or ernie45, as vLLM's parsers of those names; none: text is the whole output.")
    load_format: str = _opt(
        "auto", "How the weights are loaded (vLLM's name): auto (the model folder's safetensors, either checkpoint "
        "layout) or dummy (no weight file is read, config.json is enough: every parameter gets seeded pseudo-random "
        "values, normal with the config's initializer_range (0.02), norms 1, biases 0; for speed and memory "
        "measurements of models whose weights you do not have; the tokenizer is still loaded unless "
        "skip_tokenizer_init)."
    )
    dtype: str = _opt("auto", "Weight/activation dtype: auto (from config.json), float32, bfloat16 or float16.")
    device: str | None = _opt(
        None, "Device to compute on: cpu, gpu or gpu:N (default: Paddle's current device, as paddle.set_device left "
        "it). gpu runs fdlite's own CUDA kernels (built on first use), never Paddle's built-in GPU kernels."
    )
    max_model_len: int | None = _opt(
        None, "Longest sequence (prompt + output) in tokens (default: the model's context length, i.e. its "
        "max_position_embeddings, times a linear/dynamic/YaRN rope-scaling factor as in vLLM, lowered to what the KV "
        "cache holds; a larger explicit value is an error)."
    )
    max_num_seqs: int = _opt(8, "Most sequences decoded at once (the batch size).")
    max_num_batched_tokens: int | None = _opt(
        None, "Token budget of one step, prefill and decode together (default with chunked prefill: 2048 as in "
        "FastDeploy, capped at max_num_seqs * max_model_len and at least max_num_seqs; without: max_model_len)."
    )
    block_size: int = _opt(64, "Tokens per KV-cache block.")
    kv_cache_dtype: str = _opt(
        "auto", "KV-cache element type: auto (the model's dtype) or fp8 (e4m3 with a float32 scale per token and KV "
        "head, taken when the token is written: about 2x the blocks of a bf16 cache). vLLM's name; fp8_e4m3 and "
        "FastDeploy's kv_cache_quant_type value float8_e4m3fn mean fp8. On the GPU: bf16 / fp16 models at head_dim "
        "64 or 128."
    )
    kv_cache_quant_type: str | None = _opt(
        None, "FastDeploy's name for the KV-cache quantization: float8_e4m3fn (or fp8) is kv_cache_dtype=fp8; none "
        "is auto. Set at most one of the two, or both to the same thing.")
    gpu_memory_utilization: float = _opt(0.9, "Share of GPU memory fdlite may use (weights, activations, KV cache, graphs).")
    num_gpu_blocks_override: int | None = _opt(None, "Use exactly this many KV-cache blocks instead of profiling.")
    kv_cache_memory_bytes: int | None = _opt(None, "KV-cache byte budget on CPU (default 1 GiB); on GPU profiling sizes the cache.")
    tensor_parallel_size: int = _opt(1, "Number of GPUs the model is split across (one process each, started by paddle.distributed.launch).")
    data_parallel_size: int = _opt(
        1, "Number of model copies (each of tensor_parallel_size processes) that split a job's requests between "
        "them; launch data_parallel_size * tensor_parallel_size processes with paddle.distributed.launch."
    )
    enable_prefix_caching: bool = _opt(
        True, "Reuse the KV blocks of shared prefixes (hash-chained full blocks, LRU eviction of unused ones). "
        "On by default, as in vLLM and SGLang (FastDeploy: off); outputs are the same either way."
    )
    enable_chunked_prefill: bool = _opt(
        True, "Split a prompt longer than the step's remaining token budget across steps, so decodes keep running. "
        "On by default, as in vLLM (FastDeploy: off); outputs are the same either way."
    )
    async_scheduling: bool | None = _opt(
        None, "Overlap the host work of the next step (scheduling, inputs) with the model's forward of this one "
        "(vLLM's name). Sequences that finish in a step still take part in the next; outputs are the same either way. "
        "None: on for a GPU, where the host work hides behind the device's forward (H100, batch 1: 1.05 vs 1.33 ms "
        "a token), off on CPU, where both share the cores."
    )
    max_num_partial_prefills: int = _opt(
        1, "With chunked prefill: most prompts whose prefill spans steps at once; above 1, each prefill's chunk "
        "is capped at the budget split among them."
    )
    max_long_partial_prefills: int = _opt(
        1, "With chunked prefill: most long prompts (see long_prefill_token_threshold) among those partial "
        "prefills; shorter prompts go past a long one that has to wait. At most max_num_partial_prefills."
    )
    long_prefill_token_threshold: int | None = _opt(
        None, "With chunked prefill: a prompt with more tokens than this left to compute is long (default max_model_len*0.04)."
    )
    graph_optimization_config: GraphOptimizationConfig = _opt(
        None, "Graph optimization: dict or JSON with graph_opt_level, use_cudagraph, cudagraph_capture_sizes."
    )
    use_cudagraph: bool | None = _opt(
        None, "Shorthand for graph_optimization_config's use_cudagraph (FastDeploy's --use-cudagraph); None leaves it.")
    enable_custom_all_reduce: bool | None = _opt(
        None, "Use fdlite's CUDA-graph-safe custom all-reduce (and its all-gather) across GPUs; NCCL, with one log "
        "line, where it cannot run. None: on for GPU ranks of a tensor-parallel group (FastDeploy's default since 2.3), "
        "off on CPU (gloo) and for one process.")
    max_logprobs: int = _opt(
        20, "Most logprobs or prompt_logprobs a request may ask for (vLLM's name and default; at most 20, the GPU "
        "kernel's limit).")
    seed: int = _opt(0, "Seed of the engine's random generator (requests without their own seed draw from it).")

    def __post_init__(self) -> None:
        self.graph_optimization_config = GraphOptimizationConfig.parse(self.graph_optimization_config)
        if self.use_cudagraph is not None and not isinstance(self.use_cudagraph, bool):
            raise ValueError(f"use_cudagraph must be a bool or None, got {self.use_cudagraph!r}")
        if self.use_cudagraph is not None:
            self.graph_optimization_config.use_cudagraph = self.use_cudagraph
        positive = ("max_num_seqs", "block_size", "tensor_parallel_size", "data_parallel_size",
                    "max_num_partial_prefills", "max_long_partial_prefills")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override", "kv_cache_memory_bytes",
                     "long_prefill_token_threshold"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None, got {self.async_scheduling!r}")
        if self.enable_custom_all_reduce is not None and not isinstance(self.enable_custom_all_reduce, bool):
            raise ValueError(f"enable_custom_all_reduce must be a bool or None, got {self.enable_custom_all_reduce!r}")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs must be an int in [0, 20], got {self.max_logprobs!r}")
        if not (0.0 < float(self.gpu_memory_utilization) <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        self.device = parse_device(self.device)
        if self.reasoning_parser is not None and self.reasoning_parser not in ("qwen3", "ernie45"):
            raise ValueError(f"reasoning_parser must be qwen3, ernie45 or None, got {self.reasoning_parser!r}")
        kv = self.kv_cache_dtype.lower() if isinstance(self.kv_cache_dtype, str) else self.kv_cache_dtype
        if self.kv_cache_quant_type is not None:
            qt = str(self.kv_cache_quant_type).lower()
            if qt not in ("none", "fp8", "float8_e4m3fn"):
                raise ValueError("kv_cache_quant_type must be float8_e4m3fn (fp8) or none, got "
                                 f"{self.kv_cache_quant_type!r} (int8 KV caches are not implemented)")
            wanted = "auto" if qt == "none" else "fp8"
            if kv != "auto" and ("auto" if kv == "auto" else "fp8") != wanted:
                raise ValueError(f"kv_cache_quant_type={self.kv_cache_quant_type!r} and kv_cache_dtype="
                                 f"{self.kv_cache_dtype!r} disagree: set one of them")
            kv, self.kv_cache_quant_type = wanted, "none" if wanted == "auto" else "float8_e4m3fn"
        if kv not in ("auto", "fp8", "fp8_e4m3", "float8_e4m3fn"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8 (fp8_e4m3, float8_e4m3fn), got {self.kv_cache_dtype!r}")
        self.kv_cache_dtype = "auto" if kv == "auto" else "fp8"
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto (read the model's safetensors) or dummy (random weights from "
                             f"config.json alone), got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        # Options left unset and filled in here; `resolve_max_model_len` fills them in again.
        self._derived: set[str] = set()
        length = self.max_model_len  # None until the model is known (`resolve_max_model_len`)
        if self.max_num_batched_tokens is None:
            self._derived.add("max_num_batched_tokens")
            # FastDeploy's default: a 2048-token step bounds activation memory and keeps decodes
            # flowing; a step never holds more than max_num_seqs full-length sequences (and the
            # profiling run spreads the budget over max_num_seqs rows of at most max_model_len).
            # Without chunking the longest prompt must fit one step.
            if self.enable_chunked_prefill:
                cap = 2048 if length is None else min(2048, self.max_num_seqs * length)
                self.max_num_batched_tokens = max(cap, self.max_num_seqs)
            else:
                self.max_num_batched_tokens = length
        if (not self.enable_chunked_prefill and length is not None and self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < length):
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({length}): the longest prompt could never be scheduled; raise it or enable_chunked_prefill"
            )
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= max_num_partial_prefills "
                f"({self.max_num_partial_prefills})"
            )
        if self.long_prefill_token_threshold is None:
            self._derived.add("long_prefill_token_threshold")
            if length is not None:
                self.long_prefill_token_threshold = max(1, int(length * 0.04))

    def resolve_max_model_len(self, max_model_len: int) -> None:
        """Set max_model_len (from the model, when the user left it unset) and derive again what follows from it.

        In place, so every holder of this config sees the final values; the options the user left unset
        (`max_num_batched_tokens`, `long_prefill_token_threshold`) get their defaults for the new length.
        """
        for name in self._derived:
            setattr(self, name, None)
        self.max_model_len = max_model_len
        self.__post_init__()

    def resolve_device(self, device: str) -> None:
        """Fill in the options whose default depends on the device the model runs on ("cpu" or "gpu"): an unset
        `async_scheduling` is on for a GPU. In place, once the runner has picked its device. (An unset
        `enable_custom_all_reduce` is resolved by the communicator, which knows the group's size.)"""
        if self.async_scheduling is None:
            self.async_scheduling = device == "gpu"

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword options, naming any unknown one (with a close match)."""
        return build_checked(cls, kwargs, "option")

    @staticmethod
    def help_table() -> list[tuple[str, Any, str]]:
        """(name, default, help) for every option: the CLI and README read this."""
        return [(f.name, f.default, f.metadata["help"]) for f in dataclasses.fields(EngineConfig)]
