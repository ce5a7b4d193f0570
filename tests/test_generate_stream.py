"""`LLM.generate_stream`: results arrive as each request finishes, and `generate` is built on it."""

import pytest

from fdlite import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4, max_model_len=128)


def test_results_come_in_finish_order_with_their_index(llm):
    lengths = [12, 2, 7, 4, 9]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    prompts = ["a b c", "d e", "f", "g h i j", "k"]
    got = list(llm.generate_stream(prompts, params, use_tqdm=False))
    # All five fit one batch and start together, so they finish shortest first.
    assert [i for i, _ in got] == sorted(range(5), key=lambda i: lengths[i])
    for i, out in got:
        assert out.prompt == prompts[i] and len(out.outputs[0].token_ids) == lengths[i]
    # generate() returns the same results, in input order.
    batch = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch] == [dict(got)[i].outputs[0].token_ids for i in range(5)]


def test_failed_requests_come_first(llm):
    got = list(llm.generate_stream(["hello", "", "x " * 200], SamplingParams(temperature=0, max_tokens=3),
                                   use_tqdm=False))
    assert [i for i, _ in got[:2]] == [1, 2]
    assert got[0][1].error == "prompt is empty" and "max_model_len=128" in got[1][1].error
    assert got[2][0] == 0 and got[2][1].error is None


def test_bad_arguments_raise_before_iteration(llm):
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate_stream(["a"], [SamplingParams(), SamplingParams()])


def test_stopping_early_leaves_the_engine_empty(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    stream = llm.generate_stream(["one", "two", "three", "four", "five", "six"], params, use_tqdm=False)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.allocator.num_free_blocks == llm.num_blocks
    alone = llm.generate("two", params, use_tqdm=False)[0]
    assert len(alone.outputs[0].token_ids) == 6
