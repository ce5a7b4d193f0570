"""The README's batch-job example is copy-pasteable: its job and prompts files run as written."""

import json
import os
import re

from fdlite import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def section():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("## Batch jobs: `fdlite run`")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def blocks(text, lang):
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_readme_job_example_runs_and_documents_the_real_line_format(tmp_path, capsys):
    sec = section()
    (tmp_path / "job.yaml").write_text(blocks(sec, "yaml")[0])
    (tmp_path / "prompts.jsonl").write_text(blocks(sec, "jsonl")[0])
    assert cli.main(["run", str(tmp_path / "job.yaml"), "--no-progress"]) == 0
    with open(tmp_path / "out" / "results.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert sorted(r["id"] for r in rows) == ["q1", "q2", "q3"]
    assert (tmp_path / "out" / "results.summary.json").exists()
    assert "3/3 requests done" in capsys.readouterr().out

    documented_result, documented_error = (json.loads(b) for b in blocks(sec, "json"))
    assert list(documented_result) == list(rows[0])
    assert list(documented_error) == ["line", "id", "error"]
