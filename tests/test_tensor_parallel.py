"""Tensor parallelism on CPU: 2 processes over gloo, started by `paddle.distributed.launch`, against tp=1.

One launch runs every multi-process case (tests/tp_worker.py), since starting Paddle twice costs more
than the cases; the tests below each check one case's files. The in-process tests cover the split
arithmetic, the per-rank weight slices and the errors, without a launch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys

import numpy as np
import paddle
import pytest
from safetensors import safe_open

from fdlite import LLM, SamplingParams
from fdlite.distributed.parallel_state import ParallelState, init_tensor_parallel
from fdlite.models import weight_loader
from fdlite.models.model_config import ModelConfig
from fdlite.models.registry import model_class
from fdlite.models.tp_partition import TPPartition
from fdlite.kernels.allreduce.capture import capture_custom_allreduce
from fdlite.distributed.communicator import Communicator, get_communicator, set_communicator
from hf_models import load_reference, reference_greedy, write_random_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5], [17, 3, 99, 250, 8, 41, 77], list(range(10, 27)), list(range(100, 140))]
GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=1234, max_tokens=6, ignore_eos=True)
LOGPROBS = dict(GREEDY, logprobs=3, prompt_logprobs=2)
OPTIONS = dict(max_num_seqs=4, block_size=16, max_model_len=128)
# qwen3 gets a vocabulary that 2 does not divide: rank 1's embedding rows end in padding.
MODELS = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"vocab_size": 509}),
    "llama": ("llama", {"attention_bias": True, "mlp_bias": True}),  # row-parallel layers with a bias
    "qwen2_kv1": ("qwen2", {"num_key_value_heads": 1}),  # fewer KV heads than ranks: replicated
    "ernie45": ("ernie45", {}),  # interleaved rope, biased row-parallel layers
    "ernie45_moe": ("ernie45_moe", {}),  # experts' and shared experts' widths split, two all-reduces per MoE layer
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": False}),
}
BLOCK_BYTES_PER_RANK = 2 * 2 * 16 * 1 * 16 * 4  # K and V, 2 layers, 16-token blocks, 1 KV head of 16, float32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_models")
    return {name: write_random_model(str(root / name), fam, **kw) for name, (fam, kw) in MODELS.items()}


def cases(models):
    out = []
    for name in MODELS:
        case = {"name": f"greedy_{name}", "model": models[name], "options": {**OPTIONS, "tensor_parallel_size": 2},
                "prompts": PROMPTS, "sampling": GREEDY}
        if name == "qwen2":  # each rank could hold a different number of blocks: both must use the fewest
            case["rank_options"] = {"0": {"kv_cache_memory_bytes": 100 * BLOCK_BYTES_PER_RANK},
                                    "1": {"kv_cache_memory_bytes": 40 * BLOCK_BYTES_PER_RANK}}
        if name == "llama":  # asked for on CPU: one log line, then gloo
            case["options"]["enable_custom_all_reduce"] = True
        out.append(case)
    tp2 = {**OPTIONS, "tensor_parallel_size": 2}
    out.append({"name": "sampled_qwen3", "model": models["qwen3"], "options": tp2, "prompts": PROMPTS,
                "sampling": SAMPLED})
    out.append({"name": "logprobs_qwen3", "model": models["qwen3"], "options": tp2, "prompts": PROMPTS,
                "sampling": LOGPROBS})
    out.append({"name": "sot_qwen3", "model": models["qwen3"], "prompts": PROMPTS, "sampling": GREEDY,
                "options": {**tp2, "graph_optimization_config": {"graph_opt_level": 1}}})
    out.append({"name": "cudagraph_qwen2", "model": models["qwen2"], "prompts": PROMPTS, "sampling": GREEDY,
                "options": {**tp2, "graph_optimization_config": {"use_cudagraph": True}}})
    out.append({"name": "mismatch", "model": models["llama"], "options": tp2, "prompts": PROMPTS,
                "rank_prompts": {"1": PROMPTS[:2]}, "sampling": GREEDY})
    return out


def launch(args: list[str], cwd, log_dir, timeout: int = 900, env_extra: dict | None = None) -> str:
    """Run `args` (a launcher command line) to the end; fail the test with the logs if it fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "PADDLE_LOG_DIR": str(log_dir), **(env_extra or {})}
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the 2 workers it started
        output, _ = proc.communicate()
        pytest.fail("tensor-parallel launch timed out:\n" + output[-3000:])
    if proc.returncode != 0:
        logs = "".join(f"--- workerlog.{r}\n" + (log_dir / f"workerlog.{r}").read_text()[-3000:] for r in (0, 1)
                       if (log_dir / f"workerlog.{r}").exists())
        pytest.fail(f"launch failed ({proc.returncode}):\n{output[-2000:]}\n{logs}")
    return output


def launcher(*script_and_args: str) -> list[str]:
    return [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", *script_and_args]


@pytest.fixture(scope="module")
def tp2(models, tmp_path_factory):
    """Run every case with 2 processes; return name -> [rank 0 result, rank 1 result]."""
    work = tmp_path_factory.mktemp("tp_run")
    spec = work / "spec.json"
    spec.write_text(json.dumps(cases(models)))
    # The eager stand-in for CUDA graphs (graph/eager_replay.py) runs the capture path on CPU.
    launch(launcher(os.path.join(ROOT, "tests", "tp_worker.py"), str(spec), str(work)), work, work / "log",
           env_extra={"FDLITE_CUDAGRAPH_BACKEND": "eager"})
    return {case["name"]: [json.loads((work / f"{case['name']}.rank{r}.json").read_text()) for r in (0, 1)]
            for case in cases(models)}


def tp1_tokens(model: str, sampling: dict) -> list[list[int]]:
    llm = LLM(model, skip_tokenizer_init=True, **OPTIONS)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**sampling), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# ---- two processes ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_greedy_is_token_identical_to_tp1(models, tp2, name):
    rank0, rank1 = tp2[f"greedy_{name}"]
    assert rank0["is_driver"] and not rank1["is_driver"]
    assert rank0["backend"] == rank1["backend"] == "gloo"
    assert rank0["tokens"] == tp1_tokens(models[name], GREEDY)
    # And both equal transformers: these variants (biased row-parallel layers, an odd vocabulary, one
    # KV head) are not in the single-process parity tests, so tp=1 alone is no oracle for them.
    assert rank0["tokens"] == reference_greedy(load_reference(models[name]), PROMPTS, GREEDY["max_tokens"])
    assert all(len(t) == GREEDY["max_tokens"] for t in rank0["tokens"])
    # Rank 0 alone returns outputs; rank 1 did the same work.
    assert rank0["num_outputs"] == len(PROMPTS) and rank1["num_outputs"] == 0 and rank1["tokens"] == []


def test_kv_heads_are_split_or_replicated(tp2):
    # (KV heads held, first checkpoint KV head) per rank.
    split = [(r["kv_heads_here"], r["kv_head_start"]) for r in tp2["greedy_qwen2"]]
    replicated = [(r["kv_heads_here"], r["kv_head_start"]) for r in tp2["greedy_qwen2_kv1"]]
    assert split == [(1, 0), (1, 1)]  # 2 KV heads over 2 ranks: one each
    assert replicated == [(1, 0), (1, 0)]  # 1 KV head: a copy on each


def test_kv_block_count_is_the_minimum_over_ranks(tp2):
    assert [r["num_blocks"] for r in tp2["greedy_qwen2"]] == [40, 40]


def test_custom_all_reduce_on_cpu_logs_once_and_falls_back(tp2):
    for r in tp2["greedy_llama"]:
        assert r["backend"] == "gloo"
        assert len(r["custom_all_reduce_lines"]) == 1
        line = r["custom_all_reduce_lines"][0]
        assert "GPU-only" in line and line.endswith("using gloo")


def test_tp2_seeded_sampling_matches_tp1(models, tp2):
    rank0, rank1 = tp2["sampled_qwen3"]
    assert rank0["tokens"] == tp1_tokens(models["qwen3"], SAMPLED)
    assert rank1["num_outputs"] == 0


def test_tp2_logprobs_and_prompt_logprobs_match_tp1(models, tp2):
    # The prompt positions' logits are gathered over the vocabulary shards on every rank; rank 0 reports them.
    rank0, rank1 = tp2["logprobs_qwen3"]
    llm = LLM(models["qwen3"], skip_tokenizer_init=True, **OPTIONS)
    want = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**LOGPROBS), use_tqdm=False)
    assert rank0["tokens"] == [o.outputs[0].token_ids for o in want]
    for got, w in ((rank0["prompt_logprobs"], [o.prompt_logprobs for o in want]),
                   (rank0["logprobs"], [o.outputs[0].logprobs for o in want])):
        assert len(got) == len(PROMPTS)
        for g_seq, w_seq in zip(got, w):
            assert len(g_seq) == len(w_seq)
            for g, d in zip(g_seq, w_seq):
                if d is None:
                    assert g is None
                    continue
                assert [t for t, _ in g] == sorted(d)
                np.testing.assert_allclose([lp for _, lp in g], [d[t].logprob for t in sorted(d)], atol=1e-4)
    assert [len(p) for p in rank0["prompt_logprobs"]] == [len(p) for p in PROMPTS]
    assert rank1["num_outputs"] == 0 and rank1["prompt_logprobs"] == []


def test_tp2_with_sot_static_graph(models, tp2):
    rank0, rank1 = tp2["sot_qwen3"]
    assert rank0["sot_translations"] > 0
    # The all-reduce is a graph break SOT does not guard on: the run reuses the startup translations...
    assert rank0["sot_translations_during_run"] <= 2 and rank1["sot_translations_during_run"] <= 2
    # ... and runs them: every step on both ranks called the translated function.
    for r in (rank0, rank1):
        assert r["sot_calls"] == r["num_steps"] > 0
    assert rank0["tokens"] == tp1_tokens(models["qwen3"], GREEDY)


def test_tp2_with_cuda_graph_capture_path(models, tp2):
    for r in tp2["cudagraph_qwen2"]:
        assert r["cudagraph_sizes"] == [1, 2, 4]
        assert r["cudagraph_replays"] > 0
        # The row-parallel all-reduces ran inside capture_custom_allreduce(), as a custom all-reduce needs.
        assert r["all_reduces"]["capturing"] > 0
    assert tp2["cudagraph_qwen2"][0]["tokens"] == tp1_tokens(models["qwen2"], GREEDY)


def test_ranks_given_different_requests_all_raise(tp2):
    for r in tp2["mismatch"]:
        assert "different requests" in r["error"]


def test_batch_job_under_the_launcher_writes_tp1_results_once(tmp_path):
    (tmp_path / "prompts.txt").write_text("The capital of France is\nhello\nWrite a haiku about the sea:\n")
    (tmp_path / "job.yaml").write_text(
        "max_num_seqs: 4\nmax_model_len: 128\nblock_size: 16\ntensor_parallel_size: 2\n"
        "sampling: {temperature: 0, max_tokens: 5, ignore_eos: true}\n"
        "input: prompts.txt\noutput: out/results.jsonl\n")
    (tmp_path / "fdlite_cli.py").write_text("from fdlite.cli import main\nraise SystemExit(main())\n")
    launch(launcher(str(tmp_path / "fdlite_cli.py"), "run", str(tmp_path / "job.yaml"), "--no-progress"),
           tmp_path, tmp_path / "log")
    from fdlite import cli

    assert cli.main(["run", str(tmp_path / "job.yaml"), "--no-progress", "--tensor-parallel-size", "1",
                     "--output", str(tmp_path / "tp1.jsonl")]) == 0

    def tokens(path):
        rows = [json.loads(line) for line in open(path)]
        assert len(rows) == len({r["id"] for r in rows})  # each request written once
        return {r["id"]: r["token_ids"] for r in rows}

    got = tokens(tmp_path / "out" / "results.jsonl")
    assert sorted(got) == [1, 2, 3]
    assert got == tokens(tmp_path / "tp1.jsonl")


def readme_section() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("## Several GPUs: tensor parallelism")
    return text[start:text.index("\n## ", start + 1)]


def test_readme_launch_commands(tmp_path):
    commands = [line for block in re.findall(r"```bash\n(.*?)```", readme_section(), flags=re.S)
                for line in block.splitlines() if line.startswith("python -m paddle.distributed.launch")]
    assert any("--gpus 0,1 " in c and c.endswith("--tensor-parallel-size 2") for c in commands)
    assert any("--gpus 0,1,2,3 " in c and c.endswith("--tensor-parallel-size 4") for c in commands)
    cpu = next(c for c in commands if "--nproc_per_node 2" in c)
    argv = shlex.split(cpu)
    argv[0] = sys.executable
    launch(argv, ROOT, tmp_path / "log")  # as written, from the repository root
    rank0 = (tmp_path / "log" / "workerlog.0").read_text()
    rank1 = (tmp_path / "log" / "workerlog.1").read_text()
    assert rank0.count("Generated:") == 4 and "startup:" in rank0
    assert "Generated:" not in rank1 and "tensor parallel: rank 1 of 2 (gloo)" in rank1


# ---- one process ------------------------------------------------------------------------------


def test_partition_arithmetic():
    cfg = ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 509, "hidden_size": 64,
                                 "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 8,
                                 "num_key_value_heads": 2})
    parts = [TPPartition.of(cfg, r, 4) for r in range(4)]
    assert [p.num_heads for p in parts] == [2] * 4
    # 2 KV heads over 4 ranks: ranks 0,1 hold head 0 and ranks 2,3 head 1, the head their queries read.
    assert [(p.num_kv_heads, p.kv_head_start) for p in parts] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    for p in parts:
        first_query_head = p.rank * p.num_heads
        assert p.kv_head_start == first_query_head // (cfg.num_attention_heads // cfg.num_key_value_heads)
    assert [p.vocab_range for p in parts] == [(0, 128), (128, 256), (256, 384), (384, 509)]
    assert [p.intermediate_range for p in parts] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    two = [TPPartition.of(cfg, r, 2) for r in range(2)]
    assert [(p.num_kv_heads, p.kv_range) for p in two] == [(1, (0, 8)), (1, (8, 16))]


@pytest.mark.parametrize("overrides, message", [
    ({"num_attention_heads": 6, "num_key_value_heads": 6}, "num_attention_heads (6) is not divisible"),
    ({"num_attention_heads": 12, "num_key_value_heads": 6}, "num_key_value_heads (6) is not divisible"),
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, "is not a multiple of num_key_value_heads (3)"),
    ({"intermediate_size": 102}, "intermediate_size (102) is not divisible"),
])
def test_partition_refuses_uneven_splits(overrides, message):
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 96, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8, **overrides}
    with pytest.raises(ValueError, match=re.escape(message)):
        TPPartition.of(ModelConfig.from_dict(raw), 0, 4)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama", "qwen2_kv1"])
def test_each_rank_loads_exactly_its_slices(models, monkeypatch, name):
    path = models[name]
    cfg = ModelConfig.from_dir(path)
    with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
        full = {k: f.get_tensor(k) for k in f.keys()}
    read_whole = []
    real_read = weight_loader.SafetensorsFile.read

    def spy(self, name, axis=None, start=0, stop=0):
        if axis is None:
            read_whole.append(name)
        return real_read(self, name, axis, start, stop)

    monkeypatch.setattr(weight_loader.SafetensorsFile, "read", spy)
    for rank in (0, 1):
        tp = TPPartition.of(cfg, rank, 2)
        model = model_class(cfg.architecture)(cfg, "float32", 128, tp)
        read_whole.clear()
        weight_loader.load_weights(model, path)
        p = {k: v.numpy() for k, v in model.named_parameters()}
        (q0, q1), (k0, k1), (i0, i1), (v0, v1) = tp.q_range, tp.kv_range, tp.intermediate_range, tp.vocab_range
        a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
        want_qkv = np.concatenate([full[a + "q_proj.weight"][q0:q1], full[a + "k_proj.weight"][k0:k1],
                                   full[a + "v_proj.weight"][k0:k1]]).T
        np.testing.assert_array_equal(p[a + "qkv_proj.weight"], want_qkv)
        if a + "q_proj.bias" in full:
            np.testing.assert_array_equal(p[a + "qkv_proj.bias"], np.concatenate(
                [full[a + "q_proj.bias"][q0:q1], full[a + "k_proj.bias"][k0:k1], full[a + "v_proj.bias"][k0:k1]]))
        if m + "gate_proj.bias" in full:  # column-parallel biases are sliced, row-parallel ones whole
            np.testing.assert_array_equal(p[m + "gate_up_proj.bias"], np.concatenate(
                [full[m + "gate_proj.bias"][i0:i1], full[m + "up_proj.bias"][i0:i1]]))
            np.testing.assert_array_equal(p[m + "down_proj.bias"], full[m + "down_proj.bias"])
            np.testing.assert_array_equal(p[a + "o_proj.bias"], full[a + "o_proj.bias"])
        np.testing.assert_array_equal(p[a + "o_proj.weight"], full[a + "o_proj.weight"][:, q0:q1].T)
        np.testing.assert_array_equal(p[m + "gate_up_proj.weight"], np.concatenate(
            [full[m + "gate_proj.weight"][i0:i1], full[m + "up_proj.weight"][i0:i1]]).T)
        np.testing.assert_array_equal(p[m + "down_proj.weight"], full[m + "down_proj.weight"][:, i0:i1].T)
        emb = p["model.embed_tokens.weight"]
        np.testing.assert_array_equal(emb[: v1 - v0], full["model.embed_tokens.weight"][v0:v1])
        assert not emb[v1 - v0:].any()  # padding rows past the vocabulary
        if "lm_head.weight" in full and not cfg.tie_word_embeddings:
            np.testing.assert_array_equal(p["lm_head.weight"][:, : v1 - v0], full["lm_head.weight"][v0:v1].T)
        # Split tensors were read as slices, never whole. Read whole: norms, and a single KV head that
        # both ranks hold a copy of.
        whole_ok = ("norm", "o_proj.bias", "down_proj.bias") + (("k_proj", "v_proj") if cfg.num_key_value_heads == 1 else ())
        assert read_whole and all(any(w in n for w in whole_ok) for n in read_whole), read_whole


def test_tp_without_the_launcher_says_how_to_launch(models):
    with pytest.raises(ValueError, match="paddle.distributed.launch --gpus 0,1"):
        LLM(models["qwen3"], skip_tokenizer_init=True, tensor_parallel_size=2, **OPTIONS)


def test_launch_size_must_match_tensor_parallel_size(monkeypatch):
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "4")
    with pytest.raises(ValueError, match="started 4 processes but tensor_parallel_size=2"):
        init_tensor_parallel(2, "cpu")


def test_custom_all_reduce_on_one_cpu_process_logs_one_line(models, caplog):
    with caplog.at_level(logging.INFO, logger="fdlite"):
        llm = LLM(models["qwen3"], skip_tokenizer_init=True, enable_custom_all_reduce=True, **OPTIONS)
    lines = [r.getMessage() for r in caplog.records if "custom all-reduce" in r.getMessage()]
    assert len(lines) == 1 and "GPU-only" in lines[0]
    assert llm.runner.comm.custom is None


def test_custom_all_reduce_is_wired_in_when_available(monkeypatch):
    """With the library present (a stand-in here: it needs a GPU), small messages go to it, large ones to NCCL,
    and CUDA-graph capture runs inside its capture() context."""
    calls = []

    class FakeCustomAllReduce:
        max_size = 64

        def __init__(self, rank, world_size, exchange):
            calls.append(("start", rank, world_size))

        @staticmethod
        def is_available():
            return True

        def should_use(self, nbytes):
            return nbytes <= self.max_size

        def begin_capture(self):
            calls.append("capture begins")

        def end_capture(self, register=True):
            calls.append(f"capture ends: register={register}")
            return 0

        def all_reduce(self, inp, out, stream=None):
            calls.append(("custom", inp.shape))
            paddle.assign(inp * 2, output=out)
            return out

    from fdlite.kernels.allreduce import custom_all_reduce

    # Patch the class on the real module: other tests import it, so a sys.modules stand-in would be bypassed.
    monkeypatch.setattr(custom_all_reduce, "CustomAllReduce", FakeCustomAllReduce)
    from fdlite.kernels import gpu as gpu_ops

    monkeypatch.setattr(gpu_ops, "current_stream_handle", lambda: 0)
    monkeypatch.setattr(paddle.distributed.stream, "all_reduce",
                        lambda x, use_calc_stream: calls.append(("nccl", x.shape, use_calc_stream)))
    saved = get_communicator()
    comm = Communicator(ParallelState(0, 1, "nccl"), "gpu", enable_custom_all_reduce=True)
    set_communicator(comm)
    try:
        assert comm.backend == "custom+nccl"
        with capture_custom_allreduce():
            small = comm.all_reduce(paddle.ones([2, 4]))  # 32 bytes
        comm.all_reduce(paddle.ones([4, 8]))  # 128 bytes: above the custom buffer
        np.testing.assert_array_equal(small.numpy(), np.full([2, 4], 2.0))
        assert calls == [("start", 0, 1), "capture begins", ("custom", [2, 4]), "capture ends: register=True",
                         ("nccl", [4, 8], True)]
    finally:
        set_communicator(saved)  # the next communicator takes the stand-in out of graph capture
    calls.clear()
    with capture_custom_allreduce():
        pass
    assert calls == []
