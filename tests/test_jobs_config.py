"""The job file schema: every mistake is found before the model loads and named as FILE:LINE: KEY: REASON."""

import dataclasses
import glob
import os

import pytest

from fdlite.config import EngineConfig
from fdlite.jobs.job_config import JobConfigError, Overrides, load_job
from fdlite.jobs.options import ENGINE_OPTIONS, SAMPLING_OPTIONS, check_value
from fdlite.sampling_params import SamplingParams

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def write_job(tmp_path, text, input_name="in.jsonl", input_text='{"prompt": "hi"}\n'):
    (tmp_path / input_name).write_text(input_text)
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


def error_of(path, overrides=None):
    with pytest.raises(JobConfigError) as e:
        load_job(path, overrides)
    return str(e.value)


def test_valid_job_fills_every_field(tmp_path):
    path = write_job(tmp_path, (
        "max_num_seqs: 2\n"
        "graph_optimization_config: {graph_opt_level: 1}\n"
        "sampling:\n"
        "  temperature: 0\n"
        "  max_tokens: 5\n"
        "chat_template_kwargs: {enable_thinking: false}\n"
        "input: in.jsonl\n"
        "output: out/res.jsonl\n"
    ))
    job = load_job(path)
    assert job.engine_options == {"max_num_seqs": 2, "graph_optimization_config": {"graph_opt_level": 1}}
    assert job.engine.max_num_seqs == 2 and job.engine.graph_optimization_config.graph_opt_level == 1
    assert job.sampling.temperature == 0 and job.sampling.max_tokens == 5
    assert job.chat_template_kwargs == {"enable_thinking": False}
    # Relative paths are relative to the job file, wherever the command runs from.
    assert job.input == str(tmp_path / "in.jsonl") and job.input_format == "jsonl"
    assert job.output == str(tmp_path / "out" / "res.jsonl")
    assert job.errors == str(tmp_path / "out" / "res.errors.jsonl")
    assert job.summary == str(tmp_path / "out" / "res.summary.json")


@pytest.mark.parametrize("config", sorted(glob.glob(os.path.join(CONFIGS, "*.yaml"))), ids=os.path.basename)
def test_every_shipped_config_validates(config):
    job = load_job(config)
    assert os.path.isfile(job.input)


def test_shipped_gpu_config_asks_for_graphs():
    # Level 0: the shipped example must run on PyPI's one Paddle GPU build (2.6.2 on Python 3.12 has no SOT).
    job = load_job(os.path.join(CONFIGS, "gpu_qwen3.yaml"))
    g = job.engine.graph_optimization_config
    assert g.graph_opt_level == 0 and g.use_cudagraph is True
    assert job.engine.gpu_memory_utilization < 0.9


@pytest.mark.parametrize("text, message", [
    # unknown option, with the closest known name
    ("max_num_seq: 4\ninput: in.jsonl\noutput: o.jsonl\n",
     "job.yaml:1: max_num_seq: unknown option 'max_num_seq'; did you mean 'max_num_seqs'?"),
    ("input: in.jsonl\noutput: o.jsonl\nsampling:\n  temprature: 0\n",
     "job.yaml:4: sampling.temprature: unknown sampling option 'temprature'; did you mean 'temperature'?"),
    # values the dataclasses reject, pointed at the key they name
    ("input: in.jsonl\noutput: o.jsonl\nmax_num_seqs: 0\n",
     "job.yaml:3: max_num_seqs: max_num_seqs must be a positive int, got 0"),
    ("input: in.jsonl\noutput: o.jsonl\nenable_chunked_prefill: false\nmax_model_len: 4096\nmax_num_batched_tokens: 100\n",
     "job.yaml:5: max_num_batched_tokens: max_num_batched_tokens (100) is smaller than max_model_len (4096): "
     "the longest prompt could never be scheduled; raise it or enable_chunked_prefill"),
    ("input: in.jsonl\noutput: o.jsonl\nsampling:\n  max_tokens: 8\n  temperature: -1\n",
     "job.yaml:5: sampling.temperature: SamplingParams.temperature must be >= 0, got -1.0"),
    ("input: in.jsonl\noutput: o.jsonl\nsampling:\n  max_tokens: 2\n  min_tokens: 5\n",
     "job.yaml:5: sampling.min_tokens: SamplingParams.min_tokens must be <= max_tokens (2), got 5"),
    ("input: in.jsonl\noutput: o.jsonl\ngraph_optimization_config:\n  graph_opt_level: 1\n  use_cuda_graph: true\n",
     "job.yaml:5: graph_optimization_config.use_cuda_graph: unknown graph_optimization_config key "
     "'use_cuda_graph'; did you mean 'use_cudagraph'?"),
    ("input: in.jsonl\noutput: o.jsonl\ngraph_optimization_config: '{\"graph_opt_level\": 5}'\n",
     "job.yaml:3: graph_optimization_config: graph_optimization_config.graph_opt_level must be 0, 1 or 2, got 5"),
    # types the dataclasses would let through
    ("input: in.jsonl\noutput: o.jsonl\nenable_prefix_caching: 'yes'\n",
     "job.yaml:3: enable_prefix_caching: enable_prefix_caching must be true or false, got 'yes'"),
    ("input: in.jsonl\noutput: o.jsonl\nmax_model_len: 1024.5\n",
     "job.yaml:3: max_model_len: max_model_len must be an int, got 1024.5"),
    ("input: in.jsonl\noutput: o.jsonl\nsampling: [1, 2]\n",
     "job.yaml:3: sampling: must be a mapping of sampling options, got [1, 2]"),
    # YAML itself
    ("input: in.jsonl\noutput: o.jsonl\nsampling:\n  temperature: 0\n max_tokens: 4\n",
     "job.yaml:5: invalid YAML: expected <block end>, but found '<block mapping start>'"),
    ("input: in.jsonl\nmax_num_seqs: 2\noutput: o.jsonl\nmax_num_seqs: 4\n",
     "job.yaml:4: max_num_seqs: duplicate key (first on line 2)"),
    ("- input: in.jsonl\n", "job.yaml:1: the job file must be a mapping of options, got a list"),
    # job keys
    ("input: in.jsonl\n", "job.yaml:1: output: required: Results file (JSONL), appended as requests finish; "
                          "a rerun skips ids already in it (resume)."),
    ("input: missing.jsonl\noutput: o.jsonl\n", "job.yaml:1: input: {tmp}/missing.jsonl: file not found"),
    ("input: in.jsonl\noutput: in.jsonl\n", "job.yaml:2: output: is the same file as input ({tmp}/in.jsonl)"),
    ("input: in.jsonl\ninput_format: parquet\noutput: o.jsonl\n",
     "job.yaml:2: input_format: must be one of jsonl, csv, text, openai, got 'parquet'"),
    ("input: in.jsonl\noutput: o.jsonl\nskip_tokenizer_init: true\n",
     "job.yaml:3: skip_tokenizer_init: a job reads text prompts, so it needs the tokenizer"),
])
def test_bad_job_file_names_key_and_line(tmp_path, text, message):
    path = write_job(tmp_path, text)
    expected = message.replace("{tmp}", str(tmp_path))
    assert error_of(path) == f"{tmp_path}/{expected}"


def test_unknown_input_extension_and_bad_csv_header(tmp_path):
    path = write_job(tmp_path, "input: in.dat\noutput: o.jsonl\n", input_name="in.dat")
    assert error_of(path).endswith(
        "job.yaml:1: input: cannot tell the format of 'in.dat' from its extension; "
        "set input_format to one of jsonl, csv, text, openai")
    path = write_job(tmp_path, "input: in.csv\noutput: o.jsonl\n", input_name="in.csv", input_text="id,promt\n1,hi\n")
    assert error_of(path) == (
        f"{tmp_path}/job.yaml:1: input: {tmp_path}/in.csv:1: unknown CSV column 'promt'; did you mean 'prompt'?")
    path = write_job(tmp_path, "input: in.csv\noutput: o.jsonl\n", input_name="in.csv", input_text="id,sampling\n1,{}\n")
    assert error_of(path).endswith("in.csv:1: the CSV header has no 'prompt' column (columns: id, sampling)")


def test_command_line_overrides_win_and_are_blamed_by_flag(tmp_path):
    path = write_job(tmp_path, "max_num_seqs: 2\nsampling: {max_tokens: 8, temperature: 0}\n"
                               "input: in.jsonl\noutput: o.jsonl\n")
    other = str(tmp_path / "elsewhere.jsonl")
    job = load_job(path, Overrides(engine={"max_num_seqs": 3}, sampling={"max_tokens": 2},
                                   job={"output": other}))
    assert job.engine.max_num_seqs == 3 and job.sampling.max_tokens == 2 and job.sampling.temperature == 0
    assert job.output == other and job.errors == str(tmp_path / "elsewhere.errors.jsonl")
    bad = Overrides(engine={"max_num_seqs": 0}, flags={"max_num_seqs": "--max-num-seqs"})
    assert error_of(path, bad) == "command line: --max-num-seqs: max_num_seqs must be a positive int, got 0"
    bad = Overrides(sampling={"top_p": 0.0}, flags={"sampling.top_p": "--top-p"})
    assert error_of(path, bad) == "command line: --top-p: SamplingParams.top_p must be > 0, got 0.0"


def test_schema_covers_every_option():
    # One schema: every EngineConfig and SamplingParams field is an option, with the dataclass's help text.
    assert [s.name for s in ENGINE_OPTIONS] == [f.name for f in dataclasses.fields(EngineConfig)]
    assert [s.name for s in SAMPLING_OPTIONS] == [f.name for f in dataclasses.fields(SamplingParams)]
    assert {s.name: s.help for s in SAMPLING_OPTIONS} == SamplingParams.help()
    assert [(s.name, s.default, s.help) for s in ENGINE_OPTIONS] == EngineConfig.help_table()
    flags = [s.flag for s in ENGINE_OPTIONS + SAMPLING_OPTIONS]
    assert len(flags) == len(set(flags))
    assert "--sampling-seed" in flags and "--seed" in flags  # the one name both groups use


@pytest.mark.parametrize("name, value, ok", [
    ("enable_prefix_caching", True, True), ("enable_prefix_caching", 1, False),
    ("max_num_seqs", 4, True), ("max_num_seqs", True, False), ("max_num_seqs", "4", False),
    ("gpu_memory_utilization", 1, True), ("gpu_memory_utilization", "0.9", False),
    ("num_gpu_blocks_override", None, True), ("max_num_seqs", None, False),
    ("graph_optimization_config", '{"use_cudagraph": true}', True), ("graph_optimization_config", [1], False),
])
def test_yaml_value_types(name, value, ok):
    spec = next(s for s in ENGINE_OPTIONS if s.name == name)
    if ok:
        assert check_value(spec, value) == value
    else:
        with pytest.raises(ValueError, match=f"^{name} must "):
            check_value(spec, value)
