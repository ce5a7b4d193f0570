"""The `fdlite` command: `fdlite run JOB.yaml` for batch jobs, `fdlite run-batch -i IN -o OUT` for OpenAI
batch files, `fdlite generate PROMPT` for a quick try.

Every `LLM` option and every sampling option is a `--flag` built from the dataclass fields (see
`fdlite.jobs.options`), so the command line, the YAML job file and the Python API share one set of
names, defaults and help texts. Flags win over the job file. Exit codes: 0 done, 1 done but some lines
failed (see the errors file), 2 nothing ran (bad job file, option or output file), 130 interrupted.

The log on stderr is a few plain lines (model, device, KV cache, ready); `-v` shows every step, each line
with its time and source. Nothing here imports Paddle until a command runs, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import textwrap
from typing import Any

from fdlite.config import unknown_key_error
from fdlite.jobs.job_config import JOB_KEYS, JobConfigError, Overrides, batch_job, command_line_error, load_job
from fdlite.jobs.job_input import FORMATS
from fdlite.jobs.job_output import OutputFileError
from fdlite.jobs.options import ENGINE_OPTIONS, SAMPLING_OPTIONS, OptionSpec, parse_cli_value

EXIT_BAD_USAGE = 2
EXIT_INTERRUPTED = 130

_METAVARS = {"int": "N", "float": "X", "str": "STR", "json": "JSON", "int_list": "N", "str_list": "STR"}


def _converter(spec: OptionSpec):
    def convert(text: str) -> Any:
        return parse_cli_value(spec, text)

    convert.__name__ = {"int_list": "int", "str_list": "str", "json": "JSON"}.get(spec.kind, spec.kind)
    return convert


def _help(spec: OptionSpec) -> str:
    text = spec.help
    if not (spec.default is None and "default" in text):  # "None = ... (default: max_model_len)" says it already
        text += f" (default: {spec.default_text})"
    return text.replace("%", "%%")


def _add_option(group, spec: OptionSpec) -> None:
    # SUPPRESS: an option left out is absent from the namespace, so only flags actually given override a job file.
    kw: dict[str, Any] = {
        "dest": f"{spec.group}.{spec.name}",
        "default": argparse.SUPPRESS,
        "help": _help(spec),
    }
    if spec.kind == "bool":
        kw["action"] = argparse.BooleanOptionalAction
    elif spec.kind == "str_list":
        kw.update(action="append", metavar=_METAVARS[spec.kind])
    else:
        kw.update(type=_converter(spec), metavar=_METAVARS[spec.kind])
        if spec.kind == "int_list":
            kw["nargs"] = "+"
    group.add_argument(spec.flag, **kw)


def _options_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="Log every startup step (debug level), each line with its time and source file:line.")
    engine = p.add_argument_group("LLM options (LLM(...) keyword arguments; top-level keys of a job file)")
    for spec in ENGINE_OPTIONS:
        _add_option(engine, spec)
    sampling = p.add_argument_group("sampling options (SamplingParams; the `sampling:` block of a job file)")
    for spec in SAMPLING_OPTIONS:
        _add_option(sampling, spec)
    return p


def _job_keys_text() -> str:
    width = max(len(k) for k in JOB_KEYS) + 4
    rows = [
        textwrap.fill(h, width=79, initial_indent=f"  {k:<{width - 2}}", subsequent_indent=" " * width)
        for k, h in JOB_KEYS.items()
    ]
    return "job file keys (besides `model` and the LLM options above; see `fdlite run --help`):\n" + "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    """The `fdlite` argument parser (public so docs and tests can inspect it)."""
    options = _options_parser()
    parser = argparse.ArgumentParser(
        prog="fdlite", parents=[options], allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="fdlite: offline batch inference for LLMs on PaddlePaddle.\n\n"
                    "  fdlite run JOB.yaml          run a batch job (resumable; see README, 'Batch jobs')\n"
                    "  fdlite run-batch -i IN -o OUT  run an OpenAI batch file (resumable)\n"
                    "  fdlite generate PROMPT       one prompt, text to stdout\n\n"
                    "Options below apply to both commands and override the job file.",
        epilog=_job_keys_text(),
    )
    sub = parser.add_subparsers(dest="command", metavar="{run,run-batch,generate}")

    run = sub.add_parser(
        "run", parents=[options], allow_abbrev=False, help="run a YAML batch job",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a YAML batch job. Results are appended to the output as requests finish; rerunning "
                    "the same job skips ids already there.\nExit codes: 0 done, 1 done with per-line errors, "
                    "2 bad job file or option (nothing ran).",
        epilog=_job_keys_text(),
    )
    run.add_argument("job", metavar="JOB.yaml", help="the job file")
    job = run.add_argument_group("job options (override the job file; paths are relative to the current folder)")
    for key in ("input", "output", "errors", "summary"):
        job.add_argument(f"--{key}", dest=f"job.{key}", default=argparse.SUPPRESS, metavar="PATH", help=JOB_KEYS[key])
    job.add_argument("--input-format", dest="job.input_format", default=argparse.SUPPRESS, choices=FORMATS,
                     help=JOB_KEYS["input_format"])
    job.add_argument("--no-progress", dest="no_progress", action="store_true", help="Do not draw the progress bar.")

    batch = sub.add_parser(
        "run-batch", parents=[options], allow_abbrev=False, help="run an OpenAI batch file",
        description="Run an OpenAI batch file (one {custom_id, method, url, body} request a line, for "
                    "/v1/chat/completions and /v1/completions) and write OpenAI batch output lines, as vLLM's and "
                    "FastDeploy's run-batch do; rerunning the same command resumes. Lines that cannot run get an "
                    "error object in the output. Exit codes as for `fdlite run`.",
    )
    for flags, key in ((("-i", "--input"), "input"), (("-o", "--output"), "output"), (("--errors",), "errors"),
                       (("--summary",), "summary")):
        batch.add_argument(*flags, dest=f"job.{key}", default=argparse.SUPPRESS, metavar="PATH",
                           required=key in ("input", "output"), help=JOB_KEYS[key])
    batch.add_argument("--no-progress", dest="no_progress", action="store_true", help="Do not draw the progress bar.")

    gen = sub.add_parser("generate", parents=[options], allow_abbrev=False, help="complete one prompt",
                         description="Complete one prompt and print the text to stdout.")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true",
                     help="Send the prompt as one user message through the model's chat template.")
    return parser


def _overrides(args: argparse.Namespace) -> Overrides:
    o = Overrides()
    specs = {f"{s.group}.{s.name}": s for s in ENGINE_OPTIONS + SAMPLING_OPTIONS}
    for dest, value in vars(args).items():
        group, _, name = dest.partition(".")
        if group == "engine":
            o.engine[name] = value
            o.flags[name] = specs[dest].flag
        elif group == "sampling":
            o.sampling[name] = value
            o.flags[f"sampling.{name}"] = specs[dest].flag
        elif group == "job":
            o.job[name] = os.path.abspath(value) if name != "input_format" else value
            o.flags[name] = f"--{name.replace('_', '-')}"
    for key in ("model", "tokenizer"):  # a path given on the command line is relative to the current folder
        if isinstance(o.engine.get(key), str):
            o.engine[key] = os.path.abspath(os.path.expanduser(o.engine[key]))
    return o


def _run(args: argparse.Namespace, o: Overrides) -> int:
    from fdlite.jobs.job_runner import run_job

    job = batch_job(o) if args.command == "run-batch" else load_job(args.job, o)
    return run_job(job, show_progress=not args.no_progress)


def _generate(args: argparse.Namespace, o: Overrides) -> int:
    from fdlite.config import EngineConfig
    from fdlite.llm import LLM
    from fdlite.sampling_params import SamplingParams

    try:
        EngineConfig.from_kwargs(**o.engine)
    except (ValueError, TypeError) as e:
        raise command_line_error(str(e), list(o.engine), o.flags) from None
    try:
        params = SamplingParams.from_dict(o.sampling)
    except ValueError as e:
        raise command_line_error(str(e), list(o.sampling), o.flags, prefix="sampling.") from None
    llm = LLM(**o.engine)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    if out.error is not None:
        print(f"fdlite: error: {out.error}", file=sys.stderr)
        return 1
    for completion in out.outputs:
        print(completion.text, flush=True)
    return 0


# What the command prints of fdlite's log: plain lines by default, every line with its time and source under -v.
_PLAIN_FORMAT = "fdlite: %(message)s"
_VERBOSE_FORMAT = "[%(asctime)s] [%(levelname)8s] %(filename)s:%(lineno)d - %(message)s"


class _PlainFormatter(logging.Formatter):
    """`fdlite: MESSAGE`, and `fdlite: warning: MESSAGE` from warning level up (as the command's own errors)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno >= logging.WARNING:
            text = text.replace("fdlite: ", f"fdlite: {record.levelname.lower()}: ", 1)
        return text


class _StderrThroughTqdm(logging.Handler):
    """Writes to the current stderr through tqdm, so a line logged while a progress bar is drawn lands above it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


@contextlib.contextmanager
def _logging_to_stderr(verbose: bool = False):
    """fdlite's log on stderr for the duration of a command: INFO and up as plain lines (model, device, KV
    cache, ready), or DEBUG and up with time and file:line under --verbose. fdlite's lines stop there:
    Paddle's import installs a root handler of its own that would print each of them a second time.
    The logger is restored afterwards (tests call `main` many times in one process)."""
    log = logging.getLogger("fdlite")
    handler = _StderrThroughTqdm()
    handler.setFormatter(logging.Formatter(_VERBOSE_FORMAT) if verbose else _PlainFormatter(_PLAIN_FORMAT))
    saved = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


def _unknown_arguments(parser: argparse.ArgumentParser, unknown: list[str]) -> int:
    # argparse only says "unrecognized arguments"; name the closest flag, as job files do for their keys.
    flag = next((u.split("=", 1)[0] for u in unknown if u.startswith("--")), None)
    if flag is None:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    known = [s.flag for s in ENGINE_OPTIONS + SAMPLING_OPTIONS]
    known += [f"--no-{s.flag[2:]}" for s in ENGINE_OPTIONS + SAMPLING_OPTIONS if s.kind == "bool"]
    known += ["--input", "--output", "--errors", "--summary", "--input-format", "--no-progress", "--chat", "--help",
              "--verbose", "-i", "-o", "-v"]
    print(f"fdlite: error: {unknown_key_error('option', flag, known)}", file=sys.stderr)
    return EXIT_BAD_USAGE


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `fdlite` console script and of `python -m fdlite`; returns the exit code."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        return _unknown_arguments(parser, unknown)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_USAGE
    try:
        o = _overrides(args)
        with _logging_to_stderr(verbose=getattr(args, "verbose", False)):
            return _generate(args, o) if args.command == "generate" else _run(args, o)
    except (JobConfigError, OutputFileError) as e:
        print(f"fdlite: error: {e}", file=sys.stderr)
        return EXIT_BAD_USAGE
    except KeyboardInterrupt:
        print("fdlite: interrupted; rerun the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
