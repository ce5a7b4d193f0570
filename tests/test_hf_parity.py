"""Greedy tokens and prefill logits against transformers on random-weight models of each family."""

import numpy as np
import paddle
import pytest
import torch

from fdlite import LLM, SamplingParams
from fdlite.runner.sequence import Sequence
from hf_models import load_reference, reference_greedy, reference_last_logits

MAX_NEW = 12


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [1, 2, 15, 16, 17, 63, 64, 65, 300, 299, 128, 129]
    lengths += rng.integers(1, 301, size=n - len(lengths)).tolist()
    return [rng.integers(3, 512, size=int(n_)).tolist() for n_ in lengths]


# Fixed per family (not hash(family): Python salts str hashes per process, so a failure could not be rerun).
PROMPT_SEEDS = {"qwen2": 101, "qwen3": 202, "llama": 303}


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_greedy_matches_transformers(model_dirs, family):
    prompts = mixed_prompts(32, seed=PROMPT_SEEDS[family])
    # 8 sequences at a time out of 32, 16-token blocks: sequences join and leave mid-flight and
    # prompts cross block boundaries; max_num_batched_tokens lets several prefills share a step.
    llm = LLM(model_dirs[family], skip_tokenizer_init=True, max_num_seqs=8, block_size=16,
              max_model_len=512, max_num_batched_tokens=1024)
    schedule = []  # one list of ScheduledRow per step
    llm.engine.schedule_listeners.append(schedule.append)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    ref = reference_greedy(load_reference(model_dirs[family]), prompts, MAX_NEW)
    got = [o.outputs[0].token_ids for o in outs]
    assert [o.prompt_token_ids for o in outs] == prompts  # input order kept
    mismatched = [i for i, (a, b) in enumerate(zip(got, ref)) if a != b]
    assert not mismatched, f"{family}: prompts {mismatched} differ from transformers"
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    # Continuous batching really happened: more steps than one wave, fewer than one request at a time.
    assert llm.engine.num_steps < len(prompts) * MAX_NEW
    assert len(schedule) == llm.engine.num_steps
    assert max(len(step) for step in schedule) == 8  # the batch fills up to max_num_seqs
    # Every request joined once, computed its prompt, then decoded MAX_NEW - 1 tokens one per step.
    for i, p in enumerate(prompts):
        rows = [r for step in schedule for r in step if r.request_index == i]
        assert sum(r.joined for r in rows) == 1 and rows[0].joined
        assert sum(r.num_tokens for r in rows if not r.decode) == len(p)
        assert [r.num_tokens for r in rows if r.decode] == [1] * (MAX_NEW - 1)
    # Requests joined a batch that was decoding others (not in static waves): mixed prefill + decode steps.
    mixed = [step for step in schedule if any(r.joined for r in step) and any(r.decode for r in step)]
    joined_mid_flight = sum(r.joined for step in mixed for r in step)
    # (5 such steps and 17-18 requests here; static waves would have none.)
    assert len(mixed) >= 3 and joined_mid_flight >= len(prompts) // 3, (len(mixed), joined_mid_flight)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_prefill_logits_match_transformers(model_dirs, family):
    llm = LLM(model_dirs[family], skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_model_len=512)
    ref_model = load_reference(model_dirs[family])
    prompts = mixed_prompts(12, seed=7)[:4]  # lengths 1, 2, 15, 16 ... plus one batch of all four
    seqs = []
    for p in prompts:
        seq = Sequence(0, 0, p, SamplingParams(temperature=0), seed=0)
        llm.engine.allocator.grow(seq.block_table, len(p))
        llm.engine.input_batch.add(seq)
        seq.num_computed_tokens = len(p)  # scheduled: the scheduler counts the step's tokens as computed
        seqs.append(seq)
    step = llm.engine.input_batch.prepare_inputs([(s, s.num_tokens) for s in seqs])
    logits = llm.runner.forward(step.flat).numpy()
    for seq, row in zip(step.sample_seqs, logits):
        ref = reference_last_logits(ref_model, seq.prompt_token_ids).numpy()
        np.testing.assert_allclose(row, ref, rtol=1e-4, atol=1e-4)
    for s in seqs:
        llm.engine.input_batch.remove(s)
        llm.engine.allocator.free(s.block_table)


def test_logprobs_are_the_reference_log_softmax(model_dirs):
    llm = LLM(model_dirs["qwen3"], skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_model_len=512)
    prompt = mixed_prompts(12, seed=3)[5]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    ref = torch.log_softmax(reference_last_logits(load_reference(model_dirs["qwen3"]), prompt), -1)
    top = torch.topk(ref, 5)
    entry = out.logprobs[0]
    assert set(entry) == set(top.indices.tolist())
    for rank, (tid, val) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
        assert entry[tid].rank == rank
        assert abs(entry[tid].logprob - val) < 1e-4
    assert abs(out.cumulative_logprob - top.values[0].item()) < 1e-4
