"""`fdlite run` end to end on CPU with the built-in model: outputs, resume after a SIGKILL mid-write, errors, exit codes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fdlite import LLM, SamplingParams
from fdlite import cli
from fdlite.jobs import job_runner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = {"max_num_seqs": 4, "max_model_len": 256}
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


def fdlite_env(**extra):
    env = dict(os.environ)  # FDLITE_CACHE comes from conftest, so every process shares one default model
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def fdlite_proc(*args, **kw):
    return subprocess.run([sys.executable, "-m", "fdlite", *args], env=fdlite_env(), capture_output=True,
                          text=True, timeout=600, **kw)


def write_job(tmp_path, records, name="job", engine=None, sampling=None, input_name=None, raw_lines=None):
    """A job file + JSONL input in tmp_path; returns (job path, output path)."""
    input_name = input_name or f"{name}.jsonl"
    text = raw_lines if raw_lines is not None else "".join(json.dumps(r) + "\n" for r in records)
    (tmp_path / input_name).write_text(text)
    job = {**(engine or ENGINE), "sampling": sampling or GREEDY, "input": input_name, "output": f"out/{name}.jsonl"}
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(job))  # JSON is YAML
    return str(path), str(tmp_path / "out" / f"{name}.jsonl")


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def run(*args):
    return cli.main(["run", *args])


PROMPTS = [f"Prompt number {i}: tell me about topic {i * 7}" for i in range(12)]


def test_job_end_to_end_matches_the_python_api(tmp_path, capsys):
    records = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    records[3]["sampling"] = {"max_tokens": 3}
    records.append({"id": "chat", "messages": [{"role": "user", "content": "Name three prime numbers."}]})
    job, out = write_job(tmp_path, records)
    assert run(job, "--no-progress") == 0

    rows = read_jsonl(out)
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in records)
    llm = LLM(**ENGINE)
    params = [SamplingParams(**{**GREEDY, **r.get("sampling", {})}) for r in records[:-1]]
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    expected.append(llm.chat(records[-1]["messages"], SamplingParams(**GREEDY), use_tqdm=False)[0])
    by_id = {r["id"]: r for r in rows}
    for rec, exp in zip(records, expected):
        row = by_id[rec["id"]]
        assert row["text"] == exp.outputs[0].text and row["token_ids"] == exp.outputs[0].token_ids
        assert row["prompt_tokens"] == len(exp.prompt_token_ids)
        assert row["output_tokens"] == (3 if rec["id"] == "p3" else 6)
        assert row["finish_reason"] == "length"
        assert 0 <= row["ttft_s"] <= row["latency_s"]
        assert row["finished_at"].endswith("+00:00")

    summary = json.loads((tmp_path / "out" / "job.summary.json").read_text())
    assert summary["requests"] == {"lines": 13, "done": 13, "resumed": 0, "this_run": 13, "errors": 0}
    assert summary["output_tokens"] == sum(r["output_tokens"] for r in rows)
    assert summary["input_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert summary["latency_s"]["p50"] <= summary["latency_s"]["p99"] and summary["output_tokens_per_s"] > 0
    assert summary["exit_code"] == 0
    cache = summary["prefix_cache"]  # the engine's counters over the run (prefix caching is on by default)
    assert cache["queried_tokens"] >= summary["input_tokens"] and 0 <= cache["hit_tokens"] <= cache["queried_tokens"]
    assert summary["prefill_tokens_computed"] == cache["queried_tokens"] - cache["hit_tokens"]
    assert not (tmp_path / "out" / "job.errors.jsonl").exists()
    printed = capsys.readouterr().out
    assert "fdlite run: 13/13 requests done (0 resumed, 13 this run), 0 errors" in printed
    assert "output tokens/s" in printed and "latency p50" in printed


# Runs `fdlite run` with os.write wrapped: after LINES whole lines of OUT it writes the next line all but its
# newline, touches MARKER and sleeps, so the test's SIGKILL lands between the two parts of a write. (A line is
# one os.write; the kernel may still cut it anywhere, and a cut right before the newline is the case that looks
# like a whole record.)
KILL_MID_WRITE = """
import os, sys, time
out, marker, lines = os.path.realpath(sys.argv[1]), sys.argv[2], int(sys.argv[3])
real_write, written = os.write, [0]

def write(fd, data):
    try:
        ours = os.path.realpath(f"/proc/self/fd/{fd}") == out
    except OSError:
        ours = False
    if ours and written[0] == lines:
        real_write(fd, bytes(data)[:-1])
        open(marker, "w").close()
        time.sleep(600)
    written[0] += ours
    return real_write(fd, data)

os.write = write
from fdlite.cli import main
raise SystemExit(main(sys.argv[4:]))
"""


def test_sigkill_mid_write_then_rerun_gives_each_id_once_and_identical_output(tmp_path, capsys):
    records = [{"id": f"r{i:02d}", "prompt": f"{p} (again {i})"} for i, p in enumerate(PROMPTS + PROMPTS)]
    engine = {"max_num_seqs": 2, "max_model_len": 256}
    sampling = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    full_job, full_out = write_job(tmp_path, records, name="full", engine=engine, sampling=sampling)
    assert run(full_job, "--no-progress") == 0
    job, out = write_job(tmp_path, records, name="killed", engine=engine, sampling=sampling)

    marker, whole = tmp_path / "mid-write", 4
    (tmp_path / "kill_mid_write.py").write_text(KILL_MID_WRITE)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "kill_mid_write.py"), out, str(marker), str(whole),
                             "run", job, "--no-progress"], env=fdlite_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not marker.exists():
            time.sleep(0.01)
        assert marker.exists(), f"the job never reached its fifth line (exit code {proc.poll()})"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with open(out, "rb") as f:
        data = f.read()
    *kept, torn = data.split(b"\n")
    assert len(kept) == whole
    # The torn line is a whole record but for its newline: it must be redone all the same.
    assert json.loads(torn)["id"].startswith("r")
    partial = [json.loads(line) for line in kept]
    assert not (tmp_path / "out" / "killed.summary.json").exists()

    assert run(job) == 0  # with the progress bar: it starts at the resumed count
    rerun = capsys.readouterr()
    assert f"cut away a torn last line ({len(torn)} bytes) left by an interrupted run" in rerun.err
    assert f"{whole}/{len(records)}" in rerun.err
    assert f"({whole} resumed, {len(records) - whole} this run)" in rerun.out

    rows, full = read_jsonl(out), read_jsonl(full_out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == len(records)  # every id exactly once, the torn one included
    assert rows[:whole] == partial  # what was on disk before the kill is kept as it was
    keep = ("text", "token_ids", "finish_reason", "prompt_tokens", "output_tokens")
    assert {r["id"]: [r[k] for k in keep] for r in rows} == {r["id"]: [r[k] for k in keep] for r in full}


def test_torn_last_line_is_repaired_and_redone_once(tmp_path, capsys):
    records = [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS[:6])]
    job, out = write_job(tmp_path, records)
    assert run(job, "--no-progress") == 0
    before = read_jsonl(out)
    with open(out, "rb") as f:
        data = f.read()
    with open(out, "wb") as f:
        f.write(data[:-25])  # the crash cut the last line short
    assert run(job, "--no-progress") == 0
    err = capsys.readouterr().err
    torn = len(data.splitlines(keepends=True)[-1]) - 25
    assert f"cut away a torn last line ({torn} bytes) left by an interrupted run" in err
    after = read_jsonl(out)
    assert [r["id"] for r in after] == [r["id"] for r in before]
    assert after[-1]["token_ids"] == before[-1]["token_ids"] and after[-1]["text"] == before[-1]["text"]


def test_bad_lines_go_to_the_errors_file_and_the_job_goes_on(tmp_path, capsys):
    lines = [
        json.dumps({"id": "ok1", "prompt": "Hello there"}),
        '{"id": "broken", "prompt": "no closing brace"',
        json.dumps({"id": "noprompt"}),
        json.dumps({"id": "long", "prompt": "word " * 300}),
        json.dumps({"id": "override", "prompt": "x", "sampling": {"top_p": 1.5}}),
        json.dumps({"id": "ok1", "prompt": "same id again"}),
        json.dumps({"id": "ok2", "prompt": "Goodbye", "sampling": {"max_tokens": 2}}),
    ]
    job, out = write_job(tmp_path, None, raw_lines="\n".join(lines) + "\n")
    errors_path = tmp_path / "out" / "job.errors.jsonl"
    expected_errors = [
        {"line": 2, "id": None, "error": "invalid JSON: Expecting ',' delimiter (column 46)"},
        {"line": 3, "id": "noprompt", "error": "missing 'prompt' (or 'messages')"},
        {"line": 5, "id": "override", "error": "sampling: SamplingParams.top_p must be <= 1, got 1.5"},
        {"line": 6, "id": "ok1", "error": "duplicate id 'ok1' (first used on line 1)"},
        {"line": 4, "id": "long", "error": "prompt has 301 tokens; max_model_len=256 leaves no room for output"},
    ]
    for attempt in range(2):  # the rerun finds the same problems once, and redoes nothing
        assert run(job, "--no-progress") == 1
        captured = capsys.readouterr()
        assert read_jsonl(errors_path) == expected_errors
        rows = read_jsonl(out)
        assert [(r["id"], r["output_tokens"]) for r in rows] in ([("ok1", 6), ("ok2", 2)], [("ok2", 2), ("ok1", 6)])
        assert "job.jsonl:2: invalid JSON: Expecting ',' delimiter (column 46)" in captured.err
        assert "job.jsonl:4: prompt has 301 tokens; max_model_len=256 leaves no room for output" in captured.err
        done = "2/7 requests done (0 resumed, 2 this run)" if attempt == 0 else "2/7 requests done (2 resumed, 0 this run)"
        assert f"fdlite run: {done}, 5 errors" in captured.out
        assert f"errors: {errors_path}" in captured.out
        summary = json.loads((tmp_path / "out" / "job.summary.json").read_text())
        assert summary["requests"]["errors"] == 5 and summary["exit_code"] == 1


def test_csv_and_text_inputs(tmp_path):
    (tmp_path / "in.csv").write_text('id,prompt,sampling\na,"Hello, world",\nb,Second,"{""max_tokens"": 2}"\n')
    (tmp_path / "in.txt").write_text("first line prompt\n\nsecond line prompt\n")
    for name in ("in.csv", "in.txt"):
        job = {**ENGINE, "sampling": GREEDY, "input": name, "output": f"{name}.out.jsonl"}
        (tmp_path / f"{name}.yaml").write_text(json.dumps(job))
        assert run(str(tmp_path / f"{name}.yaml"), "--no-progress") == 0
    csv_rows = {r["id"]: r for r in read_jsonl(tmp_path / "in.csv.out.jsonl")}
    assert {k: r["output_tokens"] for k, r in csv_rows.items()} == {"a": 6, "b": 2}
    txt_rows = {r["id"]: r for r in read_jsonl(tmp_path / "in.txt.out.jsonl")}
    assert set(txt_rows) == {1, 3}  # no ids in a text file: the line number is the id


def test_command_line_flags_override_the_job_file(tmp_path):
    job, out = write_job(tmp_path, [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS[:3])])
    other = tmp_path / "elsewhere.jsonl"
    assert run(job, "--no-progress", "--max-tokens", "2", "--max-num-seqs", "1", "--output", str(other)) == 0
    assert not os.path.exists(out)
    assert [r["output_tokens"] for r in read_jsonl(other)] == [2, 2, 2]


def test_shipped_cpu_example_runs(tmp_path):
    out = tmp_path / "example.jsonl"
    assert run(os.path.join(REPO, "configs", "cpu_default_model.yaml"), "--no-progress", "--output", str(out)) == 0
    with open(os.path.join(REPO, "configs", "prompts.jsonl")) as f:
        ids = [json.loads(line)["id"] for line in f if line.strip()]
    assert sorted(r["id"] for r in read_jsonl(out)) == sorted(ids)


def test_only_rank_zero_writes(tmp_path, monkeypatch, capsys):
    job, out = write_job(tmp_path, [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS[:3])]
                         + [{"id": "bad"}])
    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    assert run(job) == 1  # rank 1 runs the same requests, finds the same bad line...
    assert not os.path.exists(tmp_path / "out")  # ...and writes no output, errors or summary file
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    assert run(job, "--no-progress") == 1
    assert len(read_jsonl(out)) == 3


def test_bad_job_stops_before_the_model_loads(tmp_path, monkeypatch, capsys):
    def no_model(*a, **k):
        raise AssertionError("the model must not load for a bad job")

    monkeypatch.setattr(job_runner, "LLM", no_model)
    job, out = write_job(tmp_path, [{"prompt": "hi"}])
    text = open(job).read().replace('"max_num_seqs"', '"max_num_seq"')
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert run(str(bad)) == 2
    assert capsys.readouterr().err == (
        f"fdlite: error: {bad}:1: max_num_seq: unknown option 'max_num_seq'; did you mean 'max_num_seqs'?\n")
    assert run(job, "--max-num-seq", "3") == 2
    assert capsys.readouterr().err == "fdlite: error: unknown option '--max-num-seq'; did you mean '--max-num-seqs'?\n"
    assert run(job, "--temperature", "-1") == 2
    assert capsys.readouterr().err == (
        "fdlite: error: command line: --temperature: SamplingParams.temperature must be >= 0, got -1.0\n")
    os.makedirs(os.path.dirname(out))
    with open(out, "w") as f:
        f.write('{"id": 1}\nnot json\n{"id": 2}\n')  # damage no crash can cause
    assert run(job) == 2
    assert capsys.readouterr().err.startswith(f"fdlite: error: {out}:2: not valid JSON; a crash can only tear")


def test_console_entry_point_exit_code_and_message(tmp_path):
    job, _ = write_job(tmp_path, [{"prompt": "hi"}])
    bad = tmp_path / "bad.yaml"
    bad.write_text("input: job.jsonl\noutput: o.jsonl\nsampling:\n  temperature: 0\n  max_tokens: 0\n")
    p = fdlite_proc("run", str(bad))
    assert p.returncode == 2
    assert p.stderr.splitlines()[-1] == (
        f"fdlite: error: {bad}:5: sampling.max_tokens: SamplingParams.max_tokens must be >= 1, got 0")


def test_help_lists_every_option_with_help_and_default():
    from fdlite.jobs.job_config import JOB_KEYS
    from fdlite.jobs.options import ENGINE_OPTIONS, SAMPLING_OPTIONS

    p = fdlite_proc("--help")
    assert p.returncode == 0
    flat = " ".join(p.stdout.split())
    for spec in ENGINE_OPTIONS + SAMPLING_OPTIONS:
        assert " ".join(cli._help(spec).replace("%%", "%").split()) in flat, spec.name
        assert spec.flag in flat
    assert "(default: 8)" in flat and "(default: 0.9)" in flat  # max_num_seqs, gpu_memory_utilization
    for key, help_text in JOB_KEYS.items():
        assert " ".join(help_text.split()) in flat, key


def test_generate_single_shot():
    p = fdlite_proc("generate", "--max-model-len", "256", "--temperature", "0", "--max-tokens", "5", "--ignore-eos",
                    "The capital of France is")
    assert p.returncode == 0, p.stderr
    expected = LLM(max_model_len=256).generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert p.stdout == expected[0].outputs[0].text + "\n"
