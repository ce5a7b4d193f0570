"""Run a validated job: resume where the output stops, stream results to disk as they finish, report.

Order matters for crash safety and for failing fast: the output file is checked (and a torn last line
cut away) before the model loads; then the input is read, per-line problems go to the errors file, ids
already in the output are skipped, and the rest run through `LLM.generate_stream` so that every result
is on disk the moment its request finishes. A job killed at 90% therefore reruns only the last 10%.
"""

from __future__ import annotations

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
from fdlite.jobs.job_summary import JobStats, format_summary
from fdlite.jobs.ranks import current_rank, has_process_group, share_from_rank0
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
    """
    stdout = stdout or sys.stdout
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
               stats: JobStats, progress: Progress, line_error) -> None:
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
        rec = result_record(req.id, out)
        if output is not None:
            output.append(rec)
        stats.add_result(rec["prompt_tokens"], rec["output_tokens"], rec["latency_s"], rec["ttft_s"],
                         constrained=req.sampling.structured_outputs is not None,
                         cut_by_length=any(c.finish_reason == "length" for c in out.outputs))
        progress.add_tokens(0, rec["output_tokens"])
        progress.request_done(rec["prompt_tokens"])


def _engine_prompt(llm: LLM, req: JobRequest, chat_kwargs: dict[str, Any]) -> str | dict:
    if req.messages is None:
        return req.prompt
    # As LLM.chat does: render with the model's template, then encode without adding special tokens.
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(req.messages, add_generation_prompt=True, **chat_kwargs)
    return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
