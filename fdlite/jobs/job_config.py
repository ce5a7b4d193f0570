"""The YAML job file: its schema, and validation that names the key and line before any model loads.

A job file is flat: `model` and every other `LLM` option at the top level under its Python / FastDeploy
name, plus the job keys below (`input`, `output`, `sampling`, ...). Loading a model takes seconds to
minutes, so every mistake that can be found from the file alone is found first, and reported as
`FILE:LINE: KEY: REASON` so the user can jump straight to it. Line numbers come from PyYAML's node
marks (`yaml.compose`), since the plain loaded dict has none.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from fdlite.config import EngineConfig, unknown_key_error
from fdlite.jobs.job_input import FORMATS, InputFileError, check_input, detect_format, merge_sampling
from fdlite.distributed.parallel_state import launched_world_size
from fdlite.model_source import is_model_id
from fdlite.jobs.options import ENGINE_OPTIONS, SAMPLING_OPTIONS, check_value
from fdlite.sampling_params import ALIASES, SamplingParams

# The job's own keys, with their help text (the only copy: the CLI and README read it from here).
JOB_KEYS: dict[str, str] = {
    "input": "Prompts file: JSONL (one {\"id\", \"prompt\" or \"messages\", \"sampling\"} object a line), "
             "CSV (columns id, prompt, sampling) or plain text (one prompt a line).",
    "input_format": "jsonl, csv, text or openai (OpenAI batch file: custom_id, method, url, body a line); default: "
                    "from the input file's extension, and openai for a JSON-lines file of batch requests.",
    "output": "Results file (JSONL), appended as requests finish; a rerun skips ids already in it (resume).",
    "errors": "Per-line problems (JSONL); default: the output path with .errors.jsonl.",
    "summary": "Summary JSON written at the end; default: the output path with .summary.json.",
    "sampling": "SamplingParams defaults for every request; a line's own \"sampling\" object overrides them.",
    "chat_template_kwargs": "Extra chat-template variables for \"messages\" lines, e.g. {enable_thinking: false}.",
}
_PATH_KEYS = ("model", "tokenizer", "input", "output", "errors", "summary")
_ENGINE = {s.name: s for s in ENGINE_OPTIONS}
_SAMPLING = {s.name: s for s in SAMPLING_OPTIONS}


class JobConfigError(ValueError):
    """A problem with the job file or the command line, found before the model loads."""

    def __init__(self, where: str, key: str | None, reason: str):
        self.where, self.key, self.reason = where, key, reason
        super().__init__(f"{where}: {key}: {reason}" if key else f"{where}: {reason}")


@dataclass
class JobConfig:
    """A validated job. Paths are absolute; `engine_options` is what `LLM(**engine_options)` gets."""

    source: str | None  # the job file as given; None for `fdlite run-batch` (no job file)
    engine_options: dict[str, Any]  # the LLM options the job sets (YAML and command line)
    engine: EngineConfig  # the same, with every default filled in
    sampling: SamplingParams
    input: str
    input_format: str
    output: str
    errors: str
    summary: str
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Overrides:
    """Values from the command line; they win over the job file. Paths are already absolute."""

    engine: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    job: dict[str, Any] = field(default_factory=dict)
    flags: dict[str, str] = field(default_factory=dict)  # "max_num_seqs" / "sampling.seed" -> "--flag"


class _Where:
    """Where each key was set (file:line or a command-line flag), to point errors at it."""

    def __init__(self, path: str | None, lines: dict[str, int], flags: dict[str, str]):
        self.path, self.lines, self.flags = path, lines, flags  # path None: no job file

    def error(self, key: str | None, reason: str) -> JobConfigError:
        if key in self.flags or self.path is None:
            return JobConfigError("command line", self.flags.get(key or ""), reason)
        line = self.lines.get(key or "") or self.lines.get((key or "").split(".")[0]) or 1
        return JobConfigError(f"{self.path}:{line}", key, reason)

    def blame(self, reason: str, keys: list[str], prefix: str = "") -> JobConfigError:
        """Point a dataclass's error at the key it names first (their messages name the field).

        A nested key ("graph_optimization_config.use_cudagraph") is found by its dotted name or by its
        quoted leaf ('use_cudagraph'), the two ways the dataclasses name one.
        """
        nested = [k for k in self.lines if "." in k and k.split(".")[0] in keys]
        hits = []
        for key in list(keys) + nested:
            spellings = [key] + ([f"'{key.split('.', 1)[1]}'"] if "." in key else [])
            for spelling in spellings:
                m = re.search(rf"(?<!\w){re.escape(spelling)}(?!\w)", reason)
                if m:
                    hits.append((m.start(), -len(spelling), key))
        # A nested key that is named beats its parent, which its message names too.
        parents = {key.split(".")[0] for _, _, key in hits if "." in key}
        hits = [h for h in hits if h[2] not in parents]
        key = prefix + min(hits)[2] if hits else (prefix.rstrip(".") or None)
        return self.error(key, reason)


def command_line_error(reason: str, names: list[str], flags: dict[str, str], prefix: str = "") -> JobConfigError:
    """Point an option error raised outside a job file (e.g. `fdlite generate`) at the flag it names."""
    return _Where(None, {}, flags).blame(reason, names, prefix)


def default_sibling(output: str, suffix: str) -> str:
    """`out.jsonl` -> `out<suffix>`: where the errors and summary files go by default."""
    root, ext = os.path.splitext(output)
    return (root if ext.lower() in (".jsonl", ".json", ".ndjson") else output) + suffix


def _read_yaml(path: str) -> tuple[Any, dict[str, int]]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise JobConfigError(path, None, f"cannot read the job file: {e.strerror}") from None
    except UnicodeDecodeError:
        raise JobConfigError(path, None, "the job file is not valid UTF-8") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        problem = getattr(e, "problem", None) or str(e)
        raise JobConfigError(where, None, f"invalid YAML: {problem}") from None
    return data, _key_lines(path, node)


def _key_lines(path: str, node: Any) -> dict[str, int]:
    """"key" and "key.subkey" -> 1-based line; also rejects duplicate keys, which PyYAML silently merges."""
    lines: dict[str, int] = {}

    def walk(mapping: yaml.MappingNode, prefix: str, depth: int) -> None:
        for k, v in mapping.value:
            if not isinstance(k, yaml.ScalarNode):
                continue  # a non-string key: reported with the loaded data
            name, line = prefix + k.value, k.start_mark.line + 1
            if name in lines:
                raise JobConfigError(f"{path}:{line}", name, f"duplicate key (first on line {lines[name]})")
            lines[name] = line
            if depth == 0 and isinstance(v, yaml.MappingNode):
                walk(v, name + ".", 1)

    if isinstance(node, yaml.MappingNode):
        walk(node, "", 0)
    return lines


def load_job(path: str, overrides: Overrides | None = None) -> JobConfig:
    """Read and validate a job file (plus command-line overrides); raise `JobConfigError` on any problem."""
    overrides = overrides or Overrides()
    data, lines = _read_yaml(path)
    where = _Where(path, lines, overrides.flags)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise where.error(None, f"the job file must be a mapping of options, got a {type(data).__name__}")
    return _build_job(path, data, where, os.path.dirname(os.path.abspath(path)), overrides)


def batch_job(overrides: Overrides) -> JobConfig:
    """The job of `fdlite run-batch -i IN -o OUT [options]`: an OpenAI batch file, everything else from flags."""
    overrides.job.setdefault("input_format", "openai")
    return _build_job(None, {}, _Where(None, {}, overrides.flags), os.getcwd(), overrides)


def _build_job(path: str | None, data: dict, where: _Where, base_dir: str, overrides: Overrides) -> JobConfig:

    known = [s.name for s in ENGINE_OPTIONS] + list(JOB_KEYS)
    engine: dict[str, Any] = {}
    job: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise where.error(None, f"option names must be strings, got {key!r}")
        if key in _ENGINE:
            try:
                engine[key] = check_value(_ENGINE[key], value)
            except ValueError as e:
                raise where.error(key, str(e)) from None
        elif key in JOB_KEYS:
            job[key] = value
        else:
            raise where.error(key, str(unknown_key_error("option", key, known)))
    for key in _PATH_KEYS:  # relative paths in the file are relative to the file, not to the cwd
        for d in (engine, job):
            if isinstance(d.get(key), str) and d[key]:
                joined = os.path.join(base_dir, os.path.expanduser(d[key]))
                # A model id ("Qwen/Qwen3-0.6B") stays one unless a folder of that name is beside the file.
                if not (key in ("model", "tokenizer") and is_model_id(d[key]) and not os.path.exists(joined)):
                    d[key] = joined
    engine.update(overrides.engine)
    job.update(overrides.job)

    try:
        engine_config = EngineConfig.from_kwargs(**engine)
    except (ValueError, TypeError) as e:
        raise where.blame(str(e), list(engine)) from None
    procs = engine_config.data_parallel_size * engine_config.tensor_parallel_size
    if engine_config.data_parallel_size > 1 and launched_world_size() != procs:
        raise where.error("data_parallel_size", f"{engine_config.data_parallel_size} x tensor_parallel_size "
                          f"{engine_config.tensor_parallel_size} needs {procs} processes, but {launched_world_size()} "
                          f"{'was' if launched_world_size() == 1 else 'were'} started: run the job under "
                          f"`python -m paddle.distributed.launch --nproc_per_node {procs} fdlite run ...` "
                          f"(GPUs: --gpus 0,...,{procs - 1})")
    if engine_config.skip_tokenizer_init:
        raise where.error("skip_tokenizer_init", "a job reads text prompts, so it needs the tokenizer")

    sampling = _sampling(job.get("sampling"), overrides, where)
    chat_kwargs = job.get("chat_template_kwargs") or {}
    if not isinstance(chat_kwargs, dict):
        raise where.error("chat_template_kwargs", f"must be a mapping, got {chat_kwargs!r}")

    paths = {}
    for key in ("input", "output"):
        value = job.get(key)
        if value is None:
            raise where.error(key, f"required: {JOB_KEYS[key]}")
        if not isinstance(value, str) or not value:
            raise where.error(key, f"must be a file path, got {value!r}")
        paths[key] = value
    for key, suffix in (("errors", ".errors.jsonl"), ("summary", ".summary.json")):
        value = job.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise where.error(key, f"must be a file path, got {value!r}")
        paths[key] = value or default_sibling(paths["output"], suffix)

    fmt = job.get("input_format")
    if fmt is None:
        fmt = detect_format(paths["input"])
        if fmt is None:
            json_lines = os.path.splitext(paths["input"])[1].lower() in (".jsonl", ".ndjson", ".json")
            why = "its lines (OpenAI batch requests mixed with other objects)" if json_lines else "its extension"
            raise where.error("input", f"cannot tell the format of {os.path.basename(paths['input'])!r} from {why}; "
                                       f"set input_format to one of {', '.join(FORMATS)}")
    elif fmt not in FORMATS:
        raise where.error("input_format", f"must be one of {', '.join(FORMATS)}, got {fmt!r}")
    try:
        check_input(paths["input"], fmt)
    except InputFileError as e:
        raise where.error("input", str(e)) from None
    seen: dict[str, str] = {}
    for key in ("input", "output", "errors", "summary"):
        real = os.path.realpath(paths[key])
        if real in seen:
            raise where.error(key, f"is the same file as {seen[real]} ({paths[key]})")
        seen[real] = key
    if os.path.isdir(paths["output"]):
        raise where.error("output", f"is a folder, not a file: {paths['output']}")

    return JobConfig(source=path, engine_options=engine, engine=engine_config, sampling=sampling,
                     input=paths["input"], input_format=fmt, output=paths["output"], errors=paths["errors"],
                     summary=paths["summary"], chat_template_kwargs=chat_kwargs)


def _sampling(value: Any, overrides: Overrides, where: _Where) -> SamplingParams:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise where.error("sampling", f"must be a mapping of sampling options, got {value!r}")
    for key in value:
        if key not in _SAMPLING and key not in ALIASES:
            raise where.error(f"sampling.{key}", str(unknown_key_error("sampling option", str(key), list(_SAMPLING))))
    merged = merge_sampling(value, overrides.sampling)
    try:
        return SamplingParams.from_dict(merged)
    except (ValueError, TypeError) as e:
        raise where.blame(str(e), list(merged), prefix="sampling.") from None
