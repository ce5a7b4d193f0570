"""Run a validated job: resume where the output stops, stream results to disk as they finish, report.

Order matters for crash safety and for failing fast. Before the model loads: the output is checked (and
a torn last line cut away), the whole input is read (every per-line problem reported with its line
number), and ids already done are set aside; a job with nothing left to run stops there. Then the model
loads and the rest runs through `LLM.generate_stream`, so every result is on disk the moment its request
finishes: a job killed at 90% reruns only the last 10%.

One path for every job: the launch is split into `data_parallel_size` shares (model copies of
`tensor_parallel_size` processes) and this process runs its group's share, so a single process is one
share of one. Where a share's results go depends on the job (`_Share`): a JSONL job of one share appends
straight to the output; an OpenAI batch file or several shares append to part files that rank 0 merges
into the output, in input order, once every share is done (`fdlite/jobs/shares.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from fdlite.default_model import DEFAULT_MODEL_NAME
from fdlite.distributed.parallel_state import group_of, has_process_group, launched_rank, launched_world_size
from fdlite.jobs.job_config import JobConfig
from fdlite.jobs.job_input import JobRequest, LineError, read_requests
from fdlite.jobs.job_output import (
    JsonlAppender, OutputFileError, ResumeState, result_record, scan_output, write_json_atomic,
)
from fdlite.jobs.job_summary import JobStats, format_summary
from fdlite.jobs.openai_batch import error_line as openai_error_line
from fdlite.jobs.openai_batch import line_error_line, record_tokens, result_line
from fdlite.jobs.shares import (
    Parts, PartTail, assign_shares, merge_output, read_errors, remove_parts, request_cost, scan_parts,
)
from fdlite.progress import Progress

if TYPE_CHECKING:
    from fdlite.llm import LLM

logger = logging.getLogger("fdlite")

EXIT_OK = 0
EXIT_LINE_ERRORS = 1  # the job finished, but some lines could not be run (see the errors file)
EXIT_BAD_JOB = 2  # nothing ran: bad job file, option or output file

# Requests handed to the engine at once: enough to keep every batch slot busy, few enough that a
# huge input is never tokenized and held in memory all at once.
CHUNK_SIZE = 1024

# How often rank 0 of a data-parallel job looks at the other groups' part files and markers.
POLL_INTERVAL_S = 0.5


def __getattr__(name: str):
    # `LLM` is imported on first use, so that reading and checking a job (and failing on a bad one) does
    # not wait for Paddle's import; tests replace `job_runner.LLM` to prove the model never loads.
    if name == "LLM":
        from fdlite.llm import LLM

        globals()["LLM"] = LLM
        return LLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class _Share:
    """This process's place in the job: which share it runs and which files it writes."""

    index: int  # the share (data-parallel group) this process runs
    count: int  # data_parallel_size
    driver: bool  # rank 0 of its tensor-parallel group: reads the input; the group's other ranks receive it
    writes: bool  # writes this share's results and errors files
    lead: bool  # rank 0 of the launch: reports, merges the parts, writes the errors file and summary
    parts: Parts | None  # None: results go straight into the output
    results: str  # the file this share appends its results to
    errors: str  # the file this share appends the requests that failed while running to

    @classmethod
    def of(cls, job: JobConfig) -> _Share:
        tp, dp = job.engine.tensor_parallel_size, job.engine.data_parallel_size
        rank = launched_rank()
        group, tp_rank = group_of(rank, tp)
        # A rank beyond the launch (PADDLE_TRAINER_ID set without the launcher) runs the first share and
        # writes nothing, as any rank but a group's first does.
        inside = group < dp
        parts = Parts(job.output, dp) if dp > 1 or job.input_format == "openai" else None
        index = group if inside else 0
        return cls(index=index, count=dp, driver=tp_rank == 0, writes=tp_rank == 0 and inside, lead=rank == 0,
                   parts=parts, results=parts.part(index) if parts else job.output,
                   errors=parts.errors(index) if parts else job.errors)


def run_job(job: JobConfig, show_progress: bool = True, stdout: TextIO | None = None) -> int:
    """Run `job` to completion; return the exit code (EXIT_OK or EXIT_LINE_ERRORS).

    Only the first rank of each tensor-parallel group writes (its share's files) and only rank 0 reports;
    the group's other ranks run the same batches, which they receive from the first rank. Raises
    `OutputFileError` before loading the model if the existing output cannot be resumed safely.
    """
    stdout = stdout or sys.stdout
    label = "fdlite run-batch" if job.source is None else "fdlite run"
    share = _Share.of(job)
    openai = job.input_format == "openai"
    key = "custom_id" if openai else "id"
    input_name = os.path.basename(job.input)
    t_start = time.perf_counter()

    done, merged = _resume(job, share, key)
    # The errors file lists the problems of the latest run only: every run re-reads every line (resumed
    # ids are skipped after the checks), so old entries would be stale or doubled. It exists only when
    # there are errors. The summary is removed too, so that it exists only once a run has finished.
    if share.lead:
        for stale in (job.errors, job.summary):
            if os.path.exists(stale):
                os.remove(stale)
        if share.parts is not None and os.path.isdir(share.parts.folder):
            share.parts.clear_markers()

    stats = JobStats()
    errors = JsonlAppender(share.errors, truncate=True, lazy=True) if share.writes else None
    output = None
    try:
        requests: list[JobRequest] = []
        input_errors: list[dict] = []  # the input's problems are the job's: rank 0 reports them once
        pending: list[JobRequest] | None = None
        if share.driver:
            for item in read_requests(job.input, job.input_format, job.sampling):
                if isinstance(item, LineError):
                    input_errors.append({"line": item.line, "id": item.id, "error": item.reason})
                    if share.lead:
                        _say(f"{input_name}:{item.line}: {item.reason}")
                        if share.parts is None:  # straight into the errors file, before what fails while running
                            errors.append(input_errors[-1])
                else:
                    requests.append(item)
            stats.lines = len(requests) + len(input_errors)
            assigned = assign_shares([request_cost(r) for r in requests], share.count)
            mine = [r for r, k in zip(requests, assigned) if k == share.index]
            pending = [r for r in mine if r.key not in done]
            stats.resumed = len(mine) - len(pending)

        # With one process a job whose every request is done (or bad) stops here; in a launch every rank
        # loads the model, since the collectives of startup need all of them.
        llm = None
        if pending or launched_world_size() > 1:
            llm = sys.modules[__name__].LLM(**job.engine_options)
        startup_s = time.perf_counter() - t_start
        if llm is not None and share.count > 1 and has_process_group():
            import paddle.distributed as dist

            dist.barrier()  # rank 0 has cleared the old markers: a marker seen from now on is this run's
        if llm is not None and job.engine.tensor_parallel_size > 1:
            pending = llm.runner.comm.broadcast_object(pending)  # the group runs the driver's batches

        # Rank 0's bar covers the whole job: the other shares' progress is read from their part files.
        tails, seen = _other_shares(share, merged, done, key) if share.lead else ([], set())
        progress = Progress(total=len(requests), enabled=show_progress and share.lead and llm is not None,
                            desc=label, initial=sum(r.key in seen for r in requests))
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

        def line_error(line: int, request_id: Any, reason: str, progress: Progress | None = None) -> None:
            stats.errors += 1
            if errors is not None:
                errors.append({"line": line, "id": request_id, "error": reason})
                (progress.write if progress else _say)(f"{input_name}:{line}: {reason}")

        model_name = os.path.basename(str(job.engine_options.get("model") or DEFAULT_MODEL_NAME).rstrip("/"))
        make_record = (lambda req, out: result_line(req, out, model_name)) if openai else None
        t_gen = time.perf_counter()
        try:
            if llm is not None:
                output = JsonlAppender(share.results) if share.writes else None
                engine_before = llm.engine.stats()  # cumulative counters: the run spans several generate calls
                for start in range(0, len(pending), CHUNK_SIZE):
                    _run_chunk(llm, job, pending[start:start + CHUNK_SIZE], output, stats, progress, line_error,
                               make_record=make_record, tick=follow)
                stats.engine = {k: v - engine_before[k] for k, v in llm.engine.stats().items()}
            for f in (output, errors):
                if f is not None:
                    f.close()
            if share.parts is not None and share.writes:
                marker = dataclasses.asdict(stats)
                marker.update(share=share.index, wall_time_s=time.perf_counter() - t_gen, startup_s=startup_s)
                write_json_atomic(share.parts.marker(share.index), marker)
            if not share.lead:
                # In a launch a non-zero exit would make the launcher stop the others: rank 0 reports.
                failed = stats.errors or input_errors
                return EXIT_LINE_ERRORS if failed and launched_world_size() == 1 else EXIT_OK
            markers = _wait_for_shares(share.parts, follow) if share.parts is not None else []
        finally:
            progress.close()
    finally:
        for f in (output, errors):
            if f is not None:
                f.close()

    if share.parts is not None:
        for m in markers:
            if m["share"] != share.index:
                stats.absorb(m)
        _finish_parts(job, share.parts, merged, input_errors, openai, key)
    stats.errors += len(input_errors)
    wall_s = time.perf_counter() - t_gen
    exit_code = EXIT_LINE_ERRORS if stats.errors else EXIT_OK
    summary = stats.summary(job=os.path.abspath(job.source) if job.source else None, output=job.output,
                            errors_file=job.errors, startup_s=startup_s, wall_time_s=wall_s, exit_code=exit_code)
    if share.parts is not None:
        summary["data_parallel"] = {
            "size": share.count,
            "shares": [{"share": m["share"], "this_run": m["completed"], "resumed": m["resumed"],
                        "output_tokens": m["output_tokens"], "wall_time_s": round(m["wall_time_s"], 4)}
                       for m in markers],
        }
    write_json_atomic(job.summary, summary)
    text = format_summary(summary, job.summary, label) if llm is not None else _nothing_to_do(job, summary, label)
    print(text, file=stdout, flush=True)
    return exit_code


def _resume(job: JobConfig, share: _Share, key: str) -> tuple[set[str], ResumeState]:
    """The ids already done, and the scan of the output, before the model loads; repairs this share's own
    results file (cuts a torn last line left by a crash away)."""
    if not share.driver:
        return set(), ResumeState()  # the group's driver decides what runs
    if not share.writes:
        try:  # read-only, while rank 0 may be writing: a half-seen line just means that request reruns here
            state = scan_output(share.results, repair=False, key=key)
        except OutputFileError:
            state = ResumeState()
        return state.done, ResumeState()
    merged = ResumeState()
    if share.parts is not None:
        if os.path.isdir(job.output):
            raise OutputFileError(f"{job.output}: the output path is a folder")
        # The output is only ever written whole (rename), so it is read, never repaired.
        merged = scan_output(job.output, repair=False, key=key, keep=_is_result if key == "custom_id" else None)
    own = scan_output(share.results, repair=True, key=key)
    if own.torn_bytes:
        _say(f"{share.results}: cut away a torn last line ({own.torn_bytes} bytes) left by an interrupted run")
    if own.duplicates:
        _say(f"{share.results}: ids present more than once: {', '.join(own.duplicates[:5])}")
    done = merged.done | own.done
    if share.parts is not None:
        if os.path.exists(share.errors):
            os.remove(share.errors)  # failed requests run again: only this run's failures count
        for _, state in scan_parts(share.parts.stale_parts(), key):
            done |= state.done
    return done, merged


def _other_shares(share: _Share, merged: ResumeState, done: set[str], key: str) -> tuple[list[PartTail], set[str]]:
    """Rank 0's view of the whole job: followers of the other shares' part files, and every id done so far."""
    if share.parts is None:
        return [], done
    others = [share.parts.part(k) for k in range(share.count) if k != share.index]
    tails, seen = [], set(merged.done)
    for path, state in scan_parts(share.parts.all_parts(), key):
        seen |= state.done
        if path in others:
            tails.append(PartTail(path, state.good_bytes))
    return tails, seen


def _nothing_to_do(job: JobConfig, summary: dict[str, Any], label: str) -> str:
    """The one line of a job that stopped before loading the model: no request was left to run."""
    r = summary["requests"]
    valid = r["lines"] - r["errors"]
    bad = f"; {r['errors']} {'line has' if r['errors'] == 1 else 'lines have'} errors (see {job.errors})"
    if r["lines"] == 0:
        return f"{label}: nothing to do: {job.input} holds no requests"
    if valid == 0:
        return f"{label}: nothing to run: no line of {job.input} is a valid request{bad}"
    return (f"{label}: nothing to do: all {valid} {'request is' if valid == 1 else 'requests are'} already done "
            f"(in {job.output}){bad if r['errors'] else ''}")


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


def _finish_parts(job: JobConfig, parts: Parts, merged: ResumeState, input_errors: list[dict], openai: bool,
                  key: str) -> None:
    """Rank 0, once every share is done: the output merged from the parts, the parts removed, and the errors
    file: the input's problems and the failed requests of every share, in line order."""
    gen_errors = read_errors([p for p in map(parts.errors, range(parts.n)) if os.path.exists(p)])
    if any(state.lines for _, state in scan_parts(parts.all_parts(), key)) or not os.path.exists(job.output) \
            or (openai and gen_errors):
        _merge(job, parts, merged, gen_errors, openai, key)
    remove_parts(parts)
    problems = input_errors + [{"line": e["line"], "id": e["id"], "error": e["error"]} for e in gen_errors]
    if problems:
        with JsonlAppender(job.errors, truncate=True) as f:
            for e in sorted(problems, key=lambda e: e["line"]):
                f.append(e)


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
