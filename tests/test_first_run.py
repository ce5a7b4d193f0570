"""What a new user meets on a first run: the built-in model says its text is gibberish, the command's log is
a few plain lines, `--help` does not wait for Paddle, a bad or finished job stops before the model loads,
`run-batch` names itself, a misspelt sampling keyword gets a "did you mean", and the CPU attention op's
build is its own startup phase."""

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from fdlite import LLM, SamplingParams, cli
from fdlite.default_model import default_model_path
from fdlite.jobs import job_runner
from test_jobs_run import ENGINE, fdlite_env, read_jsonl, write_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def no_model(*args, **kwargs):
    raise AssertionError("the model must not load")


def records(n):
    return [{"id": f"q{i}", "prompt": f"Question {i}: what is {i} + {i}?"} for i in range(n)]


# ---- 1: the built-in model's random weights ----------------------------------------------------------------


def test_built_in_model_says_once_that_its_text_is_gibberish(caplog):
    with caplog.at_level(logging.INFO, logger="fdlite"):
        LLM(max_model_len=256)
    notes = [r for r in caplog.records if "random weights" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO
    assert "gibberish" in notes[0].getMessage() and "--model" in notes[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fdlite"):
        LLM(default_model_path(), max_model_len=256)  # the same weights, named: the user chose them
    assert not [r for r in caplog.records if "random weights" in r.getMessage()]
    assert any(r.getMessage() == f"model: {default_model_path()}" for r in caplog.records)


# ---- 2: the command's log ----------------------------------------------------------------------------------


def test_generate_logs_a_few_plain_lines(capsys):
    log = logging.getLogger("fdlite")
    before = (log.level, log.propagate, list(log.handlers))
    assert cli.main(["generate", "--max-model-len", "256", "--max-tokens", "3", "Hello"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert (log.level, log.propagate, list(log.handlers)) == before  # main leaves the logger as it found it
    assert all(line.startswith("fdlite: ") for line in err), err
    assert not [line for line in err if ".py:" in line]
    text = "\n".join(err)
    assert "fdlite: device: cpu (float32)" in text
    kv = [line for line in err if line.startswith("fdlite: KV cache: ")]
    assert len(kv) == 1
    blocks, block_size, tokens = (int(w) for w in kv[0].replace("(", " ").split() if w.isdigit())
    assert blocks * block_size == tokens
    assert err[-1].startswith("fdlite: ready in ")
    for jargon in ("Reset block num", "startup phase", "generate: "):
        assert jargon not in text


def test_verbose_shows_every_step_with_its_source(capsys):
    assert cli.main(["generate", "-v", "--max-model-len", "256", "--max-tokens", "3", "Hello"]) == 0
    err = capsys.readouterr().err
    assert "startup phase compile_ops" in err and "startup phase load_weights" in err
    assert "llm.py:" in err and "DEBUG" in err
    assert "generate: 1 request in " in err and " 1 requests" not in err  # singular


def test_the_generate_line_never_lands_inside_a_progress_bar(caplog):
    """LLM.generate logs its summary at INFO after its own bar has closed; under a caller's bar (`fdlite run`,
    use_tqdm=False) it is DEBUG."""
    from tqdm import tqdm

    open_bars = []

    class Probe(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("generate: "):
                open_bars.append((record.levelno, len(tqdm._instances)))

    llm = LLM(**ENGINE)
    probe = Probe()
    logging.getLogger("fdlite").addHandler(probe)
    try:
        with caplog.at_level(logging.DEBUG, logger="fdlite"):
            llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=True)
            with tqdm(total=1, disable=False) as outer:  # a caller's bar, as `fdlite run` draws
                llm.generate("c", SamplingParams(max_tokens=2), use_tqdm=False)
                outer.update(1)
    finally:
        logging.getLogger("fdlite").removeHandler(probe)
    assert open_bars == [(logging.INFO, 0), (logging.DEBUG, 1)]
    assert [r.getMessage().split(" in ")[0] for r in caplog.records if r.getMessage().startswith("generate: ")] \
        == ["generate: 2 requests", "generate: 1 request"]


def test_a_job_with_its_bar_logs_no_generate_line(tmp_path, capsys):
    job, _ = write_job(tmp_path, records(3))
    assert cli.main(["run", job]) == 0  # with the progress bar
    captured = capsys.readouterr()
    assert "generate: " not in captured.err
    assert "fdlite run: 3/3 requests done" in captured.out


# ---- 3: checks before the model loads ----------------------------------------------------------------------


def test_bad_lines_are_reported_before_the_model_loads(tmp_path, monkeypatch, capsys):
    lines = [json.dumps(records(1)[0]), '{"id": "broken", "prompt": "no brace"', json.dumps({"id": "x"})]
    job, _ = write_job(tmp_path, None, raw_lines="\n".join(lines) + "\n")

    class Loaded(Exception):
        pass

    def model_loads(**kwargs):
        raise Loaded

    monkeypatch.setattr(job_runner, "LLM", model_loads)
    with pytest.raises(Loaded):
        cli.main(["run", job, "--no-progress"])
    err = capsys.readouterr().err  # printed before the model was asked for
    assert "job.jsonl:2: invalid JSON" in err and "job.jsonl:3: missing 'prompt'" in err


def test_a_file_of_bad_lines_fails_fast_without_paddle(tmp_path):
    job, out = write_job(tmp_path, None, raw_lines='{"id": 1, "prompt": "hi"\n{"id": 2}\n')
    code = ("import sys, time; from fdlite.cli import main; t = time.perf_counter(); "
            f"rc = main(['run', {job!r}]); "
            "print(rc, 'paddle' in sys.modules, round(time.perf_counter() - t, 3), file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code], env=fdlite_env(), capture_output=True, text=True, timeout=120)
    rc, paddle_loaded, seconds = p.stderr.splitlines()[-1].split()
    assert (rc, paddle_loaded) == ("1", "False"), p.stderr
    assert float(seconds) < 1.0
    assert "job.jsonl:1: invalid JSON" in p.stderr and "job.jsonl:2: missing 'prompt'" in p.stderr
    errors = str(tmp_path / "out" / "job.errors.jsonl")
    assert p.stdout == f"fdlite run: nothing to run: no line of {tmp_path / 'job.jsonl'} is a valid request; " \
                       f"2 lines have errors (see {errors})\n"
    assert [e["line"] for e in read_jsonl(errors)] == [1, 2]
    summary = json.loads((tmp_path / "out" / "job.summary.json").read_text())
    assert summary["requests"] == {"lines": 2, "done": 0, "resumed": 0, "this_run": 0, "errors": 2}


def test_a_finished_job_says_nothing_to_do(tmp_path, monkeypatch, capsys):
    job, out = write_job(tmp_path, records(3))
    assert cli.main(["run", job, "--no-progress"]) == 0
    before = open(out, "rb").read()
    capsys.readouterr()
    monkeypatch.setattr(job_runner, "LLM", no_model)
    assert cli.main(["run", job]) == 0  # progress on: still no bar
    captured = capsys.readouterr()
    assert captured.out == f"fdlite run: nothing to do: all 3 requests are already done (in {out})\n"
    assert captured.err == ""
    assert open(out, "rb").read() == before
    summary = json.loads((tmp_path / "out" / "job.summary.json").read_text())
    assert summary["requests"] == {"lines": 3, "done": 3, "resumed": 3, "this_run": 0, "errors": 0}


# ---- 4: run-batch names itself -----------------------------------------------------------------------------


def batch_file(path, n):
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": f"Say {i}", "max_tokens": 2, "temperature": 0}} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_run_batch_labels_its_bar_and_summary(tmp_path, monkeypatch, capsys):
    args = ["run-batch", "-i", batch_file(tmp_path / "b.jsonl", 2), "-o", str(tmp_path / "r.jsonl"),
            "--max-model-len", "256", "--max-num-seqs", "2"]
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("fdlite run-batch: 2/2 requests done")
    assert "fdlite run-batch: 100%" in captured.err and "fdlite run:" not in captured.err + captured.out
    monkeypatch.setattr(job_runner, "LLM", no_model)
    assert cli.main(args) == 0
    assert capsys.readouterr().out.startswith("fdlite run-batch: nothing to do: all 2 requests are already done")


# ---- 5: SamplingParams keywords ----------------------------------------------------------------------------


def test_sampling_params_typo_says_did_you_mean():
    with pytest.raises(TypeError) as e:
        SamplingParams(tempreature=0.5)
    assert str(e.value) == "SamplingParams: unknown keyword argument 'tempreature'; did you mean 'temperature'?"
    with pytest.raises(TypeError, match="unknown keyword argument 'colour'$"):
        SamplingParams(colour="blue")
    assert SamplingParams(temperature=0.5, guided_decoding={"choice": ["a"]}).structured_outputs.choice == ["a"]


# ---- 6: --help without Paddle ------------------------------------------------------------------------------


def test_help_does_not_import_paddle():
    code = ("import sys\nfrom fdlite.cli import main\n"
            "for argv in (['--help'], ['run', '--help'], ['run-batch', '--help'], ['generate', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "import fdlite\nprint('paddle' in sys.modules, file=sys.stderr)\n"
            "from fdlite import SamplingParams\nprint('paddle' in sys.modules, file=sys.stderr)\n")
    p = subprocess.run([sys.executable, "-c", code], env=fdlite_env(), capture_output=True, text=True, timeout=120)
    assert p.stderr.split() == ["False", "False"], p.stderr
    assert "fdlite run JOB.yaml" in p.stdout


# ---- 7: the CPU attention op is built in its own phase ------------------------------------------------------


def test_cpu_attention_op_is_built_in_compile_ops_before_load_weights(monkeypatch):
    from fdlite.kernels import cpu_attention

    calls = []
    real_load = cpu_attention.load

    def load():
        calls.append(time.perf_counter())
        return real_load()

    monkeypatch.setattr(cpu_attention, "load", load)
    llm = LLM(**ENGINE)
    ph = llm.phases
    assert ph.index("end", "compile_ops") < ph.index("begin", "load_weights")
    begin, end = ph.events[ph.index("begin", "compile_ops")].time, ph.events[ph.index("end", "compile_ops")].time
    assert calls and begin <= calls[0] <= end  # the first call (the one that builds) is this phase's
    assert "compile_ops_s" in llm.startup_report


# ---- 9: one job path -----------------------------------------------------------------------------------------


def test_every_job_is_shares_of_one_path(tmp_path, monkeypatch):
    from fdlite.jobs.job_config import Overrides, batch_job, load_job

    job, out = write_job(tmp_path, records(2))
    one = job_runner._Share.of(load_job(job))
    assert (one.index, one.count, one.parts, one.results, one.writes, one.lead) == (0, 1, None, out, True, True)
    batch = job_runner._Share.of(batch_job(Overrides(job={"input": batch_file(tmp_path / "b.jsonl", 1),
                                                          "output": str(tmp_path / "r.jsonl")})))
    assert batch.parts is not None and batch.results == str(tmp_path / "r.jsonl.parts" / "share-0-of-1.jsonl")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")  # set by hand, without the launcher: runs, writes nothing
    stray = job_runner._Share.of(load_job(job))
    assert (stray.index, stray.driver, stray.writes, stray.lead) == (0, True, False, False)
    import fdlite.jobs

    assert not os.path.exists(os.path.join(os.path.dirname(fdlite.jobs.__file__), "ranks.py"))


def test_summary_counts_one_constrained_request_in_the_singular():
    from fdlite.jobs.job_summary import JobStats, format_summary

    stats = JobStats(lines=1)
    stats.add_result(3, 2, 0.1, 0.05, constrained=True)
    text = format_summary(stats.summary(job=None, output="o", errors_file="e", startup_s=1, wall_time_s=1,
                                        exit_code=0), "s", "fdlite run-batch")
    assert text.startswith("fdlite run-batch: 1/1 requests done")
    assert "structured outputs: 1 constrained request, 0 ended by length" in text
