"""Plant known bugs in scratch copies of the repository and check that the tests catch each one.

Every mutation below is data: the files it edits (exact `old` text -> `new` text, `old` found exactly
once), and the tests that must catch it. For each one the script copies the repository (git's tracked
and untracked-but-not-ignored files) to a temporary folder, applies the edits there, runs the selected
tests with a time limit and reports:

  caught          at least one selected test failed (or errored)
  NOT CAUGHT      every selected test passed: the suite would let this bug through
  PATCH FAILED    an `old` text is missing or ambiguous: the code moved (a refactor); retarget the
                  mutation at the new code instead of dropping it
  NO TESTS        the selected tests no longer exist (renamed?); fix the selection
  timeout         the run passed its time limit (counted as caught, but look at it)

First the selected tests run on an unmodified copy (the baseline): a test that fails there says
nothing about a mutation. The working tree is never touched.

    python tools/mutation_check.py                     # every mutation (about 20-30 minutes on 2 cores)
    python tools/mutation_check.py --only static-waves --only free-head-first
    python tools/mutation_check.py --list
    python tools/mutation_check.py --report results/mutation_check.md --json results/mutation_check.json

Not part of CI: it runs the slow tests many times. Exit status: 0 when the baseline passes and every
mutation is caught, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import py_compile
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Edit:
    file: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str


@dataclass(frozen=True)
class Mutation:
    id: str
    bug: str  # what the planted bug does, in words
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]  # pytest node ids or test files that must catch it
    first_check: str  # what the first mutation check found: "caught", "not caught" or "new"


GRAPH = "tests/test_graph_optimization.py"

MUTATIONS: tuple[Mutation, ...] = (
    # ---- not caught by the first check -------------------------------------------------------------
    Mutation(
        "min-tokens-disables-stops",
        "No stop condition at all once min_tokens > 0 (check_stop and the engine's stop-string gate)",
        (Edit("fdlite/runner/stop_checker.py",
              "    if n_out >= p.min_tokens:\n",
              "    if n_out >= p.min_tokens and p.min_tokens == 0:\n"),
         Edit("fdlite/runner/output_processor.py",
              "check_stop=len(seq.output_token_ids) + 1 >= seq.params.min_tokens)",
              "check_stop=len(seq.output_token_ids) + 1 >= seq.params.min_tokens and seq.params.min_tokens == 0)")),
        ("tests/test_generate_api.py",),
        "not caught",
    ),
    Mutation(
        "preempted-requeued-at-back",
        "A preempted sequence goes to the back of the waiting queue instead of the front",
        (Edit("fdlite/runner/scheduler.py",
              "        self.waiting.appendleft(seq)\n",
              "        self.waiting.append(seq)\n"),),
        ("tests/test_scheduler.py", "tests/test_preemption.py"),
        "not caught",
    ),
    Mutation(
        "sot-detached-after-warmup",
        "SOT is detached after its warm-up: every generate step runs the dynamic forward",
        (Edit("fdlite/runner/model_runner.py",
              "                self.sot_warmup(recorder)\n",
              "                self.sot_warmup(recorder)\n"
              "            layer.graph_opt_backend = None  # MUTATION\n"),),
        (GRAPH, "tests/test_tensor_parallel.py::test_tp2_with_sot_static_graph"),
        "not caught",
    ),
    Mutation(
        "sot-attached-in-profile-run",
        "SOT is attached before the profiling run, so it translates before CUDA-graph capture",
        (Edit("fdlite/runner/model_runner.py",
              "        with_cache = device_memory()\n",
              "        with_cache = device_memory()\n"
              "        g = self.config.graph_optimization_config  # MUTATION\n"
              "        if g.graph_opt_level >= 1:\n"
              "            self.model.model.graph_opt_backend = GraphOptBackend(self.model.model, g.graph_opt_level)\n"),),
        (f"{GRAPH}::test_startup_order_sot_inside_capture_inside_allreduce_context",
         f"{GRAPH}::test_sot_translates_in_its_warmup_phase_only"),
        "not caught",
    ),
    # ---- tests the first check found unable to fail: a bug each now catches ------------------------
    Mutation(
        "static-waves",
        "Static batching: waiting requests join only when no sequence is running",
        (Edit("fdlite/runner/scheduler.py",
              "        if batch.preempted or not self.waiting or len(self.running) >= self.max_num_seqs",
              "        if batch.preempted or batch.rows or not self.waiting or len(self.running) >= self.max_num_seqs"),),
        ("tests/test_hf_parity.py::test_greedy_matches_transformers", "tests/test_scheduler.py"),
        "new",
    ),
    Mutation(
        "padding-writes-a-real-slot",
        "Padded rows of a CUDA-graph batch write their KV to slot 0 instead of the scratch block",
        (Edit("fdlite/runner/forward_buffers.py",
              "        self.slot_mapping.stage(self.scratch_block * self.block_size, t, extra)\n",
              "        self.slot_mapping.stage(0, t, extra)  # MUTATION\n"),),
        (f"{GRAPH}::test_padded_decode_graphs_give_identical_tokens",
         f"{GRAPH}::test_graph_buffers_keep_their_addresses"),
        "new",
    ),
    Mutation(
        "verify-never-runs",
        "verify_cudagraph is ignored: no graph is checked against the eager forward",
        (Edit("fdlite/runner/cudagraph_runner.py",
              "        for size in sorted(self.graphs, reverse=True):\n            self.verify(size, tolerance)\n",
              "        for size in sorted(self.graphs, reverse=True):\n            pass  # MUTATION\n"),),
        (f"{GRAPH}::test_verify_rejects_a_graph_that_ignores_new_inputs",),
        "new",
    ),
    Mutation(
        "negative-seed-abs",
        "A negative seed is folded to abs(seed) instead of seed mod 2**64 (so -k and k collide)",
        (Edit("fdlite/sample/random.py",
              "np.asarray([seed % 2**64], np.uint64)",
              "np.asarray([abs(seed)], np.uint64)"),),
        ("tests/test_sampler.py::test_sequence_seed", "tests/test_seeded_sampling.py"),
        "new",
    ),
    Mutation(
        "kv-heads-replicated-not-split",
        "With at least tp KV heads, every rank takes KV head 0 on (a replica) instead of its own share",
        (Edit("fdlite/models/tp_partition.py",
              "            num_kv, kv_start = kv // size, rank * (kv // size)\n",
              "            num_kv, kv_start = kv // size, 0  # MUTATION\n"),),
        ("tests/test_tensor_parallel.py::test_kv_heads_are_split_or_replicated",
         "tests/test_tensor_parallel.py::test_tp2_greedy_is_token_identical_to_tp1",
         "tests/test_tensor_parallel.py::test_partition_arithmetic"),
        "new",
    ),
    Mutation(
        "row-parallel-bias-dropped",
        "Row-parallel layers (o_proj, down_proj) drop their bias after the all-reduce (CPU, more than one rank)",
        (Edit("fdlite/models/parallel_linear.py",
              "        y = tensor_parallel_all_reduce(y)\n        return y + self.bias if self.bias is not None else y\n",
              "        y = tensor_parallel_all_reduce(y)\n        return y  # MUTATION\n"),),
        ("tests/test_tensor_parallel.py::test_tp2_greedy_is_token_identical_to_tp1",),
        "new",
    ),
    # ---- caught by the first check ----------------------------------------------------------------
    Mutation(
        "top-p-drops-crossing-token",
        "top-p keeps only tokens whose cumulative mass stays below p, dropping the one that crosses it",
        # Both places that apply top-p: the draw (a token is rejected when the mass strictly above it
        # reaches p) and the reference distribution `probs` (mass strictly before each sorted token; a test
        # helper, tests/sampling_helpers.py).
        (Edit("fdlite/sample/sampler.py",
              "        rejected = mass_above >= threshold[active[nucleus]]\n",
              "        rejected = mass_above + sp[np.arange(len(nucleus)), picked[nucleus]] >= threshold[active[nucleus]]\n"),
         Edit("tests/sampling_helpers.py",
              "        keep_sorted = before < sub.top_p[:, None]",
              "        keep_sorted = before + sorted_w < sub.top_p[:, None]")),
        ("tests/test_sampler.py",),
        "caught",
    ),
    Mutation(
        "stop-string-no-lookback",
        "Stop strings are searched in the new text only, so one spanning two tokens is missed",
        (Edit("fdlite/detokenizer.py",
              "        self._stop_lookback = max((len(s) for s in self.stop), default=1) - 1\n",
              "        self._stop_lookback = 0  # MUTATION\n"),),
        ("tests/test_detokenizer.py", "tests/test_generate_api.py::test_stop_strings_after_min_tokens_cut_exactly"),
        "caught",
    ),
    Mutation(
        "free-head-first",
        "Freed blocks are parked head first, so eviction strands the rest of a cached chain",
        (Edit("fdlite/kvcache/block_allocator.py",
              "        for block in reversed(block_table):\n",
              "        for block in block_table:  # MUTATION\n"),),
        ("tests/test_prefix_cache.py::test_lru_evicts_least_recently_freed_tails_first_and_only_when_needed",
         "tests/test_prefix_cache.py::test_eviction_under_pressure_keeps_the_head_of_a_chain"),
        "caught",
    ),
    Mutation(
        "hash-chain-ignores-parent",
        "A block's prefix-cache hash ignores the blocks before it (same tokens elsewhere share KV)",
        (Edit("fdlite/kvcache/prefix_cache.py",
              "hash_block(hashes[-1] if hashes else ROOT_HASH, ",
              "hash_block(ROOT_HASH, "),),
        ("tests/test_prefix_cache.py::test_hash_chain_names_the_whole_prefix",
         "tests/test_prefix_cache.py::test_a_block_is_shared_only_behind_the_same_prefix"),
        "caught",
    ),
    Mutation(
        "resume-ignores-missing-newline",
        "The resume scan accepts a last line without its newline (a write cut right before it)",
        (Edit("fdlite/jobs/job_output.py",
              "    if not raw.endswith(b\"\\n\"):\n        return None, \"no line end\"\n",
              ""),),
        ("tests/test_jobs_output.py::test_torn_last_line_is_cut_away",
         "tests/test_jobs_run.py::test_sigkill_mid_write_then_rerun_gives_each_id_once_and_identical_output"),
        "caught",
    ),
    Mutation(
        "verify-replays-capture-inputs",
        "The CUDA-graph self-check replays on the capture's own inputs, so a stale graph passes",
        (Edit("fdlite/runner/cudagraph_runner.py",
              "        batch = self.dummy_batch(size, seed=10_000 + size, worst_case=False)\n",
              "        batch = self.dummy_batch(size, seed=size, worst_case=True)  # MUTATION\n"),),
        (f"{GRAPH}::test_verify_rejects_a_graph_that_ignores_new_inputs",
         f"{GRAPH}::test_verify_replays_each_graph_on_other_inputs_than_its_capture"),
        "caught",
    ),
    Mutation(
        "buffer-write-makes-new-tensors",
        "Each step writes the graph inputs into new tensors instead of the captured buffers",
        (Edit("fdlite/runner/forward_buffers.py",
              "        self.host[start : start + n] = values\n",
              "        if not self.on_gpu:  # MUTATION: a new tensor per write\n"
              "            self.tensor = self.tensor.clone()\n"
              "            self.host = np.from_dlpack(self.tensor)\n"
              "        self.host[start : start + n] = values\n"),),
        (f"{GRAPH}::test_graph_buffers_keep_their_addresses",
         f"{GRAPH}::test_decode_and_mixed_graphs_give_identical_tokens",
         f"{GRAPH}::test_padded_decode_graphs_give_identical_tokens"),
        "caught",
    ),
    # ---- the step as one call per phase -------------------------------------------------------------
    Mutation(
        "no-placeholder-at-schedule",
        "schedule() gives a row that samples no placeholder token: the next step (async) does not compute it",
        (Edit("fdlite/runner/scheduler.py",
              "            if c == seq.num_tokens:\n                seq.num_output_placeholders += 1\n",
              "            if c == seq.num_tokens and False:  # MUTATION\n                seq.num_output_placeholders += 1\n"),),
        ("tests/test_scheduler.py",),  # (the engine tests would spin: rows with nothing left to compute)
        "new",
    ),
    Mutation(
        "async-keeps-finished-rows",
        "Async scheduling runs the rows that finished in the step before (their blocks already freed) one step more",
        (Edit("fdlite/runner/scheduler.py",
              "        if finished and self._latest is not None and self._latest is not scheduled:\n",
              "        if False:  # MUTATION\n"),),
        ("tests/test_async_scheduling.py",),
        "new",
    ),
    Mutation(
        "package-cycle",
        "A layer imports the runner: a cycle between packages",
        (Edit("fdlite/layers/norm.py",
              "from fdlite.kernels.custom_op import CustomOp\n",
              "from fdlite.kernels.custom_op import CustomOp\nimport fdlite.runner.sequence  # MUTATION\n"),),
        ("tests/test_package_structure.py::test_no_import_cycles_between_packages",),
        "new",
    ),
    Mutation(
        "worker-prepares-twice",
        "The engine prepares each step twice (a second call per phase)",
        (Edit("fdlite/runner/engine.py",
              "        prepared = self.worker.prepare(scheduled)\n        sampled = self._execute(prepared, self._take_poison())\n",
              "        prepared = self.worker.prepare(scheduled)\n        self.worker.prepare(scheduled)  # MUTATION\n"
              "        sampled = self._execute(prepared, self._take_poison())\n"),),
        ("tests/test_package_structure.py::test_one_call_per_phase_each_step",),
        "new",
    ),
    Mutation(
        "generation-config-ignored",
        "The model's generation_config.json sampling defaults never reach a request",
        (Edit("fdlite/sampling_params.py",
              "        if not unset:\n            return self\n",
              "        if True:  # MUTATION\n            return self\n"),),
        ("tests/test_generation_config.py",),
        "new",
    ),
    Mutation(
        "generation-config-overrides-the-request",
        "generation_config.json values replace the ones a request set itself",
        (Edit("fdlite/sampling_params.py",
              "        unset = {k: v for k, v in defaults.items() if k not in self._set_fields and getattr(self, k) != v}\n",
              "        unset = {k: v for k, v in defaults.items() if getattr(self, k) != v}  # MUTATION\n"),),
        ("tests/test_generation_config.py",),
        "new",
    ),
    Mutation(
        "json-whitespace-unbounded",
        "JSON constraints allow any run of whitespace by default again (a weak model never finishes)",
        (Edit("fdlite/structured/grammar.py",
              "{\"whitespace_pattern\": whitespace or BOUNDED_WHITESPACE}",
              "{\"whitespace_pattern\": whitespace or FLEXIBLE_WHITESPACE}  # MUTATION"),),
        ("tests/test_structured_outputs.py::test_json_with_the_default_whitespace_finishes_on_a_random_model",),
        "new",
    ),
    # ---- end to end against independent references (penalties, stop ids, children, cached prompts) ---------
    Mutation(
        "stop-ids-ignored-with-ignore-eos",
        "ignore_eos also ignores stop_token_ids (vLLM: it ignores EOS only)",
        (Edit("fdlite/runner/stop_checker.py",
              "        if p.stop_token_ids and token in p.stop_token_ids:\n",
              "        if not p.ignore_eos and p.stop_token_ids and token in p.stop_token_ids:  # MUTATION\n"),),
        ("tests/test_penalties_and_stops.py::test_stop_token_ids_still_stop_with_ignore_eos",),
        "new",
    ),
    Mutation(
        "seeded-children-share-a-seed",
        "The n children of a seeded request all get the same seed, so they draw the same tokens",
        (Edit("fdlite/sample/random.py",
              "splitmix64(np.asarray([child_index], np.uint64))",
              "splitmix64(np.asarray([0 * child_index], np.uint64))"),),
        ("tests/test_penalties_and_stops.py::test_seeded_children_draw_different_tokens_and_repeat",),
        "new",
    ),
    Mutation(
        "repetition-penalty-ignores-the-prompt",
        "The repetition penalty counts output tokens only, not the prompt's (vLLM and transformers count both)",
        (Edit("fdlite/sample/sampler.py",
              "    seen = (counts > 0) | batch.prompt_seen\n",
              "    seen = counts > 0  # MUTATION\n"),),
        ("tests/test_penalties_and_stops.py::test_penalties_match_transformers",),
        "new",
    ),
    Mutation(
        "presence-penalty-sign-flipped",
        "The presence penalty is added instead of subtracted",
        (Edit("fdlite/sample/sampler.py",
              "- batch.presence_penalty[:, None] * (counts > 0)",
              "+ batch.presence_penalty[:, None] * (counts > 0)"),),
        ("tests/test_penalties_and_stops.py::test_penalties_match_transformers",),
        "new",
    ),
    Mutation(
        "cached-prompt-computes-nothing",
        "A prompt whose every block is cached takes them all, leaving no token to compute its next one from",
        (Edit("fdlite/kvcache/prefix_cache.py",
              "max_blocks = min((seq.num_tokens - 1) // self.block_size,",
              "max_blocks = min(seq.num_tokens // self.block_size,  # MUTATION\n                         "),),
        ("tests/test_penalties_and_stops.py::test_a_prompt_whose_every_block_is_cached_still_computes_its_last_token",),
        "new",
    ),
    Mutation(
        "gpu-token-tables-not-counted",
        "The GPU sampler's device token tables never count the sampled tokens (penalties see the prompt only)",
        (Edit("fdlite/sample/sampler_gpu.py",
              "            self.tables.count(batch.penalty_slots, gpu_ops.gather_rows(tokens, _upload(batch.penalty_rows, np.int64)))\n",
              "            pass  # MUTATION\n"),),
        ("tests/test_gpu_path_cpu.py::test_emulated_gpu_sampler_applies_penalties_and_bans_on_the_device",),
        "new",
    ),
    Mutation(
        "bans-beat-a-complete-grammar",
        "min_tokens bans empty a constrained row whose grammar allows only EOS (CPU and GPU samplers)",
        (Edit("fdlite/sample/sampler.py",
              "        if not left.any():\n",
              "        if False:  # MUTATION\n"),),
        ("tests/test_structured_outputs.py::test_min_tokens_does_not_break_a_complete_grammar",
         "tests/test_gpu_path_cpu.py::test_emulated_gpu_sampler_applies_grammar_masks_on_the_device"),
        "new",
    ),
    Mutation(
        "logit-bias-ignored",
        "logit_bias never reaches the logits (CPU sampler)",
        (Edit("fdlite/sample/sampler.py",
              "        np.add.at(x, (batch.bias_rows, batch.bias_tokens), batch.bias_values)\n",
              "        pass  # MUTATION\n"),),
        ("tests/test_penalties_and_stops.py::test_logit_bias_and_allowed_token_ids_match_a_reference",),
        "new",
    ),
    Mutation(
        "gpu-allowed-ids-ignored",
        "On the GPU path allowed_token_ids masks nothing",
        (Edit("fdlite/sample/sampler_gpu.py",
              "        if batch.allowed_rows is not None:\n            gpu_ops.apply_bitmask_",
              "        if False:  # MUTATION\n            gpu_ops.apply_bitmask_"),),
        ("tests/test_gpu_path_cpu.py::test_emulated_gpu_sampler_applies_logit_bias_and_allowed_ids_on_the_device",),
        "new",
    ),
    Mutation(
        "bad-words-ignored",
        "bad_words ban nothing",
        (Edit("fdlite/runner/input_batch.py",
              "            pairs += [(i, t) for t in self._bad_words_due(int(slots[i]), int(num_output[i]))]\n",
              "            pass  # MUTATION\n"),),
        ("tests/test_penalties_and_stops.py::test_bad_words_are_never_generated",),
        "new",
    ),
    Mutation(
        "bad-words-single-token-only",
        "A bad word of several tokens is never banned (only one-token words are)",
        (Edit("fdlite/runner/input_batch.py",
              "            if k == 0 or (k <= num_output and",
              "            if k == 0 or (False and"),),
        ("tests/test_penalties_and_stops.py::test_bad_words_are_never_generated",),
        "new",
    ),
    Mutation(
        "gpu-logprobs-of-processed-logits",
        "On the GPU path logprobs are taken from the logits after penalties and bans (no raw copy first)",
        (Edit("fdlite/sample/sampler_gpu.py",
              "        if len(asking) and _adjusts(batch):",
              "        if False:  # MUTATION"),),
        ("tests/test_logprobs.py::test_emulated_gpu_logprobs_equal_the_cpu_in_one_copy_per_sampler_call",
         "tests/test_gpu_path_cpu.py::test_emulated_gpu_sampler_applies_penalties_and_bans_on_the_device"),
        "new",
    ),
    Mutation(
        "logprob-rank-off-by-one",
        "A token's rank counts only strictly better tokens (the top token gets rank 0)",
        (Edit("fdlite/sample/logprobs.py",
              "    ranks = (x >= xt[:, None]).sum(axis=1).astype(np.int64)",
              "    ranks = (x > xt[:, None]).sum(axis=1).astype(np.int64)"),),
        ("tests/test_logprobs.py",),
        "new",
    ),
    Mutation(
        "prompt-logprobs-off-by-one",
        "Prompt logprobs read the hidden state at the target's own position instead of the one before",
        (Edit("fdlite/runner/input_batch.py",
              "            index.append(int(cu[r]) - c - 1 + np.arange(first, last + 1))",
              "            index.append(int(cu[r]) - c + np.minimum(np.arange(first, last + 1), c + int(counts[r]) - 1))"),),
        ("tests/test_logprobs.py::test_prompt_and_sample_logprobs_match_transformers",),
        "new",
    ),
    Mutation(
        "prompt-logprobs-from-the-prefix-cache",
        "A request asking for prompt logprobs takes cached prefix blocks (their positions never get logprobs)",
        (Edit("fdlite/runner/scheduler.py",
              "            hits = [] if seq.wants_prompt_logprobs else self.allocator.match_prefix(seq)",
              "            hits = self.allocator.match_prefix(seq)"),),
        ("tests/test_logprobs.py::test_prompt_and_sample_logprobs_match_transformers",),
        "new",
    ),
    Mutation(
        "prompt-logprobs-repeated-after-preemption",
        "A preempted sequence reports its prompt logprobs again when it recomputes its prompt",
        (Edit("fdlite/runner/input_batch.py",
              "            recorded = len(seq.prompt_logprobs) if seq.prompt_logprobs is not None else 1",
              "            recorded = 1"),),
        ("tests/test_logprobs.py::test_prompt_logprobs_are_the_same_under_preemption_async_scheduling_and_n2",),
        "new",
    ),
    Mutation(
        "mixed-steps-run-eagerly",
        "Steps with prefill tokens never replay their token-count graphs (only decode-only steps replay)",
        (Edit("fdlite/runner/cudagraph_runner.py",
              "    fits = batch.num_rows <= max_num_seqs if mixed else batch.num_decodes == batch.num_rows\n",
              "    fits = batch.num_decodes == 0 and batch.num_decodes == batch.num_rows if mixed else "
              "batch.num_decodes == batch.num_rows  # MUTATION\n"),),
        ("tests/test_graph_optimization.py",),
        "new",
    ),
    Mutation(
        "graph-verify-on-the-capture-split",
        "A graph's self-check replays the capture's own split, so a graph bound to its split passes",
        (Edit("fdlite/runner/cudagraph_runner.py",
              "        batch = self.dummy_batch(size, seed=10_000 + size, worst_case=False)",
              "        batch = self.dummy_batch(size, seed=size, worst_case=True)"),),
        ("tests/test_graph_optimization.py::test_verify_replays_a_mixed_graph_on_another_split",),
        "new",
    ),
    Mutation(
        "cudagraphs-off-by-default",
        "CUDA graphs stay off unless asked for (FastDeploy 2.2's default)",
        (Edit("fdlite/runner/model_runner.py",
              "        if g.use_cudagraph is False or cudagraph_factory(self.device) is None:",
              "        if not g.use_cudagraph or cudagraph_factory(self.device) is None:"),),
        ("tests/test_graph_optimization.py::test_a_churning_job_replays_nearly_every_step_and_matches_eager",),
        "new",
    ),
    Mutation(
        "async-token-patch-skipped",
        "Async scheduling's early-prepared step runs with the stale host input ids (the device patch is skipped)",
        (Edit("fdlite/runner/forward_buffers.py",
              "        if patch is None:\n            return\n        p, ids = patch\n",
              "        if True:  # MUTATION\n            return\n        p, ids = patch\n"),),
        ("tests/test_async_early_prepare.py", "tests/test_async_scheduling.py"),
        "new",
    ),
    Mutation(
        "bf16-rotary-truncated",
        "The bfloat16 rotary tables are truncated to bf16 (Paddle 2.6's to_tensor) instead of rounded to nearest",
        (Edit("fdlite/layers/rotary.py",
              "    bits = ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)",
              "    bits = (u >> 16).astype(np.uint16)  # MUTATION"),),
        ("tests/test_fast_load.py::test_rotary_table_in_bfloat16_is_rounded_on_the_host_as_paddle_casts",),
        "new",
    ),
    Mutation(
        "fused-pieces-overlap",
        "The loader writes every piece of a fused weight (q/k/v, gate/up) at the parameter's first rows",
        (Edit("fdlite/models/weight_loader.py",
              "            offs[piece] = at.get(group, 0)\n",
              "            offs[piece] = 0  # MUTATION\n"),),
        ("tests/test_fast_load.py", "tests/test_hf_parity.py::test_prefill_logits_match_transformers"),
        "new",
    ),
    Mutation(
        "gpu-moe-drops-correction-bias",
        "The GPU MoE layer routes without ERNIE's score-correction bias",
        (Edit("fdlite/layers/moe.py",
              "                                         self.e_score_correction_bias, balanced=_BALANCED[\"on\"])",
              "                                         None, balanced=_BALANCED[\"on\"])  # MUTATION"),),
        ("tests/test_moe_gpu_path.py::test_emulated_gpu_moe_models_give_the_cpu_tokens",),
        "new",
    ),
    Mutation(
        "async-waits-for-the-ids-copy",
        "Async scheduling's step thread waits for the sampled ids' copy before it can launch the next step",
        (Edit("fdlite/runner/engine.py",
              "        runner.sampler.defer_host_copy = config.async_scheduling and config.tensor_parallel_size == 1",
              "        runner.sampler.defer_host_copy = False  # MUTATION"),),
        ("tests/test_async_early_prepare.py",),
        "new",
    ),
    # ---- a newcomer's first run and the repository's hygiene ----------------------------------------------
    Mutation(
        "sampling-params-bare-typeerror",
        "SamplingParams(tempreature=...) is Python's bare TypeError again, without \"did you mean\"",
        (Edit("fdlite/sampling_params.py",
              "        if not accepted.issuperset(kwargs):\n",
              "        if False:  # MUTATION\n"),),
        ("tests/test_first_run.py::test_sampling_params_typo_says_did_you_mean",),
        "new",
    ),
    Mutation(
        "finished-job-loads-the-model",
        "A job whose every request is done loads the model anyway",
        (Edit("fdlite/jobs/job_runner.py",
              "        if pending or launched_world_size() > 1:\n",
              "        if True:  # MUTATION\n"),),
        ("tests/test_first_run.py::test_a_finished_job_says_nothing_to_do",),
        "new",
    ),
    Mutation(
        "env-read-outside-envs",
        "A module reads an FDLITE_ variable itself instead of through fdlite/envs.py",
        (Edit("fdlite/runner/engine.py",
              "        self.debug_poison = envs.FDLITE_DEBUG_POISON_FREED_BLOCKS\n",
              "        self.debug_poison = os.environ.get(\"FDLITE_DEBUG_POISON_FREED_BLOCKS\") == \"1\"  # MUTATION\n"),
         Edit("fdlite/runner/engine.py", "import time\n", "import os\nimport time\n")),
        ("tests/test_envs.py",),
        "new",
    ),
    Mutation(
        "close-releases-nothing",
        "LLM.close() only marks the engine closed: the KV cache, weights, graphs, device tables and threads stay",
        (Edit("fdlite/llm.py",
              "        self._closed = True\n        engine, runner = ",
              "        self._closed = True\n        return  # MUTATION\n        engine, runner = "),),
        ("tests/test_release.py::test_close_frees_memory_that_references_still_point_at",
         "tests/test_release.py::test_emulated_gpu_close_frees_graphs_device_tables_and_the_grammar_thread"),
        "new",
    ),
    Mutation(
        "attn-mma-switch-swapped",
        "gpu.set_options hands the ops library gemv and attn_mma in each other's place",
        (Edit("fdlite/kernels/gpu.py",
              "    vals = (envs.FDLITE_PDL if pdl is None else pdl, int(envs.FDLITE_GEMV if gemv is None else gemv),\n"
              "            int(envs.FDLITE_ATTN_MMA if attn_mma is None else attn_mma),\n",
              "    vals = (envs.FDLITE_PDL if pdl is None else pdl, int(envs.FDLITE_ATTN_MMA if attn_mma is None else attn_mma),\n"
              "            int(envs.FDLITE_GEMV if gemv is None else gemv),  # MUTATION\n"),),
        ("tests/test_envs.py::test_gpu_switches_reach_the_library_in_order",),
        "new",
    ),
    Mutation(
        "async-default-on-cpu",
        "An unset async_scheduling turns on for CPU and stays off on a GPU",
        (Edit("fdlite/config.py",
              "            self.async_scheduling = device == \"gpu\"\n",
              "            self.async_scheduling = device == \"cpu\"  # MUTATION\n"),),
        ("tests/test_gpu_path_cpu.py::test_async_scheduling_defaults_on_for_a_gpu_and_off_on_cpu",),
        "new",
    ),
    Mutation(
        "fp8-kv-scale-dropped",
        "The FP8 KV cache reads its e4m3 values without their per-token scale",
        (Edit("fdlite/kvcache/fp8_cache.py",
              "        return bits.view(paddle.float8_e4m3fn).astype(\"float32\") * scale.unsqueeze(-1)\n",
              "        return bits.view(paddle.float8_e4m3fn).astype(\"float32\")  # MUTATION\n"),),
        ("tests/test_fp8_kv_cache.py",),
        "new",
    ),
    Mutation(
        "fp8-kv-quantized-to-e4m3fnuz-range",
        "The FP8 KV cache scales each vector to 240 (e4m3fnuz's largest value) instead of e4m3fn's 448: it still reads "
        "back close to its values, on a coarser grid",
        (Edit("fdlite/kvcache/fp8_cache.py",
              "        scale = paddle.where(amax > 0, amax / E4M3_MAX, paddle.ones_like(amax))\n",
              "        scale = paddle.where(amax > 0, amax / 240.0, paddle.ones_like(amax))  # MUTATION\n"),),
        ("tests/test_fp8_kv_cache.py::test_prefill_logprobs_equal_transformers_with_e4m3_kv",),
        "new",
    ),
    Mutation(
        "cpu-fp8-op-scale-dropped",
        "The C++ CPU attention op widens FP8 K/V bytes without their per-slot scales",
        (Edit("fdlite/kernels/csrc_cpu/paged_attention_cpu.cc",
              "    const float sc = scale[r];\n",
              "    const float sc = 1.0f + 0.0f * scale[r];  // MUTATION\n"),),
        ("tests/test_cpu_attention_op.py::test_fp8_cache_matches_the_reference",),
        "new",
    ),
    Mutation(
        "embedding-through-f-embedding",
        "The CPU embedding goes back to F.embedding, whose padding check fails once SOT has seen two vocabularies",
        (Edit("fdlite/layers/embedding.py",
              "            return paddle.gather(self.weight, ids)\n",
              "            return paddle.nn.functional.embedding(ids, self.weight)  # MUTATION\n"),),
        ("tests/test_graph_optimization.py::test_a_second_sot_engine_with_another_vocabulary_in_the_process",),
        "new",
    ),
    Mutation(
        "async-caches-unwritten-block",
        "A step's full blocks are cached by the computed count of every step scheduled so far (async scheduling then "
        "caches a block whose last slot a later, possibly dropped, step writes)",
        (Edit("fdlite/runner/scheduler.py",
              "            self.allocator.cache_full_blocks(seq, computed)\n",
              "            self.allocator.cache_full_blocks(seq)  # MUTATION\n"),),
        ("tests/test_async_scheduling.py::test_async_prefix_hits_never_read_unwritten_slots",),
        "new",
    ),
    Mutation(
        "async-poison-out-of-order",
        "Debug poison of freed blocks runs when they are freed, not before the next forward (async scheduling: "
        "while a step may still read them)",
        (Edit("fdlite/runner/engine.py",
              "            self.allocator.on_release = self._to_poison.extend\n",
              "            self.allocator.on_release = runner.kv_cache.poison_blocks  # MUTATION\n"),),
        ("tests/test_async_scheduling.py::test_async_prefix_hits_never_read_unwritten_slots",),
        "new",
    ),
    Mutation(
        "logprobs-topk-screen-strict",
        "The CPU top-k screen keeps only values above the k-th block maximum, losing the element that is it",
        (Edit("fdlite/sample/logprobs.py",
              "        cand = np.flatnonzero(x[r] >= tau[r]) if kk == k else np.arange(vocab)\n",
              "        cand = np.flatnonzero(x[r] > tau[r]) if kk == k else np.arange(vocab)  # MUTATION\n"),),
        ("tests/test_logprobs.py",),
        "new",
    ),
    Mutation(
        "sampler-upload-synchronous",
        "The GPU sampler's row parameters go up through paddle.to_tensor (a synchronous copy) again",
        (Edit("fdlite/sample/sampler_gpu.py",
              "    return gpu_ops.upload(a, dtype)\n",
              "    return paddle.to_tensor(np.ascontiguousarray(a, dtype=dtype))  # MUTATION\n"),),
        ("tests/test_gpu_path_cpu.py::test_emulated_gpu_seeded_sampling_follows_the_kernel_rule",),
        "new",
    ),
    Mutation(
        "fp8-dtype-at-import",
        "Fp8Cache names paddle.float8_e4m3fn when the module is imported (Paddle 2.6 has none)",
        (Edit("fdlite/kvcache/fp8_cache.py",
              "    @property\n    def dtype(self):\n",
              "    dtype_at_import = paddle.float8_e4m3fn  # MUTATION\n\n    @property\n    def dtype(self):\n"),),
        ("tests/test_fp8_kv_cache.py::test_fdlite_imports_where_paddle_has_no_float8",),
        "new",
    ),
    Mutation(
        "moe-shared-experts-builtin-add",
        "A MoE block adds its shared experts with Paddle's add on the GPU path (a kernel that does nothing on sm_90)",
        (Edit("fdlite/models/moe.py",
              "        if self.on_gpu:  # Paddle",
              "        if False:  # MUTATION Paddle"),),
        ("tests/test_moe_gpu_path.py",),
        "new",
    ),
    Mutation(
        "moe-shared-fold-dropped",
        "A MoE block on the GPU path with one rank runs its shared experts but gives moe_experts no addend (ERNIE's "
        "shared-expert output is lost)",
        (Edit("fdlite/models/moe.py",
              "            return self.experts(x, shared=self.shared_experts(x))\n",
              "            return self.experts(x)  # MUTATION\n"),),
        ("tests/test_moe_gpu_path.py::test_emulated_gpu_moe_models_give_the_cpu_tokens",
         "tests/test_moe_gpu_path.py::test_moe_block_folds_the_shared_experts_into_the_unpermute_with_one_rank"),
        "new",
    ),
    Mutation(
        "step-times-kinds-swapped",
        "The step-time breakdown (step_times, breakdown) files decode-only steps under steps with prefill tokens",
        (Edit("tools/gpu/e2e_harness.py", '    if tokens > decodes:\n        return "with prefill tokens"',
              '    if tokens >= decodes:  # MUTATION\n        return "with prefill tokens"'),),
        ("tests/test_moe_bench_tools.py::test_step_times_section_runs_quick_on_cpu",),
        "new",
    ),
    Mutation(
        "profile-model-word-not-resolved",
        "FDLITE_PROFILE_MODEL as a word only one shape holds (moe_bench's --cases form) is refused instead of resolved",
        (Edit("tools/gpu/e2e_harness.py", "    if len(hits) == 1:\n        return hits[0]\n",
              "    if len(hits) == 1 and False:  # MUTATION\n        return hits[0]\n"),),
        ("tests/test_moe_bench_tools.py::test_step_times_section_runs_quick_on_cpu",),
        "new",
    ),
    Mutation(
        "unknown-engine-option-accepted",
        "An LLM option or graph_optimization_config key that names no field is passed on instead of refused by name",
        (Edit("fdlite/config.py", "        if key not in known:\n            raise unknown_key_error(kind, key, known)\n",
              "        if key not in known and False:  # MUTATION\n            raise unknown_key_error(kind, key, known)\n"),),
        ("tests/test_bad_inputs.py::test_unknown_option_is_named",),
        "new",
    ),
    Mutation(
        "step-times-kv-not-passed",
        "The step-times job names its results for FDLITE_STEP_TIMES_KV but builds the engine with the default cache",
        (Edit("tools/gpu/e2e_harness.py",
              "        return full_size_llm(name, use_cudagraph=True, async_scheduling=async_scheduling, kv_cache_dtype=kv)",
              "        return full_size_llm(name, use_cudagraph=True, async_scheduling=async_scheduling)  # MUTATION"),),
        ("tests/test_moe_bench_tools.py::test_step_times_section_runs_quick_on_cpu",),
        "new",
    ),
    Mutation(
        "decode-fit-without-fixed-term",
        "The step-times decode fit has no per-step constant, so its parts no longer add up to the steps' time",
        (Edit("tools/gpu/e2e_harness.py", "a = np.array([[1.0, d, kv] for d, kv, _ in rows])",
              "a = np.array([[0.0, d, kv] for d, kv, _ in rows])  # MUTATION"),),
        ("tests/test_moe_bench_tools.py::test_step_times_section_runs_quick_on_cpu",),
        "new",
    ),
    Mutation(
        "kv-sizing-report-peak-not-activations",
        "The profile's activation peak (KV sizing, graph reserve, startup report) is its whole peak, weights included",
        (Edit("fdlite/kvcache/sizing.py",
              '        return self.peak_during - self.allocated_before',
              '        return self.peak_during  # MUTATION'),),
        ("tests/test_kv_sizing.py::test_sizing_report_gives_the_formula_s_terms",),
        "new",
    ),
    Mutation(
        "moe-experts-wrapper-drops-shared",
        "gpu.moe_experts never tells the kernel it has a shared addend (has_shared always false)",
        (Edit("fdlite/kernels/gpu.py",
              "    has_shared = shared is not None\n",
              "    has_shared = False  # MUTATION\n"),),
        ("tests/test_moe_gpu_path.py::test_moe_wrappers_check_shapes_before_the_kernel",),
        "new",
    ),
    Mutation(
        "dummy-router-differs-per-rank",
        "load_format='dummy' gives every rank its own values of the replicated parameters too (the MoE router), so "
        "ranks route tokens to different experts",
        (Edit("fdlite/models/dummy_weights.py",
              "                rank = model.tp.rank if _split_by_tp(pieces[name], model) else None\n",
              "                rank = model.tp.rank  # MUTATION\n"),),
        ("tests/test_dummy_weights.py::test_tensor_parallel_ranks_fill_their_own_shards_and_share_the_router",),
        "new",
    ),
    Mutation(
        "dummy-norms-random",
        "load_format='dummy' fills RMSNorm weights with random values (about 0) instead of 1",
        (Edit("fdlite/models/dummy_weights.py",
              "            if name in norms or name.endswith(\"bias\"):\n",
              "            if name.endswith(\"bias\"):  # MUTATION\n"),),
        ("tests/test_dummy_weights.py::test_values_norms_one_biases_zero_weights_at_initializer_range",),
        "new",
    ),
    Mutation(
        "gather-pieces-wrong-input-offset",
        "The logits' vocabulary all-gather on a GPU reads each piece of rows at the output's row stride instead of "
        "the input's (every piece after the first gathers the wrong rows)",
        (Edit("fdlite/distributed/communicator.py",
              "            self.custom.gather_ptr(x.data_ptr() + start * row_in, out.data_ptr() + start * row_out, n, row_in,\n",
              "            self.custom.gather_ptr(x.data_ptr() + start * row_out, out.data_ptr() + start * row_out, n, row_in,  # MUTATION\n"),),
        ("tests/test_tp_gpu_collectives.py",),
        "new",
    ),
    Mutation(
        "all-reduce-pieces-drop-the-tail",
        "Ranks sharing a GPU all-reduce a message above the custom buffer in whole pieces only (the last, shorter "
        "piece is never reduced)",
        (Edit("fdlite/distributed/communicator.py",
              "            n = min(piece, nbytes - start)\n",
              "            n = piece if nbytes - start >= piece else 0  # MUTATION\n            if not n:\n                break\n"),),
        ("tests/test_tp_gpu_collectives.py",),
        "new",
    ),
    Mutation(
        "pinned-slot-reused-before-its-copies-ran",
        "A pinned upload slot is rewritten without waiting for the event of the copies that last read it",
        (Edit("fdlite/kernels/gpu.py",
              "                lib.fdl_event_synchronize(slot[2])  # the copies that last read this slot have run\n",
              "                pass  # MUTATION\n"),),
        ("tests/test_gpu_ops_cpu.py",),
        "new",
    ),
    Mutation(
        "graphs-verified-inside-the-capture-context",
        "The CUDA graphs' self-check replays them inside capture_custom_allreduce(), before the custom all-reduce "
        "registered their buffers (on the GPU every tensor-parallel engine then fails its startup check)",
        (Edit("fdlite/runner/model_runner.py",
              "                    runner.capture_all(recorder, verify=False)\n",
              "                    runner.capture_all(recorder, verify=g.verify_cudagraph)  # MUTATION\n"),
         Edit("fdlite/runner/model_runner.py",
              "            if g.verify_cudagraph:\n                # After the context",
              "            if False:  # MUTATION\n                # After the context"),),
        (f"{GRAPH}::test_startup_order_sot_inside_capture_inside_allreduce_context",),
        "new",
    ),
    Mutation(
        "pinned-gpu-ranks-use-nccl",
        "Ranks that name their GPU (device='gpu:0', possibly sharing it) get an NCCL group, which refuses two ranks on "
        "one device",
        (Edit("fdlite/distributed/parallel_state.py",
              '    return "gloo" if device == "cpu" or pinned_gpu else "nccl"\n',
              '    return "gloo" if device == "cpu" else "nccl"  # MUTATION\n'),),
        ("tests/test_tp_gpu_collectives.py::test_control_backend",),
        "new",
    ),
    Mutation(
        "device-broadcast-ids-stay-on-host",
        "A tensor-parallel rank > 0 on the GPU keeps the broadcast ids on the host only (the next step's input patch "
        "then has no device ids to read)",
        (Edit("fdlite/distributed/lockstep.py",
              "    return SamplerOutput(token_ids=gpu_ops.to_host(ids).tolist(), device_tokens=ids)",
              "    return SamplerOutput(token_ids=gpu_ops.to_host(ids).tolist())  # MUTATION"),),
        ("tests/test_tp_gpu_collectives.py::test_sampled_ids_are_broadcast_on_the_device",),
        "new",
    ),
    Mutation(
        "machine-path-in-docs",
        "A machine's absolute path written into the docs",
        (Edit("docs/design.md", "# fdlite design notes\n", "# fdlite design notes\n\nBuilt in /" "root/work/fdlite.\n"),),  # (split: this file is checked too)
        ("tests/test_repository_hygiene.py",),
        "new",
    ),
    Mutation(
        "wgmma-never-built",
        "The ops build for sm_90a without telling the host side, so the wgmma prefill attention never launches",
        (Edit("fdlite/kernels/build.py",
              "    if \"90a\" in archs:\n",
              "    if \"90a\" in archs and False:  # MUTATION\n"),),
        ("tests/test_gpu_ops_cpu.py::test_build_flags_name_each_arch_and_the_cache_key_follows_sources",),
        "new",
    ),
    Mutation(
        "attn-kernel-default-mma-sync",
        "FDLITE_ATTN_MMA defaults to 1: bf16 / fp16 prefill attention stays on mma.sync on Hopper",
        (Edit("fdlite/envs.py",
              "    \"FDLITE_ATTN_MMA\": Var(\"2\",",
              "    \"FDLITE_ATTN_MMA\": Var(\"1\",  # MUTATION\n                          "),),
        ("tests/test_envs.py::test_attn_kernel_switch_is_zero_one_or_two",),
        "new",
    ),
    Mutation(
        "decode-mma-default-off",
        "FDLITE_DECODE_MMA defaults to 0: bf16 / fp16 decode attention stays on the CUDA-core kernel",
        (Edit("fdlite/envs.py",
              "    \"FDLITE_DECODE_MMA\": Var(\"1\",",
              "    \"FDLITE_DECODE_MMA\": Var(\"0\",  # MUTATION\n                             "),),
        ("tests/test_envs.py::test_decode_kernel_switch_is_a_flag_on_by_default",),
        "new",
    ),
    Mutation(
        "decode-mma-switch-ignored",
        "gpu.set_options never hands the library the decode kernel switch (FDLITE_DECODE_MMA's value always)",
        (Edit("fdlite/kernels/gpu.py",
              "            int(envs.FDLITE_DECODE_MMA if decode_mma is None else decode_mma),\n",
              "            int(envs.FDLITE_DECODE_MMA),  # MUTATION\n"),),
        ("tests/test_envs.py::test_gpu_switches_reach_the_library_in_order",),
        "new",
    ),
    Mutation(
        "decode-split-keys-switch-ignored",
        "gpu.set_options never hands the library the decode length rule's unit (FDLITE_DECODE_SPLIT_KEYS's value always)",
        (Edit("fdlite/kernels/gpu.py",
              "            int(envs.FDLITE_DECODE_SPLIT_KEYS if decode_split_keys is None else decode_split_keys))\n",
              "            int(envs.FDLITE_DECODE_SPLIT_KEYS))  # MUTATION\n"),),
        ("tests/test_envs.py::test_gpu_switches_reach_the_library_in_order",),
        "new",
    ),
    Mutation(
        "moe-block-m-without-wgmma",
        "The MoE wrappers refuse block_m 128, the wgmma kernels' tile (no side-by-side runs against them)",
        (Edit("fdlite/kernels/gpu.py",
              "MOE_BLOCK_M = (0, 16, 64, 128)\n",
              "MOE_BLOCK_M = (0, 16, 64)  # MUTATION\n"),),
        ("tests/test_moe_gpu_path.py::test_moe_wrappers_check_shapes_before_the_kernel",),
        "new",
    ),
    Mutation(
        "cuda-archs-default-plain-90",
        "The ops are compiled for plain sm_90 by default (no wgmma code)",
        (Edit("fdlite/kernels/build.py",
              "    archs: list[str] = field(default_factory=lambda: [\"90a\"])\n",
              "    archs: list[str] = field(default_factory=lambda: [\"90\"])  # MUTATION\n"),),
        ("tests/test_gpu_ops_cpu.py::test_build_flags_name_each_arch_and_the_cache_key_follows_sources",),
        "new",
    ),
    Mutation(
        "eager-step-plans-attention-alone",
        "An eager step plans its GPU attention (kernel, KV split count) for its own row count, max_q_len and table "
        "width instead of the graph it would replay in: graphs != eager in bf16",
        (Edit("fdlite/runner/forward_buffers.py",
              "graph_attention(*graph) if graph is not None else (flat.max_q_len, 0)",
              "(flat.max_q_len, 0)"),),
        ("tests/test_gpu_path_cpu.py::test_emulated_gpu_eager_steps_plan_attention_as_their_graphs",
         "tests/test_capture_sizes.py::test_an_eager_step_plans_attention_as_the_graph_it_would_run_in"),
        "new",
    ),
    Mutation(
        "fp8-cache-skips-the-cpp-op",
        "CPU attention over an FP8 cache runs the Paddle-op reference instead of the C++ op",
        (Edit("fdlite/layers/attention.py",
              "(isinstance(k_cache, Fp8Cache) or k_cache.dtype == paddle.float32)",
              "k_cache.dtype in (paddle.float32, Fp8Cache.dtype)"),),
        ("tests/test_fp8_kv_cache.py::test_fp8_cache_steps_run_the_cpp_attention_op",),
        "new",
    ),
    Mutation(
        "gpu-cache-key-misses-a-header",
        "The GPU ops' build cache key leaves out a header the sources include (an edit to it keeps a stale library)",
        (Edit("fdlite/kernels/native.py", ' "attention_decode_mma.cuh",', ""),),
        ("tests/test_gpu_ops_cpu.py::test_cache_key_hashes_every_header_the_gpu_sources_include",),
        "new",
    ),
    Mutation(
        "readme-misses-a-variable",
        "A new environment variable is left out of README's table",
        (Edit("README.md", "| `FDLITE_DECODE_SPLIT_KEYS` |", "| `FDLITE_DECODE_SPLIT_KEYZ` |"),),
        ("tests/test_envs.py::test_readme_table_is_the_variables_table",),
        "new",
    ),
)


# ---- running -----------------------------------------------------------------------------------


@dataclass
class Result:
    id: str
    status: str  # caught, NOT CAUGHT, PATCH FAILED, NO TESTS, timeout, baseline
    detail: str = ""
    failed: list[str] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status in ("caught", "timeout")


def repo_files(root: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout
    return [f for f in out.decode().split("\0") if f and os.path.isfile(os.path.join(root, f))]


def copy_repo(files: list[str], src: str, dst: str) -> None:
    for f in files:
        os.makedirs(os.path.dirname(os.path.join(dst, f)), exist_ok=True)
        shutil.copy2(os.path.join(src, f), os.path.join(dst, f))


def apply(mutation: Mutation, tree: str) -> str | None:
    """Apply the edits in `tree`; return why they cannot be applied, or None."""
    texts: dict[str, str] = {}
    for edit in mutation.edits:
        path = os.path.join(tree, edit.file)
        if edit.file not in texts:
            if not os.path.exists(path):
                return f"{edit.file}: no such file"
            with open(path, encoding="utf-8") as f:
                texts[edit.file] = f.read()
        found = texts[edit.file].count(edit.old)
        if found != 1:
            where = "not found" if found == 0 else f"found {found} times"
            return f"{edit.file}: old text {where}: {edit.old.strip()[:80]!r}"
        texts[edit.file] = texts[edit.file].replace(edit.old, edit.new)
    for name, text in texts.items():
        with open(os.path.join(tree, name), "w", encoding="utf-8") as f:
            f.write(text)
        if name.endswith(".py"):
            try:
                py_compile.compile(os.path.join(tree, name), doraise=True)
            except py_compile.PyCompileError as e:
                return f"{name}: the patched file does not compile: {e.msg.strip()[:200]}"
    return None


def node_id(case: ET.Element, tree: str) -> str:
    """pytest's node id from a junit <testcase> (classname tests.test_x[.Class], name test_y[param])."""
    parts = case.get("classname", "").split(".")
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if os.path.isfile(os.path.join(tree, path)):
            return "::".join([path, *parts[i:], case.get("name", "")])
    return f"{case.get('classname')}::{case.get('name')}"


def run_tests(tree: str, tests: list[str], timeout: int, env: dict, fail_fast: bool) -> tuple[str, list[str], list[str], str]:
    """Run `tests` in `tree`; return (outcome, failed ids, passed ids, output tail)."""
    junit = os.path.join(tree, ".mutation-junit.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *tests]
    if fail_fast:
        cmd.insert(4, "-x")
    # Its own process group, so that a timeout also ends what the tests started (tensor-parallel launches).
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return "timeout", [], [], output[-2000:]
    tail = output[-3000:]
    failed, passed = [], []
    if os.path.exists(junit):
        for case in ET.parse(junit).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(node_id(case, tree))
            elif case.find("skipped") is None:
                passed.append(node_id(case, tree))
    if proc.returncode in (4, 5) or (not failed and not passed):  # usage error / nothing collected
        return "no tests", failed, passed, tail
    if proc.returncode not in (0, 1):  # interrupted or internal error: count as failures pytest reported
        failed = failed or [f"pytest exit code {proc.returncode}"]
    return ("failed" if failed else "passed"), failed, passed, tail


def check(mutation: Mutation, files: list[str], scratch: str, env: dict, timeout: int, fail_fast: bool,
          keep: bool) -> Result:
    tree = os.path.join(scratch, mutation.id)
    copy_repo(files, ROOT, tree)
    t0 = time.monotonic()
    try:
        problem = apply(mutation, tree)
        if problem is not None:
            return Result(mutation.id, "PATCH FAILED", problem)
        outcome, failed, passed, tail = run_tests(tree, list(mutation.tests), timeout, {**env, "PYTHONPATH": tree},
                                                  fail_fast)
        status = {"failed": "caught", "passed": "NOT CAUGHT", "no tests": "NO TESTS", "timeout": "timeout"}[outcome]
        detail = tail.strip().splitlines()[-1] if outcome in ("no tests", "timeout") and tail.strip() else ""
        return Result(mutation.id, status, detail, failed, passed, time.monotonic() - t0)
    finally:
        if not keep:
            shutil.rmtree(tree, ignore_errors=True)


def baseline(mutations: list[Mutation], files: list[str], scratch: str, env: dict, timeout: int) -> Result:
    """Every selected test on an unmodified copy: they must all pass for the verdicts to mean anything."""
    tree = os.path.join(scratch, "baseline")
    copy_repo(files, ROOT, tree)
    probe = subprocess.run([sys.executable, "-c", "import fdlite; print(fdlite.__file__)"], cwd=tree,
                           env={**env, "PYTHONPATH": tree}, capture_output=True, text=True)
    if not probe.stdout.strip().startswith(tree):
        sys.exit(f"mutation_check: the copy imports fdlite from {probe.stdout.strip() or probe.stderr.strip()}, "
                 f"not from {tree}; run it with a Python whose fdlite is not pinned elsewhere")
    tests = {t for m in mutations for t in m.tests}
    tests = sorted(t for t in tests if t.split("::")[0] == t or t.split("::")[0] not in tests)  # a file covers its tests
    t0 = time.monotonic()
    outcome, failed, passed, tail = run_tests(tree, tests, timeout * 3, {**env, "PYTHONPATH": tree}, False)
    shutil.rmtree(tree, ignore_errors=True)
    status = "passed" if outcome == "passed" else "BASELINE FAILED"
    return Result("baseline", status, "" if outcome == "passed" else tail.strip().splitlines()[-1], failed, passed,
                  time.monotonic() - t0)


# ---- reporting ---------------------------------------------------------------------------------


def short(test_id: str) -> str:
    return test_id.replace("tests/", "", 1)


def markdown(results: list[Result], base: Result | None, by_id: dict[str, Mutation], command: str,
             machine: str, date: str, total_s: float) -> str:
    lines = [
        "# Mutation check",
        "",
        "Known bugs planted one at a time in a scratch copy of the repository, each run against the tests that "
        "should catch it (`tools/mutation_check.py`, where every mutation is listed as data: file, old text, "
        "new text, tests). Repeat it after a refactor; a mutation whose old text moved is reported as "
        "PATCH FAILED and must be retargeted, not dropped.",
        "",
        f"- date: {date}",
        f"- machine: {machine}",
        f"- command: `{command}`",
        f"- commit: {git_describe()}",
        f"- wall time: {total_s / 60:.1f} min",
    ]
    if base is not None:
        lines.append(f"- baseline (every selected test on the unmodified copy): {base.status}, "
                     f"{len(base.passed)} passed, {len(base.failed)} failed ({base.seconds:.0f} s)")
        lines += [f"  - failed without any mutation: `{short(t)}`" for t in base.failed]
    caught = sum(r.ok for r in results)
    lines += ["", f"**{caught} of {len(results)} mutations caught.**", "",
              "| mutation | planted bug | first check (the first mutation run) | result | tests that failed / selected | time |",
              "|---|---|---|---|---|---|"]
    for r in results:
        m = by_id[r.id]
        failing = ", ".join(f"`{short(t)}`" for t in r.failed) or "none"
        count = f"{len(r.failed)}/{len(r.failed) + len(r.passed)}"
        result = f"**{r.status}**" if not r.ok else r.status
        if r.detail:
            result += f" ({r.detail})"
        lines.append(f"| `{r.id}` | {m.bug} | {m.first_check} | {result} | {count}: {failing} | {r.seconds:.0f} s |")
    return "\n".join(lines) + "\n"


def git_describe() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_description() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{os.cpu_count()}-core {model}, {platform.system()}, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", metavar="ID", help="run this mutation (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutation run (default 900)")
    parser.add_argument("--fail-fast", action="store_true", help="stop each run at its first failing test (faster; "
                        "the report then shows only the first test that caught each mutation)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on the unmodified copy")
    parser.add_argument("--report", metavar="MD", help="write a markdown report here")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--machine", help="machine description for the report (default: from /proc/cpuinfo)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies")
    args = parser.parse_args(argv)

    by_id = {m.id: m for m in MUTATIONS}
    if args.list:
        for m in MUTATIONS:
            print(f"{m.id:34} {m.bug}\n{'':34} tests: {', '.join(m.tests)}")
        return 0
    unknown = [i for i in args.only or [] if i not in by_id]
    if unknown:
        parser.error(f"unknown mutation id(s): {', '.join(unknown)} (see --list)")
    selected = [by_id[i] for i in args.only] if args.only else list(MUTATIONS)

    files = repo_files(ROOT)
    scratch = tempfile.mkdtemp(prefix="fdlite-mutation-")
    # One built-in model for every run (conftest would otherwise build it again in each).
    env = {**os.environ, "FDLITE_CACHE": os.path.join(scratch, "fdlite-cache")}
    env.pop("PYTHONPATH", None)
    t_start = time.monotonic()
    base = None
    try:
        if not args.no_baseline:
            print(f"baseline: {len({t for m in selected for t in m.tests})} test selections on an unmodified copy ...",
                  flush=True)
            base = baseline(selected, files, scratch, env, args.timeout)
            print(f"baseline: {base.status} ({len(base.passed)} passed, {len(base.failed)} failed, "
                  f"{base.seconds:.0f} s)", flush=True)
            for t in base.failed:
                print(f"  failed without any mutation: {t}", flush=True)
        results = []
        for m in selected:
            if sys.stdout.isatty():
                print(f"{m.id}: ...", end="", flush=True)
            r = check(m, files, scratch, env, args.timeout, args.fail_fast, args.keep)
            results.append(r)
            extra = f" by {short(r.failed[0])}" + (f" (+{len(r.failed) - 1} more)" if len(r.failed) > 1 else "") \
                if r.status == "caught" else (f": {r.detail}" if r.detail else "")
            print(f"\r{m.id}: {r.status}{extra} [{r.seconds:.0f} s]", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            print(f"scratch copies kept in {scratch}")
    total = time.monotonic() - t_start

    print()
    width = max(len(r.id) for r in results)
    for r in results:
        print(f"{r.id:{width}}  {r.status}")
    caught = sum(r.ok for r in results)
    print(f"\n{caught} of {len(results)} mutations caught" + (f"; baseline {base.status}" if base else ""))
    failed_patches = [r for r in results if r.status == "PATCH FAILED"]
    if failed_patches:
        print("\nPATCH FAILED: the code these mutations target has changed; retarget them in tools/mutation_check.py:")
        for r in failed_patches:
            print(f"  {r.id}: {r.detail}")

    command = "python tools/mutation_check.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    date = datetime.date.today().isoformat()
    machine = args.machine or machine_description()
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            f.write(markdown(results, base, by_id, command.strip(), machine, date, total))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"date": date, "machine": machine, "command": command.strip(), "commit": git_describe(),
                       "wall_time_s": round(total, 1),
                       "baseline": None if base is None else vars(base),
                       "mutations": [{**vars(r), "bug": by_id[r.id].bug, "first_check": by_id[r.id].first_check,
                                      "tests": list(by_id[r.id].tests)} for r in results]}, f, indent=2)
            f.write("\n")
    all_ok = caught == len(results) and (base is None or base.status == "passed")
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
