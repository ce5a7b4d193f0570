"""`LLM`: the public object. Startup pipeline, then `generate` and `chat` with continuous batching."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from typing import Any

import numpy as np

from fdlite.config import EngineConfig, parse_device
from fdlite.default_model import RANDOM_WEIGHTS_NOTE, default_model_path
from fdlite.distributed.lockstep import check_same_requests, requests_digest
from fdlite.distributed.parallel_state import launched_world_size
from fdlite.phases import PhaseRecorder
from fdlite.graph.static_graph import check_graph_opt_level, translation_count
from fdlite.kernels import cpu_attention
from fdlite.kernels.allreduce import is_capturing_custom_allreduce
from fdlite.kvcache.device_memory import release_cached_memory
from fdlite.model_source import resolve_model
from fdlite.models.context_length import choose_max_model_len, fit_to_cache
from fdlite.models.generation_config import sampling_defaults
from fdlite.models.model_config import ModelConfig
from fdlite.sample.random import sequence_seed
from fdlite.outputs import CompletionOutput, RequestOutput
from fdlite.progress import Progress
from fdlite.reasoning import make_reasoning_parser
from fdlite.runner.engine import Engine
from fdlite.runner.model_runner import ModelRunner
from fdlite.runner.sequence import Sequence
from fdlite.sampling_params import SamplingParams
from fdlite.tokenizer import Tokenizer

logger = logging.getLogger("fdlite")

PromptType = str | dict | list[int]


class LLM:
    """An offline LLM engine: one object owns the model, the KV cache and the batch loop.

    `LLM(model, **options)` takes every option of `EngineConfig` by name (FastDeploy's names).
    `model` is a model folder or a Hugging Face model id (from the local cache, else downloaded;
    `fdlite/model_source.py`); `model=None` uses the built-in default model (random weights, real
    Qwen3 tokenizer).

    With `tensor_parallel_size=N` the script runs under `paddle.distributed.launch` in N processes,
    each building its own `LLM` with the same arguments; every rank must call `generate` with the
    same requests. Rank 0 (`is_driver`) returns the outputs; the other ranks do the same work and get
    an empty list. With `data_parallel_size=D` as well, D * N processes form D independent groups of N
    (consecutive ranks); each group is one engine over the requests its own ranks pass to `generate`
    (`fdlite run` splits a job's requests between the groups), and each group's first rank returns outputs.

    An `LLM` releases what it holds (KV cache, CUDA graphs and their memory pools, weights, buffers, the
    sampler's device tables, its threads; then the allocator's cache goes back to the device) on `close()`, at
    the end of a `with LLM(...) as llm:` block, or when it is deleted, so a second `LLM` in the same process
    gets the same KV cache as the first. A closed `LLM` refuses to generate. Process groups are kept.
    """

    # What the last `generate` / `generate_stream` computed: steps, prefill/decode tokens, prefix-cache
    # queried/hit tokens and hit rate, preemptions, time (see `_generate_stats`). Set when the stream
    # ends; replaced, never mutated.
    last_generate_stats: dict[str, Any] = {}

    def __init__(self, model: str | None = None, **kwargs: Any):
        self._closed = False
        t_start = time.perf_counter()
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        check_graph_opt_level(self.config.graph_optimization_config.graph_opt_level)
        # A model id ("Qwen/Qwen3-0.6B") becomes its Hugging Face cache folder (model_source.py).
        self.model_path = (resolve_model(model, weights=self.config.load_format != "dummy") if model
                           else default_model_path())
        if model:
            logger.info("model: %s", model if model == self.model_path else f"{model} ({self.model_path})")
        else:
            logger.info(RANDOM_WEIGHTS_NOTE)
        self.phases = PhaseRecorder(probes={"sot_translations": translation_count})
        self.sampling_defaults = sampling_defaults(self.config.generation_config, self.model_path)
        if self.sampling_defaults:
            logger.info("sampling defaults from generation_config.json: %s (a request's own values win; "
                        "generation_config='vllm' ignores the file)",
                        ", ".join(f"{k}={v}" for k, v in self.sampling_defaults.items()))

        with self.phases.phase("compile_ops"):
            self._compile_ops()

        with self.phases.phase("load_weights"):
            self.model_config = ModelConfig.from_dir(self.model_path)
            length = choose_max_model_len(self.config.max_model_len, self.model_config)
            self.config.resolve_max_model_len(length.tokens)
            self.tokenizer = None
            if not self.config.skip_tokenizer_init:
                self.tokenizer = Tokenizer.from_pretrained(
                    resolve_model(self.config.tokenizer) if self.config.tokenizer else self.model_path)
            self.reasoning_parser = make_reasoning_parser(self.config.reasoning_parser, self.tokenizer)
            self.runner = ModelRunner(self.config, self.model_path, self.model_config)
        logger.info("device: %s (%s)", self.runner.device, self.runner.dtype)
        self.config.resolve_device(self.runner.device)
        try:
            self._start(length)
        except BaseException:
            # A failed start (a cache of 0 blocks, a failed graph check) gives its memory back now: the
            # traceback, which a notebook keeps, would otherwise keep the weights alive.
            self.close()
            raise
        _close_deferred()
        self.startup_report["total_s"] = time.perf_counter() - t_start
        logger.info("ready in %.2f s", self.startup_report["total_s"])

    def _start(self, length) -> None:
        """Startup after the weights: profile, size and allocate the KV cache, graphs, the engine."""
        with self.phases.phase("profile_run"):
            profile = self.runner.profile_run()

        with self.phases.phase("kv_cache"):
            num_blocks = self.runner.num_blocks_to_allocate(profile)
            self.config.resolve_max_model_len(fit_to_cache(length, num_blocks, self.config.block_size))
            self.runner.allocate_kv_cache(num_blocks)
            self.num_blocks = num_blocks
            logger.info("KV cache: %d blocks of %d tokens (%d tokens)", num_blocks, self.config.block_size,
                        num_blocks * self.config.block_size)

        with self.phases.phase("graph_optimization"):
            self.runner.setup_graph_optimization(self.phases)

        eos = set(self.model_config.eos_token_id)
        if self.tokenizer is not None:
            eos |= self.tokenizer.eos_token_ids
        self.parallel = self.runner.parallel
        self.engine = Engine(self.config, self.runner, num_blocks, eos, self.tokenizer)
        self._rng = np.random.default_rng(self.config.seed)
        self._bad_words_cache: dict[tuple[str, ...], list[list[int]]] = {}
        self.startup_report: dict[str, Any] = {f"{k}_s": v for k, v in self.phases.durations.items()}
        self.startup_report.update(
            total_block_num=num_blocks, kv_token_capacity=num_blocks * self.config.block_size,
            bytes_per_block=self.runner.bytes_per_block, kv_sizing=self.runner.kv_sizing,
            cudagraph_sizes=sorted(self.runner.graph_runner.graphs) if self.runner.graph_runner else [],
            cudagraph_mixed_sizes=(sorted(self.runner.mixed_graph_runner.graphs) if self.runner.mixed_graph_runner
                                   else []),
            sot_translations=(self.phases.probe_at("end", "graph_optimization", "sot_translations")
                              - self.phases.probe_at("begin", "load_weights", "sot_translations")),
        )

    # ---- releasing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Release everything this engine holds; idempotent. Afterwards `generate` and `chat` raise.

        The step thread stops after the step in flight, then the model runner frees the CUDA graphs and their
        pools, the KV cache, the forward buffers, the weights, the sampler's device tables and threads and the
        custom all-reduce (`ModelRunner.close`), and the allocator's cached blocks go back to the device
        (`empty_cache`). Process groups are not torn down (another `LLM` in this process may use them; Paddle
        cannot rebuild them), and neither are the process-wide cuBLAS workspace and attention counters of
        fdlite's GPU ops library, which the next `LLM` reuses. Local: ranks need not close together."""
        if self.__dict__.get("_closed", True):
            return
        self._closed = True
        engine, runner = self.__dict__.get("engine"), self.__dict__.get("runner")
        self.engine = self.runner = None
        try:
            if engine is not None:
                engine.close()
        finally:
            if runner is not None:
                runner.close()
                release_cached_memory()

    @property
    def closed(self) -> bool:
        return self.__dict__.get("_closed", True)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            # At interpreter exit Paddle and CUDA may be half torn down; the process frees everything anyway.
            if sys.is_finalizing() or self.closed:
                return
            if is_capturing_custom_allreduce():
                # The garbage collector ran this inside another engine's CUDA-graph capture, where freeing
                # device memory would break that capture: that engine closes this one once its capture is over.
                _DEFERRED_CLOSE.append(self)
                return
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer must not raise
            pass

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this LLM was closed (close(), or the end of its `with` block) and has released its "
                               "model and KV cache; create a new LLM to generate again")

    def _compile_ops(self) -> None:
        """Build the native ops the model will call before the weights load, so that their one-time compile
        is timed (and logged) as its own phase rather than inside `load_weights`. On CPU that is the C++
        paged attention (compiled once per machine, then loaded from its cache in milliseconds).

        Not under a multi-process launch: there the ranks create their process groups next, and one rank
        compiling while the others wait in gloo's connection set-up timed out on a loaded 2-core machine; the
        op then builds at its first use, after the groups exist (where the others wait in a collective)."""
        import paddle  # noqa: PLC0415

        device = parse_device(self.config.device) or paddle.get_device()
        if not device.startswith("cpu") or launched_world_size() > 1:
            return
        cpu_attention.load()  # logs "compiling ... (once; cached under ...)" when it is not cached yet

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without its own `SamplingParams` gets: fdlite's defaults with the model's
        generation_config.json sampling fields over them (`generation_config` option; vLLM's name)."""
        return SamplingParams(**self.sampling_defaults)

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    @property
    def is_driver(self) -> bool:
        """True on the process that returns outputs: rank 0, or the only process."""
        return self.parallel.is_driver

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's name). False, with nothing dropped, while a
        request holds blocks; between `generate` calls none does."""
        self._check_open()
        return self.engine.allocator.reset_prefix_cache()

    # ---- requests -------------------------------------------------------------------------

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this LLM was built with skip_tokenizer_init=True")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, SequenceABC) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def _request_problem(self, ids: list[int], params: SamplingParams) -> str | None:
        if not ids:
            return "prompt is empty"
        if len(ids) >= self.config.max_model_len:
            return (f"prompt has {len(ids)} tokens; max_model_len={self.config.max_model_len} leaves no room "
                    "for output")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if t < 0 or t >= vocab), None)
        if bad is not None:
            return f"prompt token id {bad} is outside the vocabulary [0, {vocab})"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.config.max_logprobs:
                return f"{name}={k} is more than max_logprobs={self.config.max_logprobs}"
        if params.bad_words and self.tokenizer is None:
            return "bad_words need a tokenizer; this LLM was built with skip_tokenizer_init=True"
        for name, tokens in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = next((t for t in tokens if t >= vocab), None)
            if bad is not None:
                return f"{name}: token id {bad} is outside the vocabulary [0, {vocab})"
        return self.engine.structured.problem(params)

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in input order.

        A prompt is a string, a list of token ids, or a dict with `prompt` or `prompt_token_ids`.
        A request that cannot run (empty, too long, bad token ids) comes back with `error` set and
        finish_reason "error"; the other requests of the batch complete normally. Under tensor
        parallelism ranks other than 0 get [] (see the class docstring).
        """
        done = dict(self.generate_stream(prompts, sampling_params, use_tqdm=use_tqdm))
        return [done[i] for i in range(len(done))]

    def generate_stream(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Like `generate`, but yield `(index, RequestOutput)` as each request finishes.

        `index` is the prompt's position in `prompts`; requests come in finish order, those that
        cannot run first. Arguments are checked and prompts tokenized before this returns, so bad
        arguments raise here rather than mid-iteration. Closing the iterator early drops the
        requests still in flight, so the engine is left empty for the next call. Under tensor
        parallelism only rank 0 yields; every rank must iterate to the end (a rank that stops early
        leaves the others waiting in a collective).
        """
        self._check_open()
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, (int, np.integer)) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params.with_defaults(self.sampling_defaults)] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts; pass one, or one per prompt"
                )
            if self.sampling_defaults:  # once per distinct object: a job's lines often share one
                merged: dict[int, SamplingParams] = {}
                for p in params_list:
                    if id(p) not in merged:
                        merged[id(p)] = p.with_defaults(self.sampling_defaults)
                params_list = [merged[id(p)] for p in params_list]
        failed: list[tuple[int, RequestOutput]] = []
        live: list[tuple[RequestOutput, list[Sequence]]] = []
        tokenized = [self._prompt_ids(prompt) for prompt in prompts]
        if self.parallel.world_size > 1:
            digest = requests_digest([(ids, p) for (_, ids), p in zip(tokenized, params_list)])
            check_same_requests(self.runner.comm, digest, len(prompts))
        for i, ((text, ids), params) in enumerate(zip(tokenized, params_list)):
            out = RequestOutput(request_id=str(i), prompt=text, prompt_token_ids=ids)
            problem = self._request_problem(ids, params)
            if problem is not None:
                self._fail(out, problem)
                failed.append((i, out))
                continue
            seqs = [self._new_sequence(i, k, ids, params) for k in range(params.n)]
            live.append((out, seqs))
        return self._stream(failed, live, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        `chat_template_kwargs` reach the template (e.g. `{"enable_thinking": False}` for Qwen3; with a
        `reasoning_parser` the output is then all answer, see `fdlite/reasoning.py`)."""
        self._check_open()
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this LLM was built with skip_tokenizer_init=True")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                               chat_template=chat_template, **(chat_template_kwargs or {}))
            for conv in conversations
        ]
        # The template already placed the special tokens.
        prompts = [{"prompt": p, "prompt_token_ids": self.tokenizer.encode(p, add_special_tokens=False)} for p in prompts]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ---- internals ------------------------------------------------------------------------

    def _new_sequence(self, index: int, child: int, ids: list[int], params: SamplingParams) -> Sequence:
        return Sequence(request_index=index, child_index=child, prompt_token_ids=ids, params=params,
                        seed=sequence_seed(params.seed, child, self._rng),
                        detokenizer=self.engine.outputs.new_detokenizer(ids, params),
                        grammar=self.engine.structured.new_matcher(params),
                        bad_words_token_ids=self._bad_words_token_ids(params))

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]] | None:
        """Each bad word's token ids, as written and with a leading space (vLLM's two variants), once per params."""
        if not params.bad_words:
            return None
        key = tuple(params.bad_words)
        cached = self._bad_words_cache.get(key)
        if cached is None:
            variants = {tuple(self.tokenizer.encode(prefix + w.lstrip(), add_special_tokens=False))
                        for w in params.bad_words for prefix in ("", " ")}
            cached = self._bad_words_cache[key] = [list(v) for v in sorted(variants) if v]
        return cached

    def _fail(self, out: RequestOutput, problem: str) -> None:
        logger.warning("request %s failed: %s", out.request_id, problem)
        out.error = problem
        out.finished = True
        out.outputs = [CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")]

    def _completion(self, seq: Sequence) -> CompletionOutput:
        text, reasoning = self.engine.outputs.text(seq), None
        if self.reasoning_parser is not None:
            reasoning, text = self.reasoning_parser.extract(text, seq.prompt_token_ids)
        return CompletionOutput(
            index=seq.child_index,
            text=text,
            reasoning_content=reasoning,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=seq.logprobs,
            # As vLLM: only reported with logprobs (it needs a full-vocabulary log-softmax per token).
            cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
        )

    def _stream(
        self, failed: list[tuple[int, RequestOutput]], live: list[tuple[RequestOutput, list[Sequence]]], use_tqdm: bool
    ) -> Iterator[tuple[int, RequestOutput]]:
        driver = self.parallel.is_driver
        if driver:
            yield from failed
        self._check_open()  # closed while the caller held this iterator
        engine = self.engine
        requests = {seqs[0].request_index: (out, seqs) for out, seqs in live}
        remaining = {index: len(seqs) for index, (_, seqs) in requests.items()}
        for _, seqs in live:
            for s in seqs:
                engine.add(s)
        progress = Progress(total=len(live), enabled=use_tqdm and driver)
        before, t0 = engine.stats(), time.perf_counter()
        try:
            while engine.has_unfinished():
                self._check_open()
                finished, _ = engine.step()
                for seq in finished:
                    progress.add_tokens(0, len(seq.output_token_ids))
                    remaining[seq.request_index] -= 1
                    if remaining[seq.request_index] == 0:
                        progress.request_done(seq.num_prompt_tokens)
                        out, seqs = requests[seq.request_index]
                        self._finish(out, seqs)
                        if driver:
                            yield seq.request_index, out
        finally:
            progress.close()
            if not self.closed:  # closed mid-iteration: nothing left to free or count
                # Only has work when the caller stopped iterating (or an exception escaped): free the blocks
                # of what is left so a later call does not run, or trip over, orphaned sequences.
                engine.abort([s for _, seqs in live for s in seqs])
                # Logged at INFO only below the bar this call drew; without one the caller either draws its own
                # (`fdlite run`: the line would land inside it, and the job's summary says it all) or wants text
                # only.
                self.last_generate_stats = self._generate_stats(before, time.perf_counter() - t0, len(live),
                                                                log=driver,
                                                                level=logging.INFO if use_tqdm else logging.DEBUG)

    def _finish(self, out: RequestOutput, seqs: list[Sequence]) -> None:
        out.outputs = [self._completion(s) for s in seqs]
        first = seqs[0]
        if first.wants_prompt_logprobs:
            out.prompt_logprobs = first.prompt_logprobs if first.prompt_logprobs is not None else [None]
        out.finished = True
        out.error = next((s.error for s in seqs if s.error is not None), None)
        out.metrics = {
            "arrival_time": min(s.arrival_time for s in seqs),
            "first_token_time": min((s.first_token_time for s in seqs if s.first_token_time), default=None),
            "finish_time": max(s.finish_time for s in seqs),
            "num_preemptions": sum(s.num_preemptions for s in seqs),
            "num_cached_tokens": sum(s.num_cached_tokens or 0 for s in seqs),  # prefix-cache hits, all n children
        }

    def _generate_stats(self, before: dict[str, int], elapsed_s: float, num_requests: int,
                        log: bool = True, level: int = logging.INFO) -> dict[str, Any]:
        """Engine counters over one generate call, plus the prefix-cache hit rate; logged as one line (driver only)."""
        after = self.engine.stats()
        stats: dict[str, Any] = {k: after[k] - before[k] for k in after}
        queried = stats["prefix_cache_queried_tokens"]
        stats["prefix_cache_hit_rate"] = stats["prefix_cache_hit_tokens"] / queried if queried else 0.0
        stats.update(num_requests=num_requests, elapsed_s=elapsed_s)
        if log:
            logger.log(
                level, "generate: %s in %.2f s, %s; prefill tokens computed %d, decode %d; prefix cache "
                "hit %d of %d tokens (%.1f%%); %s", _count(num_requests, "request"), elapsed_s,
                _count(stats["num_steps"], "step"), stats["prefill_tokens_computed"],
                stats["decode_tokens_computed"], stats["prefix_cache_hit_tokens"], queried,
                100 * stats["prefix_cache_hit_rate"], _count(stats["num_preemptions"], "preemption"),
            )
        return stats


# Engines whose finalizer ran during another engine's CUDA-graph capture (see `LLM.__del__`).
_DEFERRED_CLOSE: list[LLM] = []


def _close_deferred() -> None:
    while _DEFERRED_CLOSE:
        _DEFERRED_CLOSE.pop().close()


def _count(n: int, noun: str) -> str:
    """"1 request", "2 requests"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
