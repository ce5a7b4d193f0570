"""SamplingParams: vLLM defaults, validation messages, normalisation, from_dict, help texts."""

from dataclasses import fields

import numpy as np
import pytest

from fdlite.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, 0.0, 0.0, 1.0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == ([], [], False)
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (16, 0, None)
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert not p.is_greedy and not p.has_penalties


def test_error_message_format():
    with pytest.raises(ValueError) as e:
        SamplingParams(temperature=-1.0)
    assert str(e.value) == "SamplingParams.temperature must be >= 0, got -1.0"


INVALID = [
    ("n", 0), ("n", 1.5), ("n", True), ("n", "2"),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", "0.1"),
    ("frequency_penalty", -3), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", None),
    ("temperature", -0.1), ("temperature", "0.7"), ("temperature", float("inf")), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("top_k", -2), ("top_k", 2.0), ("top_k", False),
    ("min_p", -0.1), ("min_p", 1.5),
    ("seed", 1.5), ("seed", "42"), ("seed", True),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", 5), ("stop", ["a", 3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]), ("stop_token_ids", 7), ("stop_token_ids", [1.0]),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 3.0),
    ("min_tokens", -1), ("min_tokens", 17),  # 17 > default max_tokens 16
    ("logprobs", -1), ("logprobs", 2.5), ("logprobs", True),
    ("skip_special_tokens", 0), ("include_stop_str_in_output", None),
]


@pytest.mark.parametrize("name,value", INVALID)
def test_invalid_value_names_field_and_value(name, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{name: value})
    msg = str(e.value)
    assert f"SamplingParams.{name}" in msg
    # The offending value appears too (for lists, the offending element).
    shown = value[-1] if isinstance(value, list) else value
    assert repr(shown) in msg or repr(float(shown)) in msg


def test_min_tokens_may_equal_max_tokens_and_is_free_without_max():
    assert SamplingParams(min_tokens=5, max_tokens=5).min_tokens == 5
    assert SamplingParams(min_tokens=1000, max_tokens=None).max_tokens is None


def test_valid_edges_and_normalisation():
    p = SamplingParams(
        n=np.int64(3), top_k=-1, top_p=1.0, temperature=0, repetition_penalty=2, min_p=1,
        presence_penalty=-2, frequency_penalty=2, stop="###", stop_token_ids=(7, np.int32(9)), seed=-3, logprobs=0,
    )
    assert p.n == 3 and type(p.n) is int
    assert p.stop == ["###"] and p.stop_token_ids == [7, 9] and all(type(t) is int for t in p.stop_token_ids)
    assert isinstance(p.temperature, float) and isinstance(p.repetition_penalty, float)
    assert p.is_greedy and p.has_penalties


def test_is_greedy_threshold():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], stop_token_ids=[1], seed=5)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("b")
    q.stop_token_ids.append(2)
    assert p.stop == ["a"] and p.stop_token_ids == [1]


def test_from_dict_roundtrip_and_unknown_key():
    p = SamplingParams.from_dict({"temperature": 0.5, "top_k": 20, "stop": "END", "max_tokens": None})
    assert (p.temperature, p.top_k, p.stop, p.max_tokens) == (0.5, 20, ["END"], None)
    assert SamplingParams.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="unknown sampling option 'temprature'"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(ValueError, match="SamplingParams.top_p"):
        SamplingParams.from_dict({"top_p": 0})
    with pytest.raises(ValueError, match="mapping"):
        SamplingParams.from_dict(["temperature", 0.5])


def test_every_field_has_one_line_help():
    helps = SamplingParams.help()
    assert list(helps) == [f.name for f in fields(SamplingParams)]
    for name, text in helps.items():
        assert text and "\n" not in text, name
