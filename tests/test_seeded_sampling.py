"""A seeded request samples the same tokens alone and inside a batch."""

import numpy as np

from fdlite import LLM, SamplingParams


def test_seed_is_independent_of_batch(model_dirs):
    llm = LLM(model_dirs["llama"], skip_tokenizer_init=True, max_num_seqs=8, block_size=16, max_model_len=512)
    rng = np.random.default_rng(5)
    target = {"prompt_token_ids": rng.integers(3, 512, size=37).tolist()}
    seeded = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids

    others = [{"prompt_token_ids": rng.integers(3, 512, size=int(n)).tolist()} for n in rng.integers(1, 200, size=16)]
    prompts = others[:7] + [target] + others[7:]
    params = [SamplingParams(temperature=0.8, max_tokens=int(m), ignore_eos=True) for m in rng.integers(5, 40, size=17)]
    params[7] = seeded
    in_batch = llm.generate(prompts, params, use_tqdm=False)[7].outputs[0].token_ids
    assert in_batch == alone

    reseeded = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=4321, max_tokens=24, ignore_eos=True)
    other_seed = llm.generate(target, reseeded, use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone  # the seed matters

    # A negative seed is its uint64 fold, through the public API too.
    negative = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=-1234, max_tokens=24, ignore_eos=True)
    folded = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=2**64 - 1234, max_tokens=24, ignore_eos=True)
    got = llm.generate([target, target], [negative, folded], use_tqdm=False)
    assert got[0].outputs[0].token_ids == got[1].outputs[0].token_ids != alone


def test_unseeded_sampling_varies_and_n_gives_n_outputs(model_dirs):
    llm = LLM(model_dirs["llama"], skip_tokenizer_init=True, max_num_seqs=8, block_size=16, max_model_len=512)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=1.0, n=4, max_tokens=16,
                                                                       ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
