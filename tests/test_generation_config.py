"""The model's generation_config.json gives the sampling defaults a request leaves unset (vLLM's
generation_config="auto"); a request's own values win; generation_config="vllm" ignores the file."""

import json
import logging
import os
import shutil

import pytest

from fdlite import LLM, SamplingParams

GEN = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.3, "bos_token_id": 1}
PROMPTS = [[5, 9, 13, 17, 21], [100, 7, 3], [42] * 9]


@pytest.fixture(scope="module")
def folder(model_dirs, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("genconf") / "qwen3")
    shutil.copytree(model_dirs["qwen3"], path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(GEN, f)
    return path


def _tokens(llm, params):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                         use_tqdm=False)]


@pytest.fixture(scope="module")
def llms(folder):
    common = dict(skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_model_len=128)
    return LLM(folder, **common), LLM(folder, generation_config="vllm", **common)


def test_unset_fields_take_the_models_defaults(llms):
    auto, plain = llms
    taken = dict(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.3)
    assert auto.sampling_defaults == taken and plain.sampling_defaults == {}
    want = _tokens(plain, SamplingParams(seed=3, max_tokens=8, **taken))
    assert _tokens(auto, SamplingParams(seed=3, max_tokens=8)) == want
    # Without the file's values the same seeded request samples other tokens.
    assert _tokens(plain, SamplingParams(seed=3, max_tokens=8)) != want


def test_fields_the_request_sets_win(llms):
    auto, plain = llms
    mine = SamplingParams(seed=3, max_tokens=8, temperature=1.0, repetition_penalty=1.0)
    # top_p and top_k still come from the file; temperature and repetition_penalty are the request's.
    want = _tokens(plain, SamplingParams(seed=3, max_tokens=8, temperature=1.0, top_p=0.95, top_k=20))
    assert _tokens(auto, mine) == want
    assert mine.temperature == 1.0 and mine.top_k == 0  # the caller's object is not changed


def test_default_sampling_params_and_the_log_line(folder, caplog):
    with caplog.at_level(logging.INFO, logger="fdlite"):
        llm = LLM(folder, skip_tokenizer_init=True, max_num_seqs=2, block_size=16, max_model_len=64)
    line = next(r.getMessage() for r in caplog.records if "generation_config.json" in r.getMessage())
    assert "temperature=0.6" in line and "top_k=20" in line and "generation_config='vllm'" in line
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.min_p) == (0.6, 0.95, 20, 1.3, 0.0)


def test_generate_without_params_uses_them(folder, tmp_path):
    greedy = str(tmp_path / "greedy")
    shutil.copytree(folder, greedy)
    with open(os.path.join(greedy, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.0, "repetition_penalty": 1.3}, f)
    common = dict(skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_model_len=128)
    llm, plain = LLM(greedy, **common), LLM(greedy, generation_config="vllm", **common)
    want = _tokens(plain, SamplingParams(temperature=0.0, repetition_penalty=1.3))
    assert _tokens(llm, None) == want
    assert _tokens(llm, [SamplingParams(), SamplingParams(), SamplingParams(max_tokens=16)]) == want
    assert _tokens(plain, SamplingParams(temperature=0.0)) != want  # the penalty was applied


def test_a_bad_generation_config_names_the_file(folder, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(folder, bad)
    with open(os.path.join(bad, "generation_config.json"), "w") as f:
        json.dump({"top_p": 5}, f)
    with pytest.raises(ValueError, match=r"generation_config\.json: .*top_p"):
        LLM(bad, skip_tokenizer_init=True, max_num_seqs=2, block_size=16, max_model_len=64)
    with pytest.raises(ValueError, match="no generation_config.json"):
        LLM(folder, generation_config=str(tmp_path), skip_tokenizer_init=True, max_num_seqs=2, block_size=16,
            max_model_len=64)
