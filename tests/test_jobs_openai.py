"""OpenAI batch files end to end on CPU with the built-in model: `fdlite run-batch` and `input_format: openai`.

The input is written in the format of vLLM's example batch file (custom_id, method, url, body); every
output line is checked field by field against the OpenAI batch output shape, and its content against
the Python API run on the same prompts.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fdlite import LLM, SamplingParams, cli
from fdlite.jobs.job_input import detect_format
from fdlite.jobs.shares import assign_shares
from test_jobs_run import ENGINE, KILL_MID_WRITE, fdlite_env, read_jsonl

ENGINE_FLAGS = ["--max-num-seqs", "4", "--max-model-len", "256"]
CHAT = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello world!"}]


def line(custom_id, url, body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat(custom_id, **body):
    return line(custom_id, "/v1/chat/completions", {"model": "fdlite-default-qwen3-tiny", "messages": CHAT, **body})


def completion(custom_id, prompt, **body):
    return line(custom_id, "/v1/completions", {"model": "fdlite-default-qwen3-tiny", "prompt": prompt, **body})


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


def greedy_text(llm, prompt, max_tokens):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text


def check_result_line(row, custom_id, obj):
    assert list(row) == ["id", "custom_id", "response", "error"]
    assert row["id"].startswith("batch_req_") and row["custom_id"] == custom_id and row["error"] is None
    resp = row["response"]
    assert list(resp) == ["status_code", "request_id", "body"]
    assert resp["status_code"] == 200 and isinstance(resp["request_id"], str) and resp["request_id"]
    body = resp["body"]
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]
    assert body["object"] == obj and body["id"].startswith("chatcmpl-" if obj == "chat.completion" else "cmpl-")
    assert isinstance(body["created"], int) and abs(body["created"] - time.time()) < 600
    assert body["model"] == "fdlite-default-qwen3-tiny"
    usage = body["usage"]
    assert list(usage) == ["prompt_tokens", "completion_tokens", "total_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    for i, choice in enumerate(body["choices"]):
        assert choice["index"] == i and choice["finish_reason"] in ("stop", "length")
        if obj == "chat.completion":
            assert list(choice) == ["index", "message", "logprobs", "finish_reason"]
            assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        else:
            assert list(choice) == ["index", "text", "logprobs", "finish_reason"]
            assert isinstance(choice["text"], str)
    return body


def check_error_line(row, custom_id, code=None, param=None):
    assert list(row) == ["id", "custom_id", "response", "error"]
    assert row["id"].startswith("batch_req_") and row["custom_id"] == custom_id
    if param is None:  # the batch line itself was bad: OpenAI's request-level error object
        assert row["response"] is None
        assert list(row["error"]) == ["code", "message"] and row["error"]["code"] == code
        return row["error"]["message"]
    assert row["error"] is None
    resp = row["response"]
    assert resp["status_code"] == 400 and resp["request_id"]
    err = resp["body"]["error"]
    assert list(err) == ["message", "type", "param", "code"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    return err["message"]


FMT_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}


def test_vllm_format_batch_file_end_to_end(tmp_path, llm, capsys):
    stop_prompt = "The capital of France is"
    full = greedy_text(llm, stop_prompt, 8)
    # A stop string the greedy text is known to contain, first seen after its start.
    start = next(i for i in range(1, len(full) - 3) if full.index(full[i:i + 3]) == i and full[i:i + 3].strip())
    stop_word = full[start:start + 3]
    rows_in = [
        chat("chat-1", max_tokens=6, temperature=0),
        completion("cmpl-n2", "Once upon a time", max_tokens=5, n=2, temperature=0.8, seed=7, top_p=0.9),
        completion("cmpl-stop", stop_prompt, max_tokens=8, temperature=0, stop=[stop_word, "zzzz-never"]),
        chat("chat-lp", max_completion_tokens=3, temperature=0, logprobs=True, top_logprobs=2),
        line("emb", "/v1/embeddings", {"model": "x", "input": "hi"}),
        completion("chat-1", "a duplicate custom_id"),
        completion("best-of", "unsupported field", best_of=2),
        chat("fmt", max_tokens=40, temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "a", "schema": FMT_SCHEMA}}),
        chat("fmt-bad", response_format={"type": "json_schema", "json_schema": {"name": "no schema"}}),
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows_in[:4]) + "{not json\n" + \
        "".join(json.dumps(r) + "\n" for r in rows_in[4:])
    (tmp_path / "batch.jsonl").write_text(text)
    out = tmp_path / "results.jsonl"
    assert detect_format(str(tmp_path / "batch.jsonl")) == "openai"
    assert cli.main(["run-batch", "-i", str(tmp_path / "batch.jsonl"), "-o", str(out), "--no-progress",
                     *ENGINE_FLAGS]) == 1  # done, with per-line errors

    rows = read_jsonl(out)
    assert len(rows) == 10  # one line per input line, in input order
    # chat, greedy: the same text as LLM.chat
    body = check_result_line(rows[0], "chat-1", "chat.completion")
    exp = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert body["choices"][0]["message"]["content"] == exp.outputs[0].text
    assert body["usage"] == {"prompt_tokens": len(exp.prompt_token_ids), "completion_tokens": 6 if
                             exp.outputs[0].finish_reason == "length" else len(exp.outputs[0].token_ids),
                             "total_tokens": body["usage"]["total_tokens"]}
    assert body["choices"][0]["logprobs"] is None
    # completion, n=2, seeded sampling: both completions, as LLM.generate gives them
    body = check_result_line(rows[1], "cmpl-n2", "text_completion")
    exp = llm.generate("Once upon a time", SamplingParams(max_tokens=5, n=2, temperature=0.8, seed=7, top_p=0.9),
                       use_tqdm=False)[0]
    assert [c["text"] for c in body["choices"]] == [c.text for c in exp.outputs]
    assert body["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in exp.outputs)
    # a stop list: the text ends before the stop string
    body = check_result_line(rows[2], "cmpl-stop", "text_completion")
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == full[:full.index(stop_word)]
    # chat logprobs: OpenAI's content list, top_logprobs of 2
    body = check_result_line(rows[3], "chat-lp", "chat.completion")
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 3
    for item in content:
        assert list(item) == ["token", "logprob", "bytes", "top_logprobs"] and len(item["top_logprobs"]) == 2
        assert item["logprob"] <= 0 and item["bytes"] == list(item["token"].encode())
        assert item["logprob"] == max(t["logprob"] for t in item["top_logprobs"])  # greedy: the top token
    assert "".join(i["token"] for i in content) == body["choices"][0]["message"]["content"]
    # the bad lines: error objects, never a crash
    assert "invalid JSON" in check_error_line(rows[4], None, code="invalid_json_line")
    assert "/v1/embeddings" in check_error_line(rows[5], "emb", code="invalid_url")
    assert "line 1" in check_error_line(rows[6], "chat-1", code="duplicate_custom_id")
    assert "best_of" in check_error_line(rows[7], "best-of", param="best_of")
    # response_format through structured outputs: a stopped output follows the schema; a bad format is a 400
    body = check_result_line(rows[8], "fmt", "chat.completion")
    choice = body["choices"][0]
    if choice["finish_reason"] == "stop":
        value = json.loads(choice["message"]["content"])
        assert isinstance(value["a"], int) and value["b"] in ("x", "y")
    else:
        assert choice["finish_reason"] == "length" and choice["message"]["content"].lstrip().startswith("{")
    assert "schema" in check_error_line(rows[9], "fmt-bad", param="response_format")

    errors = read_jsonl(tmp_path / "results.errors.jsonl")
    assert [e["line"] for e in errors] == [5, 6, 7, 8, 10]
    summary = json.loads((tmp_path / "results.summary.json").read_text())
    assert summary["requests"] == {"lines": 10, "done": 5, "resumed": 0, "this_run": 5, "errors": 5}
    assert summary["job"] is None and summary["data_parallel"]["size"] == 1
    assert not os.path.exists(str(out) + ".parts")  # merged, then removed
    assert "5/10 requests done" in capsys.readouterr().out

    # A finished job rerun does nothing: no request runs and the output is not rewritten.
    before = out.read_bytes()
    assert cli.main(["run-batch", "-i", str(tmp_path / "batch.jsonl"), "-o", str(out), "--no-progress",
                     *ENGINE_FLAGS]) == 1
    assert out.read_bytes() == before
    summary = json.loads((tmp_path / "results.summary.json").read_text())
    assert summary["requests"] == {"lines": 10, "done": 5, "resumed": 5, "this_run": 0, "errors": 5}
    assert len(read_jsonl(tmp_path / "results.errors.jsonl")) == 5


def test_job_file_with_openai_input_and_sigkill_resume(tmp_path):
    """`input_format: openai` in a job file (detected); a SIGKILL mid-write, then a rerun: each custom_id once."""
    rows_in = [completion(f"q{i}", f"Request number {i} about topic {i * 3}", max_tokens=4, temperature=0)
               for i in range(6)]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_in))
    (tmp_path / "job.yaml").write_text(json.dumps({**ENGINE, "input": "batch.jsonl", "output": "out/res.jsonl"}))
    out = tmp_path / "out" / "res.jsonl"
    part = str(out) + ".parts/share-0-of-1.jsonl"
    marker = tmp_path / "marker"
    (tmp_path / "kill.py").write_text(KILL_MID_WRITE)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "kill.py"), part, str(marker), "2", "run",
                             str(tmp_path / "job.yaml"), "--no-progress"], env=fdlite_env(), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.time() < deadline
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert not out.exists() and len(open(part, "rb").read().splitlines()) == 3  # 2 lines + a torn one

    assert cli.main(["run", str(tmp_path / "job.yaml"), "--no-progress"]) == 0
    rows = read_jsonl(out)
    assert [r["custom_id"] for r in rows] == [f"q{i}" for i in range(6)]
    summary = json.loads((tmp_path / "out" / "res.summary.json").read_text())
    assert summary["requests"]["resumed"] == 2 and summary["requests"]["this_run"] == 4
    # Equal to an uninterrupted run.
    assert cli.main(["run", str(tmp_path / "job.yaml"), "--no-progress", "--output", str(tmp_path / "clean.jsonl")]) == 0
    texts = lambda rs: [(r["custom_id"], r["response"]["body"]["choices"][0]["text"]) for r in rs]  # noqa: E731
    assert texts(rows) == texts(read_jsonl(tmp_path / "clean.jsonl"))


def test_format_detection():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        def fmt(lines, name="x.jsonl"):
            path = os.path.join(d, name)
            with open(path, "w") as f:
                f.write("".join(json.dumps(x) + "\n" for x in lines))
            return detect_format(path)

        assert fmt([completion("a", "p")]) == "openai"
        assert fmt([{"id": 1, "prompt": "p"}]) == "jsonl"
        assert fmt([completion("a", "p"), {"id": 1, "prompt": "p"}]) is None  # ambiguous: the user says which
        assert fmt([], name="x.csv") == "csv"


def test_shares_are_balanced_by_length_and_deterministic():
    costs = [100, 1, 1, 1, 1, 1, 50, 50]
    shares = assign_shares(costs, 2)
    assert shares == assign_shares(list(costs), 2)
    loads = [sum(c for c, s in zip(costs, shares) if s == k) for k in (0, 1)]
    assert sorted(loads) == [102, 103]  # by count alone (4 and 4) one share could hold 150 + 50
    assert assign_shares([5] * 8, 4).count(3) == 2  # equal lengths: equal counts


def test_readme_batch_example_runs_as_written(tmp_path, monkeypatch, capsys):
    import re
    import shlex

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as f:
        text = f.read()
    start = text.index("## OpenAI batch files: `fdlite run-batch`")
    sec = text[start:text.index("\n## ", start + 1)]
    (tmp_path / "batch.jsonl").write_text(re.findall(r"```jsonl\n(.*?)```", sec, flags=re.S)[0])
    command = re.findall(r"```bash\n(.*?)```", sec, flags=re.S)[0].splitlines()[0].split("#")[0]
    argv = shlex.split(command)
    assert argv[:2] == ["fdlite", "run-batch"]
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv[1:] + ["--no-progress"]) == 0
    rows = read_jsonl(tmp_path / "results.jsonl")
    chat_body = check_result_line(rows[0], "req-1", "chat.completion")
    assert chat_body["usage"]["completion_tokens"] <= 16
    body = check_result_line(rows[1], "req-2", "text_completion")
    assert len(body["choices"]) == 2
    documented = json.loads(re.findall(r"```json\n(.*?)```", sec, flags=re.S)[0])
    assert list(documented) == list(rows[0]) and list(documented["response"]["body"]) == list(chat_body)
