"""The model runner: builds the model, owns the KV cache, runs one step and samples.

One code path for CPU and GPU: the device is the `device` option (default: Paddle's current
device), chosen once before the model is built (`fdlite/kernels/platform.py`); every op then picked its
implementation for it, and GPU-only work (CUDA graphs, CUDA memory statistics) is switched by it.

With tensor parallelism one runner runs in each launched process, on its rank's slice of the model
(`TPPartition`) and of the KV heads. Every rank runs every forward (profiling, warm-up, capture,
steps) in the same order, so the collectives inside the layers pair up; rank 0 alone samples
(`distributed/lockstep.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import numpy as np
import paddle

from fdlite.kernels.no_grad import no_grad
from fdlite.config import EngineConfig
from fdlite.distributed.lockstep import share_sampled_tokens
from fdlite.distributed.parallel_state import init_tensor_parallel
from fdlite.kvcache.block_allocator import blocks_for
from fdlite.kvcache.cache_tensors import KVCache, bytes_per_block
from fdlite.models.model_config import ModelConfig
from fdlite.models.registry import model_class
from fdlite.models.tp_partition import TPPartition
from fdlite.models.dummy_weights import fill_dummy_weights
from fdlite.models.weight_loader import load_weights
from fdlite.layers.forward_meta import FlatBatch
from fdlite.layers.moe import balanced_routing
from fdlite.kernels.device_tensors import release_layer_tensors
from fdlite.kernels.platform import select_device
from fdlite.sample.sampler import Sampler, SamplerOutput, resolve
from fdlite.graph.backend import GraphOptBackend
from fdlite.graph.capture_sizes import decode_capture_sizes, mixed_capture_sizes, prefill_capture_sizes
from fdlite.kvcache.device_memory import device_memory, profile_peak, release_cached_memory, reset_peak_memory
from fdlite.graph.cuda import graphs_share_pool
from fdlite.runner.cudagraph_runner import CudaGraphRunner, cudagraph_factory, graph_size
from fdlite.phases import PhaseRecorder
from fdlite.graph.static_graph import translation_count
from fdlite.kvcache.sizing import MemoryProfile, graph_reserve_bytes, kv_cache_bytes, num_blocks_for, sizing_report
from fdlite.kernels.allreduce import capture_custom_allreduce
from fdlite.distributed.communicator import Communicator, get_communicator, set_communicator
from fdlite.runner.dummy_batch import dummy_batch, even_split, small_prefill_lengths
from fdlite.runner.forward_buffers import ForwardBuffers
from fdlite.runner.input_batch import PromptLogprobsInputs, StepInputs
from fdlite.sample.logprobs import concat_logprobs
from fdlite.structured.matcher import BitmaskFiller

logger = logging.getLogger("fdlite")

DEFAULT_CPU_KV_BYTES = 1 << 30


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


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, model_config: ModelConfig):
        self.config = config
        self.model_config = model_config
        self.model_path = model_path
        self.device = select_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config.torch_dtype, self.device)
        tp_size = config.tensor_parallel_size
        TPPartition.of(model_config, 0, tp_size)  # a model that cannot be split fails before any process waits
        # `device="gpu:N"` under a launch pins every rank's GPU itself: ranks may share one (the verification layout).
        pinned = self.device == "gpu" and (config.device or "").startswith("gpu:")
        self.parallel = init_tensor_parallel(tp_size, self.device, config.data_parallel_size, pinned_gpu=pinned)
        self.comm = Communicator(self.parallel, self.device, config.enable_custom_all_reduce)
        set_communicator(self.comm)
        self.tp = TPPartition.of(model_config, self.parallel.rank, tp_size)
        self.model = model_class(model_config.architecture)(model_config, self.dtype, config.max_model_len, self.tp)
        if config.load_format == "dummy":
            fill_dummy_weights(self.model, config.seed)
        else:
            load_weights(self.model, model_path)
        self.model.eval()
        self.sampler = Sampler()
        self.bitmasks = BitmaskFiller(model_config.vocab_size)
        self.eos_token_ids: list[int] = []  # set by the engine: what a grammar row may end with
        g = config.graph_optimization_config
        self.buffers = ForwardBuffers(
            max_tokens=max(config.max_num_batched_tokens, config.max_num_seqs, *(g.cudagraph_capture_sizes or [1])),
            max_rows=config.max_num_seqs, max_blocks=blocks_for(config.max_model_len, config.block_size),
            block_size=config.block_size)
        self.kv_cache: KVCache | None = None
        self.kv_sizing: dict[str, float] | None = None  # the measured sizing's numbers (`_local_num_blocks`)
        self.graph_runner: CudaGraphRunner | None = None  # decode steps, per padded batch size
        self.mixed_graph_runner: CudaGraphRunner | None = None  # steps with prefill tokens, per padded token count
        self.last_sampled: tuple[int | None, object] = (None, None)  # (step id, its sampled ids): `execute`
        self.closed = False

    def close(self) -> None:
        """Release everything this runner holds (docs/design.md, "Closing an engine"); idempotent.

        In this order: the CUDA graphs and their memory pools (they write the KV cache and the buffers, so they
        go first), the graph backend attached to the model (SOT's translated function binds the model: a cycle),
        the sampler's threads and device token tables, the grammar thread, the KV cache, the forward buffers,
        every weight, and this engine's custom all-reduce. Tensors are freed in place (`release_tensor`), so
        a reference left somewhere (a traceback, one layer kept by the caller) keeps an empty object, not the
        memory. The process groups stay (`Communicator.close`). Nothing here is collective."""
        if self.closed:
            return
        self.closed = True
        for runner in self.graph_runners:
            runner.close()
        self.graph_runner = self.mixed_graph_runner = None
        self.last_sampled = (None, None)
        model = self.__dict__.get("model")
        layer = getattr(model, "model", None)
        if layer is not None and layer.__dict__.get("graph_opt_backend") is not None:
            layer.graph_opt_backend = None
        self.sampler.close()
        self.bitmasks.close()
        if self.kv_cache is not None:
            self.kv_cache.release()
        self.kv_cache = None
        self.buffers.release()
        if model is not None:
            release_layer_tensors(model)
        self.model = None
        if get_communicator() is self.comm:
            set_communicator(None)
        self.comm.close()

    @property
    def bytes_per_block(self) -> int:
        c = self.model_config
        return bytes_per_block(c.num_hidden_layers, self.config.block_size, self.tp.num_kv_heads, c.head_dim, self.dtype,
                               self.config.kv_cache_dtype)

    def profile_run(self) -> MemoryProfile | None:
        """docs/design.md, "Startup order" step 2: an eager dummy prefill with a temporary cache.

        On GPU the prefill is the largest step (max_num_batched_tokens tokens over max_num_seqs rows)
        and the measured memory numbers come back. On CPU nothing is measured (the cache size comes from
        `kv_cache_memory_bytes`), so the batch is only what proves a real step runs, a few prompts of
        different lengths (`small_prefill_lengths`): a full 1024-token prefill of Qwen3-0.6B took 44 s
        there. Either way the forward runs before the first request, so a shape problem shows at startup.
        MoE layers route its tokens to every expert (`balanced_routing`; with fewer token choices than
        experts, to as many as there are choices).
        """
        fresh_peak = reset_peak_memory()
        before = device_memory()
        if before is not None and not fresh_peak:
            release_cached_memory()  # the reserve after the forward then bounds its peak (`profile_peak`)
        lengths = self.profile_lengths(measured=before is not None)
        tokens = sum(lengths)
        temp_blocks = sum(blocks_for(n, self.config.block_size) for n in lengths)
        self.kv_cache = KVCache.allocate(temp_blocks, self.config.block_size, self.model_config.num_hidden_layers,
                                         self.tp.num_kv_heads, self.model_config.head_dim, self.dtype,
                                         self.config.kv_cache_dtype)
        temp_bytes = temp_blocks * self.bytes_per_block
        with_cache = device_memory()
        # MoE layers route the dummy tokens round-robin to every expert: the peak is all experts' work.
        with balanced_routing():
            self.forward(dummy_batch(lengths, self.config.block_size, temp_blocks), use_graphs=False)
        during = device_memory()
        self.kv_cache = None
        if before is None:
            return None
        key = (self.model_path, self.dtype, self.parallel.rank, tuple(lengths), temp_blocks)
        peak = profile_peak(during, with_cache.allocated, fresh_peak, key)
        return MemoryProfile(total=before.total, allocated_before=with_cache.allocated, peak_during=peak,
                             used_after=during.allocated, temporary_kv_bytes=temp_bytes,
                             profile_tokens=tokens)

    def profile_lengths(self, measured: bool) -> list[int]:
        """The profiling prefill's sequence lengths (see `profile_run`); `measured`: device memory is measured."""
        c = self.config
        # A step never holds more than max_num_seqs sequences of max_model_len tokens, whatever the budget says.
        tokens = min(c.max_num_batched_tokens, c.max_num_seqs * c.max_model_len)
        if not measured:
            return small_prefill_lengths(c.max_num_seqs, c.max_model_len, c.block_size, tokens)
        return even_split(tokens, c.max_num_seqs)

    def num_blocks_to_allocate(self, profile: MemoryProfile | None) -> int:
        """docs/design.md, "Startup order" step 3, agreed over ranks: every rank schedules the same blocks, so all take the fewest any can hold."""
        local = self._local_num_blocks(profile)
        if self.parallel.world_size == 1:
            return local
        agreed = self.comm.reduce_int(local, "min")
        if agreed != local:
            logger.info("KV cache: this rank could hold %d blocks; using %d, the fewest of %d ranks",
                        local, agreed, self.parallel.world_size)
        return agreed

    def _local_num_blocks(self, profile: MemoryProfile | None) -> int:
        """`num_gpu_blocks_override`, else the profile formula (GPU) or the byte budget (CPU)."""
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        if profile is None:
            return self.num_blocks_from_budget()
        decode, mixed = self.capture_sizes()
        sizes = decode + mixed  # both in tokens
        largest = max(sizes) if sizes else 0
        pooled = None if not sizes or self.device != "gpu" or graphs_share_pool() else sum(sizes)
        reserve = graph_reserve_bytes(profile, largest, len(sizes), pooled)
        if self.comm.ranks_on_device > 1:  # ranks sharing this GPU split its memory
            profile = dataclasses.replace(profile, total=profile.total // self.comm.ranks_on_device)
        available = kv_cache_bytes(profile, self.config.gpu_memory_utilization, reserve)
        self.kv_sizing = sizing_report(profile, self.config.gpu_memory_utilization, reserve, available)
        logger.debug("KV cache sizing: %s", self.kv_sizing)
        return num_blocks_for(available, self.bytes_per_block)

    def num_blocks_from_budget(self) -> int:
        """Blocks that fit the CPU byte budget (`kv_cache_memory_bytes`, default 1 GiB)."""
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
                                         self.tp.num_kv_heads, c.head_dim, self.dtype, self.config.kv_cache_dtype)
        return self.kv_cache

    # ---- graph optimization ------------------------------------------------------------

    def forward_stats(self) -> dict[str, int]:
        """How forwards ran so far: calls into the SOT-translated function, CUDA-graph replays, and the
        replays of a batch padded up to a larger captured size. (With the eager graph stand-in a replay
        calls the layer again, so it counts as a SOT call too; a real CUDA graph does not.)"""
        backend = self.model.model.__dict__.get("graph_opt_backend")
        runners = self.graph_runners
        return {"sot_calls": backend.num_calls if backend is not None else 0,
                "cudagraph_replays": sum(gr.num_replays for gr in runners),
                "cudagraph_padded_replays": sum(gr.num_padded_replays for gr in runners),
                "cudagraph_mixed_replays": self.mixed_graph_runner.num_replays if self.mixed_graph_runner else 0}

    @property
    def graph_runners(self) -> list[CudaGraphRunner]:
        """The captured graphs' runners, in the order a step tries them (decode first)."""
        return [gr for gr in (self.graph_runner, self.mixed_graph_runner) if gr is not None]

    def capture_sizes(self) -> tuple[list[int], list[int]]:
        """`graph_sizes` where graphs are captured; both empty when graphs are off or cannot run here."""
        g = self.config.graph_optimization_config
        if g.use_cudagraph is False or cudagraph_factory(self.device) is None:
            return [], []
        return self.graph_sizes

    @functools.cached_property
    def graph_sizes(self) -> tuple[list[int], list[int]]:
        """(decode batch sizes, token counts of steps with prefill tokens) that get a CUDA graph where graphs run.
        Eager steps plan their attention by them too, graphs on or off (`graph_for`)."""
        c, g = self.config, self.config.graph_optimization_config
        # A row never holds more than max_model_len tokens: a larger token count needs more rows than there are.
        budget = min(c.max_num_batched_tokens, c.max_num_seqs * c.max_model_len)
        if g.cudagraph_only_prefill:
            return [], prefill_capture_sizes(budget, g.cudagraph_capture_sizes, g.max_capture_size)
        return (decode_capture_sizes(c.max_num_seqs, g.cudagraph_capture_sizes, g.max_capture_size),
                mixed_capture_sizes(budget, g.cudagraph_mixed_capture_sizes))

    def graph_for(self, flat: FlatBatch) -> tuple[int, bool] | None:
        """(size, decode) of the CUDA graph `flat` runs in (a decode graph before a mixed one), or would run in with
        graphs on; None: no graph takes it. An eager step plans its attention for that graph (`ForwardBuffers.write`):
        each row's kernel and KV split count, hence its bits, are then the same with graphs on and off."""
        for sizes, mixed in zip(self.graph_sizes, (False, True)):
            size = graph_size(flat, sizes, mixed, self.config.max_num_seqs)
            if size is not None:
                return size, not mixed
        return None

    def setup_graph_optimization(self, recorder: PhaseRecorder) -> None:
        """docs/design.md, "Startup order" step 4: attach the SOT backend, then warm it up or capture CUDA graphs (SOT inside capture)."""
        g = self.config.graph_optimization_config
        layer = self.model.model
        if g.graph_opt_level >= 1:
            layer.graph_opt_backend = GraphOptBackend(layer, g.graph_opt_level)
        decode, mixed = self.capture_sizes()
        if g.use_cudagraph and cudagraph_factory(self.device) is None:  # asked for (the default stays silent)
            logger.warning("use_cudagraph=True is ignored: CUDA graphs need a GPU build of Paddle on a GPU "
                           "(device here: %s); running without graphs", self.device)
        for sizes, is_mixed in ((decode, False), (mixed, True)):
            if sizes:
                runner = CudaGraphRunner(layer, self.kv_cache, self.buffers, sizes, mixed=is_mixed,
                                         max_num_seqs=self.config.max_num_seqs,
                                         graph_factory=cudagraph_factory(self.device))
                setattr(self, "mixed_graph_runner" if is_mixed else "graph_runner", runner)
        if self.graph_runners:
            with capture_custom_allreduce(recorder), recorder.phase("cudagraph_capture"):
                for runner in self.graph_runners:
                    runner.capture_all(recorder, verify=False)
            if g.verify_cudagraph:
                # After the context: the custom all-reduce registers the buffers the graphs captured as it exits, and
                # a graph replayed before that moves no data (its kernels flag the replay instead).
                with recorder.phase("cudagraph_verify"):
                    for runner in self.graph_runners:
                        runner.verify_all()
        if g.graph_opt_level >= 1:
            # Batches that run eagerly (mixed, or above the largest graph) translate here, after capture.
            with recorder.phase("sot_warmup"):
                self.sot_warmup(recorder)

    def sot_warmup(self, recorder: PhaseRecorder) -> None:
        """Translate the static forward before the first request: decode and prefill batches of a few sizes.

        Two sizes of each kind let SOT see the token dimension change and mark it symbolic, so later
        steps with new sizes reuse the translation.
        """
        bs, nb = self.config.block_size, self.kv_cache.num_blocks
        decode_sizes = sorted({1, min(2, self.config.max_num_seqs), self.config.max_num_seqs})
        batches = [dummy_batch([2] * n, bs, nb, decode=True) for n in decode_sizes]
        batches += [dummy_batch([n], bs, nb) for n in sorted({2, min(3, self.config.max_model_len - 1)})]
        before = translation_count()
        for batch in batches:
            self.forward(batch, use_graphs=False)
        recorder.point("sot_translate", count=translation_count() - before)

    @no_grad
    def forward(self, flat: FlatBatch, use_graphs: bool = True) -> paddle.Tensor | None:
        """Logits of the rows that sample (None when none does)."""
        hidden, logits_indices = self.forward_hidden(flat, use_graphs)
        if not len(flat.logits_indices):
            return None
        return self.model.compute_logits(hidden, logits_indices)

    @no_grad
    def forward_hidden(self, flat: FlatBatch, use_graphs: bool = True, patch=None) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Hidden states of the flat batch (graph replay when its padded size was captured) and the device
        indices of its sampling rows. `patch`: (TokenPatch, ids) applied to the input ids once written."""
        graph = self.graph_for(flat)
        if graph is not None and use_graphs:
            size, decode = graph
            runner = self.graph_runner if decode else self.mixed_graph_runner
            if runner is not None and runner.graphs:
                return runner.run(flat, size, patch), self.buffers.logits_index_view(len(flat.logits_indices))
        ids, positions, meta, logits_indices = self.buffers.write(flat, self.kv_cache.caches, patch, graph)
        return self.model(ids, positions, meta), logits_indices

    @no_grad
    def prompt_logprobs(self, hidden: paddle.Tensor, req: PromptLogprobsInputs) -> list | None:
        """Logprobs of the prompt positions `req` names, max_num_seqs rows of logits at a time (the size of a
        decode step's logits, which profiling measured). Every rank computes the logits (the vocabulary gather
        is collective); rank 0 alone the logprobs. Returns [(sequence, its numbers)] on rank 0."""
        rows = self.config.max_num_seqs
        parts = []
        for start in range(0, len(req.targets), rows):
            index = paddle.to_tensor(req.token_indices[start : start + rows])
            logits = self.model.compute_logits(hidden, index)
            if self.parallel.is_driver:
                parts.append(self.sampler.logprobs_of(logits, req.targets[start : start + rows], req.k))
        if not self.parallel.is_driver:
            return None
        whole = concat_logprobs(parts)
        bounds = np.cumsum([0, *req.counts])
        return [(seq, whole.slice(int(a), int(b))) for seq, a, b in zip(req.seqs, bounds[:-1], bounds[1:])]

    @no_grad
    def execute(self, step: StepInputs) -> SamplerOutput | None:
        """Run one step: forward, then (rank 0) sample; every rank gets rank 0's tokens.

        The grammar bitmask of constrained rows (structured outputs) is computed in another thread while
        the forward runs; the sampler waits for it. A step prepared before the previous one's tokens were
        on the host (async scheduling) reads those from the previous step's sampled ids (`step.patch`), which
        the runner keeps (`last_sampled`: that step's id and its ids, on the device on a GPU).
        """
        sampling = step.sampling
        masks = None
        if self.parallel.is_driver and sampling is not None and sampling.grammars:
            masks = self.bitmasks.start(sampling.grammars, self.eos_token_ids)
        patch = None
        if step.patch is not None:
            prev, ids = self.last_sampled
            if prev != step.patch.prev_step:
                raise RuntimeError(f"step {step.step_id} reads the sampled tokens of step {step.patch.prev_step}, "
                                   f"but the last step that sampled here was {prev}")
            patch = (step.patch, ids)
        self.last_sampled = (None, None)
        hidden, logits_indices = self.forward_hidden(step.flat, patch=patch)
        if masks is not None:
            sampling.grammar_bitmask = masks.result()
        sampled = None
        if len(step.flat.logits_indices):
            logits = self.model.compute_logits(hidden, logits_indices)
            sampled = self.sampler(logits, sampling) if self.parallel.is_driver else None
            if self.parallel.world_size > 1:
                sampled = share_sampled_tokens(self.comm, resolve(sampled), len(step.sample_seqs))
            ids = sampled.device_tokens
            self.last_sampled = (step.step_id, ids if ids is not None else np.asarray(sampled.token_ids, np.int64))
        if step.prompt_logprobs is not None:
            prompt = self.prompt_logprobs(hidden, step.prompt_logprobs)
            if prompt is not None:
                sampled = resolve(sampled) if sampled is not None else SamplerOutput([])
                sampled.prompt_logprobs = prompt
        return sampled
