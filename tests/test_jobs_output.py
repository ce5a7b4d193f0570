"""Crash-safe output files (torn-line repair, resume set) and the summary's statistics."""

import json

import pytest

from fdlite.jobs.job_output import JsonlAppender, OutputFileError, scan_output
from fdlite.jobs.job_summary import JobStats, format_summary, percentile


def lines(*ids):
    return "".join(json.dumps({"id": i, "text": f"t{i}"}) + "\n" for i in ids)


@pytest.mark.parametrize("tail", [
    '{"id": 4, "text": "cut mid-wr',  # the classic torn write
    '{"id": 4, "text": "complete but no newline"}',  # cut exactly before the newline: still redone
    '\x00\x00\x00\x00',  # a power cut on some filesystems: size grew, data did not land
    '{"id": 4, "te\n',  # newline present but not JSON
    '["no", "id"]\n',
])
def test_torn_last_line_is_cut_away(tmp_path, tail):
    path = tmp_path / "out.jsonl"
    good = lines(1, 2, "3")
    path.write_text(good + tail)
    state = scan_output(str(path))
    assert state.done == {"1", "2", "3"} and state.lines == 3
    assert state.torn_bytes == len(tail.encode())
    assert path.read_text() == good  # repaired in place: the rerun appends after a whole line


def test_scan_without_repair_leaves_the_file(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text(lines(1) + '{"id": 2')
    state = scan_output(str(path), repair=False)
    assert state.done == {"1"} and state.torn_bytes == 8
    assert path.read_text().endswith('{"id": 2')


def test_bad_line_before_the_end_is_reported_not_dropped(tmp_path):
    path = tmp_path / "out.jsonl"
    content = lines(1) + "garbage\n" + lines(3)
    path.write_text(content)
    with pytest.raises(OutputFileError, match=r"out.jsonl:2: not valid JSON; a crash can only tear the last line"):
        scan_output(str(path))
    assert path.read_text() == content  # nothing truncated


def test_missing_output_is_empty_and_duplicates_are_noticed(tmp_path):
    assert scan_output(str(tmp_path / "none.jsonl")).done == set()
    path = tmp_path / "out.jsonl"
    path.write_text(lines(1, 2, 1))
    state = scan_output(str(path))
    assert state.done == {"1", "2"} and state.duplicates == ["1"]


def test_appender_appends_whole_lines_and_lazy_file_appears_on_first_line(tmp_path):
    path = tmp_path / "sub" / "out.jsonl"
    with JsonlAppender(str(path)) as w:
        w.append({"id": 1, "text": "é\nmultiline"})
    with JsonlAppender(str(path)) as w:  # a second run appends
        w.append({"id": 2})
    assert [json.loads(x)["id"] for x in path.read_text(encoding="utf-8").splitlines()] == [1, 2]
    lazy_path = tmp_path / "errors.jsonl"
    lazy = JsonlAppender(str(lazy_path), truncate=True, lazy=True)
    lazy.close()
    assert not lazy_path.exists()


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([], 50) is None


def test_summary_counts_the_whole_job_and_times_this_run():
    s = JobStats(lines=6, resumed=2, errors=1)
    s.add_result(10, 4, 0.5, 0.1)
    s.add_result(20, 6, 1.5, 0.2)
    out = s.summary(job="j.yaml", output="o.jsonl", errors_file="o.errors.jsonl", startup_s=1.0, wall_time_s=2.0,
                    exit_code=1)
    assert out["requests"] == {"lines": 6, "done": 4, "resumed": 2, "this_run": 2, "errors": 1}
    assert (out["input_tokens"], out["output_tokens"], out["output_tokens_per_s"]) == (30, 10, 5.0)
    assert out["latency_s"] == {"p50": 1.0, "p99": 1.49}
    text = format_summary(out, "o.summary.json")
    assert text.splitlines()[0] == "fdlite run: 4/6 requests done (2 resumed, 2 this run), 1 error"
    assert "errors: o.errors.jsonl" in text and "5.0 output tokens/s" in text
