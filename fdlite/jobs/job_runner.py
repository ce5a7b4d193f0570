"""Run a validated job: resume where the output stops, stream results to disk as they finish, report.

Order matters for crash safety and for failing fast: the output file is checked (and a torn last line
cut away) before the model loads; then the input is read, per-line problems go to the errors file, ids
already in the output are skipped, and the rest run through `LLM.generate_stream` so that every result
is on disk the moment its request finishes. A job killed at 90% therefore reruns only the last 10%.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Any, TextIO

from fdlite.jobs.job_config import JobConfig
from fdlite.jobs.job_input import JobRequest, LineError, read_requests
from fdlite.jobs.job_output import (
    JsonlAppender, OutputFileError, ResumeState, result_record, scan_output, write_json_atomic,
)
from fdlite.default_model import DEFAULT_MODEL_NAME
from fdlite.distributed.parallel_state import group_of
from fdlite.jobs.job_summary import JobStats, format_summary
from fdlite.jobs.openai_batch import error_line as openai_error_line
from fdlite.jobs.openai_batch import line_error_line, record_tokens, result_line
from fdlite.jobs.ranks import current_rank, has_process_group, share_from_rank0
from fdlite.jobs.shares import (
    Parts, PartTail, assign_shares, merge_output, read_errors, remove_parts, request_cost, scan_parts,
)
from fdlite.llm import LLM
from fdlite.progress import Progress

logger = logging.getLogger("fdlite")

EXIT_OK = 0
EXIT_LINE_ERRORS = 1  # the job finished, but some lines could not be run (see the errors file)
EXIT_BAD_JOB = 2  # nothing ran: bad job file, option or output file

# Requests handed to the engine at once: enough to keep every batch slot busy, few enough that a
# huge input is never tokenized and held in memory all at once.
CHUNK_SIZE = 1024


def run_job(job: JobConfig, show_progress: bool = True, stdout: TextIO | None = None) -> int:
    """Run `job` to completion; return the exit code (EXIT_OK or EXIT_LINE_ERRORS).

    Only rank 0 (see `fdlite.jobs.ranks`) writes files; the other ranks run the same requests and write
    nothing. With a process group (tensor parallelism) only rank 0 reads the input and the others receive
    its requests; without one there is nothing to receive them through, so each rank reads the input.
    Raises `OutputFileError` before loading the model if the existing output cannot be resumed safely.

    With `data_parallel_size` > 1, or an OpenAI batch file, the job runs in shares with part files that
    are merged into the output at the end (`_run_in_shares`).
    """
    stdout = stdout or sys.stdout
    if job.engine.data_parallel_size > 1 or job.input_format == "openai":
        return _run_in_shares(job, show_progress, stdout)
    writes = current_rank() == 0
    t_start = time.perf_counter()
    if writes:
        resume = scan_output(job.output, repair=True)
    else:
        try:  # read-only, while rank 0 may be writing: a half-seen line just means that request reruns here
            resume = scan_output(job.output, repair=False)
        except OutputFileError:
            resume = ResumeState()
    if writes and resume.torn_bytes:
        _say(f"{job.output}: cut away a torn last line ({resume.torn_bytes} bytes) left by an interrupted run")
    if writes and resume.duplicates:
        _say(f"{job.output}: ids present more than once: {', '.join(resume.duplicates[:5])}")

    # The errors file lists the problems of the latest run only: every run re-reads every line (resumed
    # ids are skipped after the checks), so old entries would be stale or doubled. It exists only when
    # there are errors. The summary is removed too, so that it exists only once a run has finished.
    for stale in (job.errors, job.summary):
        if writes and os.path.exists(stale):
            os.remove(stale)

    llm = LLM(**job.engine_options)
    startup_s = time.perf_counter() - t_start

    stats = JobStats()
    output = JsonlAppender(job.output) if writes else None
    errors = JsonlAppender(job.errors, truncate=True, lazy=True) if writes else None
    input_name = os.path.basename(job.input)

    def line_error(line: int, request_id: Any, reason: str, progress: Progress | None = None) -> None:
        stats.errors += 1
        if errors is not None:
            errors.append({"line": line, "id": request_id, "error": reason})
            (progress.write if progress else _say)(f"{input_name}:{line}: {reason}")

    try:
        if has_process_group():
            # Tensor-parallel ranks must run identical batches: rank 0's reading of the input wins.
            pending = share_from_rank0(_pending(job, resume, stats, line_error) if writes else None)
        else:
            # No process group (single process, or before tensor parallelism lands): each rank reads the
            # input itself; a rank > 0 saw the output read-only above and writes nothing.
            pending = _pending(job, resume, stats, line_error)

        progress = Progress(total=stats.resumed + len(pending), enabled=show_progress and writes,
                            desc="fdlite run", initial=stats.resumed)
        t_gen = time.perf_counter()
        engine_before = llm.engine.stats()  # cumulative counters: the run spans several generate calls
        try:
            for start in range(0, len(pending), CHUNK_SIZE):
                _run_chunk(llm, job, pending[start:start + CHUNK_SIZE], output, stats, progress, line_error)
        finally:
            progress.close()
        wall_s = time.perf_counter() - t_gen
        stats.engine = {k: v - engine_before[k] for k, v in llm.engine.stats().items()}
    finally:
        for f in (output, errors):
            if f is not None:
                f.close()

    exit_code = EXIT_LINE_ERRORS if stats.errors else EXIT_OK
    if writes:
        summary = stats.summary(job=os.path.abspath(job.source), output=job.output, errors_file=job.errors,
                                startup_s=startup_s, wall_time_s=wall_s, exit_code=exit_code)
        write_json_atomic(job.summary, summary)
        print(format_summary(summary, job.summary), file=stdout, flush=True)
    return exit_code


def _pending(job: JobConfig, resume: ResumeState, stats: JobStats, line_error) -> list[JobRequest]:
    """The input's requests not yet in the output; per-line problems are reported on the way."""
    pending = []
    for item in read_requests(job.input, job.input_format, job.sampling):
        stats.lines += 1
        if isinstance(item, LineError):
            line_error(item.line, item.id, item.reason)
        elif item.key in resume.done:
            stats.resumed += 1
        else:
            pending.append(item)
    return pending


def _run_chunk(llm: LLM, job: JobConfig, chunk: list[JobRequest], output: JsonlAppender | None,
               stats: JobStats, progress: Progress, line_error, make_record=None, tick=None) -> None:
    """Run `chunk`, appending each result as it finishes; `make_record(req, out)` builds its line (default:
    `result_record`), `tick()` runs after each (rank 0 of a data-parallel job follows the others there)."""
    prompts, params, requests = [], [], []
    for req in chunk:
        try:
            prompts.append(_engine_prompt(llm, req, job.chat_template_kwargs))
        except Exception as e:  # a template can raise anything (jinja errors, raise_exception, TypeError)
            line_error(req.line, req.id, f"chat template failed: {e}", progress)
            progress.request_done(0)
            continue
        params.append(req.sampling)
        requests.append(req)
    for index, out in llm.generate_stream(prompts, params, use_tqdm=False):
        req = requests[index]
        if out.error is not None:
            line_error(req.line, req.id, out.error, progress)
            progress.request_done(0)
            continue
        rec = result_record(req.id, out) if make_record is None else make_record(req, out)
        if output is not None:
            output.append(rec)
        prompt_tokens, output_tokens = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
        ttft, latency = _timings(out)
        stats.add_result(prompt_tokens, output_tokens, latency, ttft,
                         constrained=req.sampling.structured_outputs is not None,
                         cut_by_length=any(c.finish_reason == "length" for c in out.outputs))
        progress.add_tokens(0, output_tokens)
        progress.request_done(prompt_tokens)
        if tick is not None:
            tick()


def _timings(out) -> tuple[float | None, float | None]:
    m = out.metrics or {}
    arrival, first, finish = m.get("arrival_time"), m.get("first_token_time"), m.get("finish_time")
    ttft = first - arrival if first is not None and arrival is not None else None
    latency = finish - arrival if finish is not None and arrival is not None else None
    return ttft, latency


def _engine_prompt(llm: LLM, req: JobRequest, chat_kwargs: dict[str, Any]) -> str | dict:
    if req.messages is None:
        return req.prompt
    # As LLM.chat does: render with the model's template, then encode without adding special tokens.
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(req.messages, add_generation_prompt=True, **chat_kwargs)
    return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- jobs in shares: data parallelism and OpenAI batch files ---------------------------------------------

# How often rank 0 of a data-parallel job looks at the other groups' part files and markers.
POLL_INTERVAL_S = 0.5


def _run_in_shares(job: JobConfig, show_progress: bool, stdout: TextIO) -> int:
    """Run this process's share of `job` into its part file; on rank 0, wait for every share and merge.

    Order: each group's driver checks (and repairs) its part before the model loads; rank 0 clears the
    markers of an earlier run; a barrier after startup makes sure no group finishes before that; then each
    group runs its share, writes its marker, and rank 0 merges once all markers are there.
    """
    tp, dp = job.engine.tensor_parallel_size, job.engine.data_parallel_size
    share, tp_rank = group_of(current_rank(), tp)
    driver, lead = tp_rank == 0, current_rank() == 0
    openai = job.input_format == "openai"
    key = "custom_id" if openai else "id"
    parts = Parts(job.output, dp)
    t_start = time.perf_counter()

    done: set[str] = set()
    merged = ResumeState()
    if driver:
        if os.path.isdir(job.output):
            raise OutputFileError(f"{job.output}: the output path is a folder")
        # The output is only ever written whole (rename), so it is read, never repaired.
        merged = scan_output(job.output, repair=False, key=key, keep=_is_result if openai else None)
        own = scan_output(parts.part(share), repair=True, key=key)
        if own.torn_bytes:
            _say(f"{parts.part(share)}: cut away a torn last line ({own.torn_bytes} bytes) left by an interrupted run")
        done = merged.done | own.done
        if os.path.exists(parts.errors(share)):
            os.remove(parts.errors(share))  # failed requests run again: only this run's failures count
        for _, state in scan_parts(parts.stale_parts(), key):
            done |= state.done
    if lead:
        for stale in (job.errors, job.summary):
            if os.path.exists(stale):
                os.remove(stale)
        if os.path.isdir(parts.folder):
            parts.clear_markers()

    llm = LLM(**job.engine_options)
    startup_s = time.perf_counter() - t_start
    if dp > 1 and has_process_group():
        import paddle.distributed as dist

        dist.barrier()  # rank 0 has cleared the old markers: a marker seen from now on is this run's

    stats = JobStats()
    input_name = os.path.basename(job.input)
    requests: list[JobRequest] = []
    input_errors: list[dict] = []
    pending: list[JobRequest] | None = None
    if driver:
        for item in read_requests(job.input, job.input_format, job.sampling):
            if isinstance(item, LineError):
                if lead:  # the input's problems are the job's, reported once; each group still skips them
                    stats.errors += 1
                    input_errors.append({"line": item.line, "id": item.id, "error": item.reason})
                    _say(f"{input_name}:{item.line}: {item.reason}")
            else:
                requests.append(item)
        stats.lines = len(requests) + stats.errors
        shares = assign_shares([request_cost(r) for r in requests], dp)
        mine = [r for r, k in zip(requests, shares) if k == share]
        pending = [r for r in mine if r.key not in done]
        stats.resumed = len(mine) - len(pending)
    if tp > 1:  # the group's ranks run the same batches: the driver's reading wins
        pending = llm.runner.comm.broadcast_object(pending)

    # Rank 0's bar covers the whole job: the other groups' progress is read from their part files.
    tails: list[PartTail] = []
    initial = 0
    if lead:
        others = [parts.part(k) for k in range(dp) if k != share]
        seen = set(merged.done)
        for path, state in scan_parts(parts.all_parts(), key):
            seen |= state.done
            if path in others:
                tails.append(PartTail(path, state.good_bytes))
        initial = sum(r.key in seen for r in requests)
    progress = Progress(total=len(requests), enabled=show_progress and lead, desc="fdlite run", initial=initial)
    last_poll = [time.perf_counter()]

    def follow(force: bool = False) -> None:
        if not tails or (not force and time.perf_counter() - last_poll[0] < POLL_INTERVAL_S):
            return
        last_poll[0] = time.perf_counter()
        for tail in tails:
            count, prompt_tokens, output_tokens = tail.poll(record_tokens)
            if count:
                progress.add_tokens(prompt_tokens, output_tokens)
                progress.bar.update(count)

    output = JsonlAppender(parts.part(share)) if driver else None
    errors = JsonlAppender(parts.errors(share), truncate=True, lazy=True) if driver else None

    def line_error(line: int, request_id: Any, reason: str, progress: Progress | None = None) -> None:
        stats.errors += 1
        if errors is not None:
            errors.append({"line": line, "id": request_id, "error": reason})
            (progress.write if progress else _say)(f"{input_name}:{line}: {reason}")

    model_name = os.path.basename(str(job.engine_options.get("model") or DEFAULT_MODEL_NAME).rstrip("/"))
    make_record = (lambda req, out: result_line(req, out, model_name)) if openai else None
    t_gen = time.perf_counter()
    engine_before = llm.engine.stats()
    try:
        try:
            for start in range(0, len(pending), CHUNK_SIZE):
                _run_chunk(llm, job, pending[start:start + CHUNK_SIZE], output, stats, progress, line_error,
                           make_record=make_record, tick=follow)
        finally:
            for f in (output, errors):
                if f is not None:
                    f.close()
        stats.engine = {k: v - engine_before[k] for k, v in llm.engine.stats().items()}
        if driver:
            marker = dataclasses.asdict(stats)
            marker.update(share=share, wall_time_s=time.perf_counter() - t_gen, startup_s=startup_s)
            write_json_atomic(parts.marker(share), marker)
        if not lead:
            return EXIT_OK  # a non-zero exit would make the launcher stop the others: rank 0 reports
        markers = _wait_for_shares(parts, follow)
    finally:
        progress.close()

    for m in markers:
        if m["share"] != share:
            stats.absorb(m)
    gen_errors = read_errors([p for p in map(parts.errors, range(dp)) if os.path.exists(p)])
    if any(state.lines for _, state in scan_parts(parts.all_parts(), key)) or not os.path.exists(job.output) \
            or (openai and gen_errors):
        _merge(job, parts, merged, gen_errors, openai, key)
    remove_parts(parts)
    problems = input_errors + [{"line": e["line"], "id": e["id"], "error": e["error"]} for e in gen_errors]
    if problems:
        with JsonlAppender(job.errors, truncate=True) as f:
            for e in sorted(problems, key=lambda e: e["line"]):
                f.append(e)
    wall_s = time.perf_counter() - t_gen
    exit_code = EXIT_LINE_ERRORS if stats.errors else EXIT_OK
    summary = stats.summary(job=os.path.abspath(job.source) if job.source else None, output=job.output,
                            errors_file=job.errors, startup_s=startup_s, wall_time_s=wall_s, exit_code=exit_code)
    summary["data_parallel"] = {
        "size": dp,
        "shares": [{"share": m["share"], "this_run": m["completed"], "resumed": m["resumed"],
                    "output_tokens": m["output_tokens"], "wall_time_s": round(m["wall_time_s"], 4)}
                   for m in markers],
    }
    write_json_atomic(job.summary, summary)
    print(format_summary(summary, job.summary), file=stdout, flush=True)
    return exit_code


def _is_result(rec: dict) -> bool:
    """An OpenAI batch output line that holds a result (error lines are rewritten by every merge)."""
    response = rec.get("response")
    return isinstance(response, dict) and response.get("status_code") == 200


def _wait_for_shares(parts: Parts, follow) -> list[dict]:
    """Every share's marker, once all are there (the launcher stops this process if another one dies)."""
    while True:
        markers = [parts.read_marker(k) for k in range(parts.n)]
        if all(m is not None for m in markers):
            follow(force=True)
            return markers
        follow(force=True)
        time.sleep(POLL_INTERVAL_S)


def _merge(job: JobConfig, parts: Parts, merged: ResumeState, gen_errors: list[dict], openai: bool,
           key: str) -> None:
    """The output in input order, from the old output and every part."""
    sources = scan_parts(parts.all_parts(), key)
    if merged.offsets:
        sources = sources + [(job.output, merged)]
    failed = {str(e["id"]): e for e in gen_errors}

    def missing(req: JobRequest) -> dict | None:
        e = failed.get(req.key)
        return openai_error_line(req.id, e["error"] if e else "the request did not run", status_code=500)

    merge_output(job.output, sources, read_requests(job.input, job.input_format, job.sampling),
                 missing_line=missing if openai else None, error_line=line_error_line if openai else None)
