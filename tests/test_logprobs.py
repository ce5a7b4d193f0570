"""Logprobs and prompt logprobs: the numbers against torch's log-softmax of transformers' logits, through chunked
prefill, prefix caching, preemption, async scheduling and the emulated GPU path (one device-to-host copy per
sampler call, holding ids and [rows, 2 + 2k] numbers only)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import gpu_emulator
from fdlite import LLM, SamplingParams
from fdlite.sample import sampler_gpu
from fdlite.sample.logprobs import LogprobsList, compute_logprobs
from hf_models import load_reference

COMMON = dict(skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_model_len=256)


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 500, 40).tolist()  # two full blocks and a bit: a prefix the cache could serve
    out = [rng.integers(3, 500, n).tolist() for n in (1, 2, 17, 70, 130)]
    out += [shared + rng.integers(3, 500, 9).tolist(), shared + rng.integers(3, 500, 30).tolist()]
    return out


def _reference(model, ids: list[int]) -> np.ndarray:
    """float64 log-softmax of transformers' fp32 logits at every position of ids."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def _check_entry(entry: dict, ref_row: np.ndarray, token: int, k: int) -> None:
    """One position's dict: the token's logprob and rank, and the top-k, against the reference row."""
    assert token in entry and len(entry) in (k, k + 1)
    lp = entry[token]
    assert abs(lp.logprob - ref_row[token]) < 1e-4
    assert (ref_row > ref_row[token] + 1e-6).sum() + 1 <= lp.rank <= (ref_row >= ref_row[token] - 1e-6).sum()
    top = sorted(((v, t) for t, v in entry.items() if v.rank <= k), key=lambda e: e[0].rank)
    assert [v.rank for v, _ in top] == list(range(1, k + 1))
    for v, t in top:
        assert abs(v.logprob - ref_row[t]) < 1e-4
    want = np.argsort(-ref_row, kind="stable")[:k]
    kth = ref_row[want[-1]] if k else np.inf
    # The same top-k as the reference, apart from tokens within a hair of its k-th value.
    assert {t for _, t in top if ref_row[t] > kth + 1e-5} == {int(t) for t in want if ref_row[t] > kth + 1e-5}


def test_compute_logprobs_is_the_log_softmax_with_ranks_and_lowest_id_ties():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 300)).astype(np.float32)
    x[1, [7, 50, 90, 200]] = 9.0  # a four-way tie at the top: top-3 keeps the three lowest ids
    x[2, 11] = np.nan  # NaN counts as -inf
    targets = np.array([3, 90, 11, 299, 0])
    res = compute_logprobs(x, targets, 3)
    clean = np.where(np.isnan(x), -np.inf, x)
    ref = torch.log_softmax(torch.tensor(clean, dtype=torch.float64), -1).numpy()
    for r in range(5):
        t = targets[r]
        assert res.token_ids[r] == t
        assert res.ranks[r] == (clean[r] >= clean[r, t]).sum()
        order = sorted(range(300), key=lambda v: (-clean[r, v], v))[:3]
        assert res.top_ids[r].tolist() == order
        np.testing.assert_allclose(res.top_logprobs[r], ref[r, order], atol=1e-6)
        if np.isfinite(ref[r, t]):
            assert abs(res.logprobs[r] - ref[r, t]) < 1e-6
        else:
            assert res.logprobs[r] == -np.inf and res.ranks[r] == 300
    assert res.top_ids[1].tolist() == [7, 50, 90] and res.ranks[1] == 4


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_prompt_and_sample_logprobs_match_transformers(model_dirs, family):
    prompts = _prompts(seed={"qwen2": 1, "qwen3": 2, "llama": 3}[family])
    # A 32-token step budget: the long prompts are prefilled in chunks, and the shared prefix is in the cache by
    # the time the last prompts arrive.
    llm = LLM(model_dirs[family], max_num_batched_tokens=32, **COMMON)
    asks = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3, prompt_logprobs=4)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    # The last prompt also comes once without prompt_logprobs: it may take the shared prefix from the cache.
    ps = [{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": prompts[-1]}]
    outs = llm.generate(ps, [asks] * len(prompts) + [plain], use_tqdm=False)
    model = load_reference(model_dirs[family])
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        ref = _reference(model, p + c.token_ids)
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        for i in range(1, len(p)):
            _check_entry(o.prompt_logprobs[i], ref[i - 1], p[i], 4)
        assert len(c.logprobs) == len(c.token_ids) == 3
        for j, t in enumerate(c.token_ids):
            _check_entry(c.logprobs[j], ref[len(p) - 1 + j], t, 3)
        assert abs(c.cumulative_logprob - sum(ref[len(p) - 1 + j, t] for j, t in enumerate(c.token_ids))) < 1e-3
        assert o.metrics["num_cached_tokens"] == 0  # prompt logprobs need every prompt token's forward
    assert outs[-1].prompt_logprobs is None and outs[-1].metrics["num_cached_tokens"] >= 32
    assert outs[-1].outputs[0].token_ids == outs[-2].outputs[0].token_ids


def test_prompt_logprobs_are_the_same_under_preemption_async_scheduling_and_n2(model_dirs):
    prompts = _prompts(seed=4)[2:]
    kw = dict(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    params = SamplingParams(**kw)
    ps = [{"prompt_token_ids": p} for p in prompts]
    want = LLM(model_dirs["qwen2"], **COMMON).generate(ps, params, use_tqdm=False)
    # 12 blocks of 16 tokens for 4 running sequences of up to 170 tokens: they preempt one another.
    tight = LLM(model_dirs["qwen2"], num_gpu_blocks_override=12, max_num_batched_tokens=64,
                **{**COMMON, "max_model_len": 192})
    got = tight.generate(ps, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    asynch = LLM(model_dirs["qwen2"], async_scheduling=True, max_num_batched_tokens=48, **COMMON)
    got_async = asynch.generate(ps, params, use_tqdm=False)
    two = LLM(model_dirs["qwen2"], **COMMON).generate(ps, SamplingParams(**kw, n=2), use_tqdm=False)
    for w, g, a, t in zip(want, got, got_async, two):
        for other in (g, a, t):
            assert len(other.prompt_logprobs) == len(w.prompt_logprobs)
            for x, y in zip(other.prompt_logprobs[1:], w.prompt_logprobs[1:]):
                assert x.keys() == y.keys()
                assert all(abs(x[k].logprob - y[k].logprob) < 1e-4 and x[k].rank == y[k].rank for k in x)
        assert g.outputs[0].token_ids == a.outputs[0].token_ids == w.outputs[0].token_ids


def test_emulated_gpu_logprobs_equal_the_cpu_in_one_copy_per_sampler_call(model_dirs, monkeypatch):
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=20, repetition_penalty=1.5,
                             prompt_logprobs=3),
              SamplingParams(temperature=0.9, seed=3, max_tokens=5, ignore_eos=True, logprobs=2, min_tokens=3),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={5: 4.0}),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0, prompt_logprobs=0)]
    ps = [{"prompt_token_ids": p} for p in _prompts(seed=5)[2:6]]
    want = LLM(model_dirs["qwen3"], max_num_batched_tokens=64, **COMMON).generate(ps, params, use_tqdm=False)
    calls = gpu_emulator.install_engine(monkeypatch)
    llm = LLM(model_dirs["qwen3"], max_num_batched_tokens=64, **COMMON)
    copies, entered = [], {"sampler": 0, "prompt": 0}
    to_host = gpu_emulator.to_host
    monkeypatch.setattr(gpu_emulator.gpu_ops, "to_host", lambda x: copies.append(to_host(x)) or copies[-1])
    for name, attr in (("sampler", "__call__"), ("prompt", None)):
        owner = sampler_gpu.GpuSampler if attr else sampler_gpu
        real = getattr(owner, attr or "logprobs_of")

        def counted(*a, _real=real, _name=name):
            entered[_name] += 1
            return _real(*a)
        monkeypatch.setattr(owner, attr or "logprobs_of", counted)
    got = llm.generate(ps, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for gs, ws in ((g.outputs[0].logprobs, w.outputs[0].logprobs), (g.prompt_logprobs, w.prompt_logprobs)):
            assert (gs is None) == (ws is None)
            for x, y in zip(gs or [], ws or []):
                assert (x is None) == (y is None)
                if x is not None:
                    assert x.keys() == y.keys()
                    assert all(abs(x[t].logprob - y[t].logprob) < 1e-5 and x[t].rank == y[t].rank for t in x)
    # One copy to the host per sampler call (the ids, and the logprob rows' records) and one per chunk of prompt
    # logprobs: int32 ids and records of at most 2 + 2 * 20 numbers per row, never a row of logits.
    assert entered["sampler"] > 0 and entered["prompt"] > 0
    assert len(copies) == entered["sampler"] + entered["prompt"]
    assert all(c.dtype == np.int32 and c.size <= 4 * (1 + 2 + 2 * 20) for c in copies)
    assert calls["logprobs"] > entered["prompt"]  # the sampler's rows asking for logprobs used the kernel too


def test_logprobs_above_max_logprobs_fail_that_request_only(model_dirs):
    llm = LLM(model_dirs["qwen2"], max_logprobs=5, **COMMON)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3,
                        [SamplingParams(max_tokens=2, logprobs=6), SamplingParams(max_tokens=2, prompt_logprobs=9),
                         SamplingParams(max_tokens=2, logprobs=5)], use_tqdm=False)
    assert "logprobs=6 is more than max_logprobs=5" in outs[0].error
    assert "prompt_logprobs=9 is more than max_logprobs=5" in outs[1].error
    assert outs[2].error is None and len(outs[2].outputs[0].logprobs) == 2
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(model_dirs["qwen2"], max_logprobs=21, **COMMON)


def test_logprobs_list_reads_compares_and_pickles_as_a_list():
    x = np.random.default_rng(1).normal(size=(3, 50)).astype(np.float32)
    t = compute_logprobs(x, np.array([4, 5, 6]), 2)
    lst = LogprobsList(decode=lambda tok: f"<{tok}>", leading_none=True)
    lst.extend_rows(t, 2)
    assert len(lst) == 4 and lst[0] is None and lst[-1] == lst[3]
    assert lst[1][4].decoded_token == "<4>" and len(lst[1:3]) == 2
    plain = pickle.loads(pickle.dumps(lst))
    assert type(plain) is list and plain == lst and lst == plain
    with pytest.raises(IndexError):
        lst[4]


@pytest.mark.parametrize("vocab", [7, 1000, 4097])
def test_top_k_matches_a_full_sort_through_ties_and_masked_rows(vocab):
    """The CPU top-k screens candidates by block maxima: against a full sort (value descending, then id) on rows
    with heavy ties, -inf runs, NaN, an all -inf row, and k beyond the block count."""
    rng = np.random.default_rng(vocab)
    x = np.round(rng.standard_normal((6, vocab)) * 2).astype(np.float32)  # integers: many ties
    x[1, : vocab // 2] = -np.inf
    x[2, 3] = np.nan
    x[3, :] = -np.inf
    x[4, -1] = 40.0
    for k in (1, 5, 20):
        got = compute_logprobs(x, np.zeros(6, np.int64), k).top_ids
        clean = np.where(np.isnan(x), -np.inf, x)
        for r in range(6):
            want = sorted(range(vocab), key=lambda v: (-clean[r, v], v))[: min(k, vocab)]
            assert got[r].tolist() == want, (r, k)
