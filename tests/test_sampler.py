"""Sampler: filtering vs a numpy reference, greedy, seeding, distribution, min_tokens, logprobs."""

import numpy as np
import paddle
import pytest

from fdlite.sample.random import sequence_seed
from fdlite.sample.sampler import SamplerOutput, apply_penalties
from fdlite.sampling_params import SamplingParams
from sampling_helpers import RowSampler, SamplingRow, rows_to_batch

V = 64
EOS = {3}
FALLBACK_SEED = 1234


@pytest.fixture
def sampler():
    return RowSampler()  # a Sampler that also takes SamplingRow lists (tests/sampling_helpers.py)


def row(prompt=(5, 6, 7), output=(), seed=None, child=0, fallback=None, **params):
    fallback = fallback or np.random.default_rng(FALLBACK_SEED)
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), sequence_seed(seed, child, fallback))


def tensor(x):
    return paddle.to_tensor(np.asarray(x, dtype=np.float32))


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def softmax(x):
    return np.exp(log_softmax(x))


# --- numpy reference of steps (b), (c), (e) ------------------------------------------------------


def reference_probs(logits, r: SamplingRow, eos=EOS):
    """The distribution vLLM would sample from, in float64; plus the smallest distance of any
    token to a top-p / min-p decision boundary (to skip float32-ambiguous cases)."""
    p = r.params
    x = np.asarray(logits, dtype=np.float64).copy()
    if len(r.output_token_ids) < p.min_tokens:
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        x[list(stops)] = -np.inf
    seen = sorted(set(r.prompt_token_ids) | set(r.output_token_ids))
    x[seen] = np.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
    counts = np.bincount(np.asarray(r.output_token_ids, dtype=np.int64), minlength=len(x))
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    margin = np.inf
    if p.is_greedy:
        out = np.zeros_like(x)
        out[np.argmax(x)] = 1.0
        return out, margin
    x /= p.temperature
    if p.top_k > 0:
        kth = np.sort(x)[::-1][p.top_k - 1]
        x[x < kth] = -np.inf
    if p.top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        probs = softmax(x)[order]
        before = np.cumsum(probs) - probs
        x[order[before >= p.top_p]] = -np.inf
        margin = min(margin, np.abs(before - p.top_p).min())
    if p.min_p > 0.0:
        probs = softmax(x)
        floor = p.min_p * probs.max()
        x[probs < floor] = -np.inf
        margin = min(margin, np.abs(probs - floor).min() / probs.max())
    return softmax(x), margin


PARAM_CASES = [
    dict(),
    dict(temperature=0.0),
    dict(temperature=0.7),
    dict(temperature=1.5, top_k=5),
    dict(top_k=1),
    dict(top_k=-1, top_p=0.9),
    dict(top_p=0.3),
    dict(temperature=0.8, top_k=20, top_p=0.8),
    dict(top_k=30, top_p=0.95, min_p=0.1),
    dict(min_p=0.05),
    dict(temperature=2.0, min_p=0.3),
    dict(repetition_penalty=1.5),
    dict(repetition_penalty=0.7, temperature=0.9, top_k=10),
    dict(frequency_penalty=0.8, presence_penalty=-0.5),
    dict(frequency_penalty=-1.0, presence_penalty=1.5, repetition_penalty=1.2, top_p=0.7, min_p=0.02),
    dict(min_tokens=5, stop_token_ids=[9, 10]),
    dict(min_tokens=5, stop_token_ids=[9], ignore_eos=True, temperature=0.0),
    dict(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0),
]


def test_filters_match_numpy_reference(sampler):
    rng = np.random.default_rng(0)
    checked = 0
    for trial in range(6):
        rows = [
            row(prompt=rng.integers(0, V, 12), output=rng.integers(0, V, 3 + trial), **params)
            for params in PARAM_CASES
        ]
        logits = rng.normal(0.0, 3.0, size=(len(rows), V))
        got = sampler.probs(tensor(logits), rows, EOS).numpy()
        for i, r in enumerate(rows):
            want, margin = reference_probs(logits[i], r)
            if margin < 1e-4:  # a token sits on a top-p / min-p boundary: float32 may round either way
                continue
            checked += 1
            np.testing.assert_array_equal(got[i] > 0, want > 0, err_msg=f"support differs for {PARAM_CASES[i]}")
            np.testing.assert_allclose(got[i], want, atol=2e-5, err_msg=f"probs differ for {PARAM_CASES[i]}")
    assert checked >= 0.9 * 6 * len(PARAM_CASES)


def test_penalties_by_hand():
    logits = np.asarray([[2.0, -2.0, 1.0, 0.5]], np.float32)
    r = row(prompt=[0], output=[1, 1, 2], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.1)
    got = apply_penalties(logits, rows_to_batch([r], EOS, 4))[0]
    # token 0: prompt only -> 2 / 2. token 1: -2 * 2 - 0.5 * 2 - 0.1. token 2: 1 / 2 - 0.5 - 0.1.
    np.testing.assert_allclose(got, [1.0, -5.1, -0.1, 0.5], rtol=1e-6)


def test_greedy_is_argmax_on_fast_and_full_paths(sampler):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, V))
    want = logits.argmax(axis=1).tolist()
    fast = sampler(tensor(logits), [row(temperature=0.0, seed=i) for i in range(8)], EOS)
    full = sampler(tensor(logits), [row(temperature=0.0, logprobs=2) for _ in range(8)], EOS)
    assert isinstance(fast, SamplerOutput)
    assert fast.token_ids == want == full.token_ids
    assert fast.logprobs == [None] * 8
    # Without logprobs nothing is reported (no full-vocabulary log-softmax on the greedy path).
    assert fast.sampled_logprobs == [None] * 8
    raw = log_softmax(logits)
    np.testing.assert_allclose(full.sampled_logprobs, raw[np.arange(8), want], atol=1e-5)


def test_top_k_1_equals_greedy(sampler):
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(16, V))
    rows = [row(top_k=1, temperature=1.3, fallback=np.random.default_rng(i)) for i in range(16)]
    assert sampler(tensor(logits), rows, EOS).token_ids == logits.argmax(axis=1).tolist()


def _generate(sampler, target: SamplingRow, others: list[SamplingRow], steps: int, seed: int) -> list[int]:
    """Run `steps` steps with fresh random logits; return the target row's tokens.

    The target's logits depend only on the step (and `seed`), not on the batch.
    """
    target_rng = np.random.default_rng(seed)
    noise_rng = np.random.default_rng(seed + 1)
    tokens = []
    for _ in range(steps):
        batch = [target] + others
        logits = np.concatenate([target_rng.normal(size=(1, V)), noise_rng.normal(size=(len(others), V))])
        out = sampler(tensor(logits), batch, EOS)
        tokens.append(out.token_ids[0])
        for r, t in zip(batch, out.token_ids):
            r.output_token_ids.append(t)
    return tokens


def test_seeded_row_is_independent_of_its_batch(sampler):
    params = dict(seed=42, temperature=0.9, top_p=0.95, top_k=40, repetition_penalty=1.1)
    alone = _generate(sampler, row(**params), [], steps=20, seed=7)
    rng = np.random.default_rng(99)
    others = [
        row(
            seed=int(rng.integers(1000)) if i % 2 else None,
            temperature=float(rng.choice([0.0, 0.5, 1.0, 1.5])),
            top_k=int(rng.choice([0, 5, 50])),
            top_p=float(rng.choice([1.0, 0.8])),
            min_p=float(rng.choice([0.0, 0.1])),
            presence_penalty=float(rng.choice([0.0, 0.5])),
            logprobs=int(rng.choice([0, 3])) if i % 3 == 0 else None,
            fallback=np.random.default_rng(i),
        )
        for i in range(16)
    ]
    batched = _generate(sampler, row(**params), others, steps=20, seed=7)
    assert batched == alone


def test_different_seeds_and_children_differ(sampler):
    flat = dict(temperature=1.0)
    runs = [
        _generate(sampler, row(seed=1, **flat), [], steps=20, seed=3),
        _generate(sampler, row(seed=2, **flat), [], steps=20, seed=3),
        _generate(sampler, row(seed=1, child=1, **flat), [], steps=20, seed=3),
    ]
    assert runs[0] != runs[1] and runs[0] != runs[2]
    assert runs[0] == _generate(sampler, row(seed=1, **flat), [], steps=20, seed=3)


def test_sequence_seed():
    fallback = np.random.default_rng(0)
    a, b = sequence_seed(None, 0, fallback), sequence_seed(None, 0, fallback)
    assert a != b  # unseeded: independent streams
    assert sequence_seed(5, 2, fallback) == sequence_seed(5, 2, np.random.default_rng(9))
    assert sequence_seed(5, 0, fallback) != sequence_seed(5, 1, fallback)
    # Negative seeds are accepted and fold into uint64 range: -k is the seed 2**64 - k, not k.
    for seed in (-1, -1234):
        assert sequence_seed(seed, 0, fallback) == sequence_seed(seed + 2**64, 0, fallback)
        assert sequence_seed(seed, 0, fallback) != sequence_seed(-seed, 0, fallback)


def _chi_square(counts, probs):
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token with zero probability"
    expected = n * probs[support]
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


# The last three draw top-p / min-p by rejection over the whole vocabulary (no top-k).
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=6, top_p=0.9),
                                    dict(temperature=0.9, top_p=0.6), dict(top_p=0.3, min_p=0.05),
                                    dict(temperature=1.2, min_p=0.2)])
def test_empirical_distribution_matches(sampler, params):
    vocab, draws = 10, 5000
    logits = np.random.default_rng(5).normal(size=vocab)
    fallback = np.random.default_rng(11)
    # One step over a batch of 5,000 copies of the same row: one draw each, independent generators.
    rows = [row(fallback=fallback, **params) for _ in range(draws)]
    out = sampler(tensor(np.tile(logits, (draws, 1))), rows, EOS)
    counts = np.bincount(out.token_ids, minlength=vocab)
    want, _ = reference_probs(logits, rows[0])
    stat, dof = _chi_square(counts, want)
    # 99.9% quantile of chi-square is < 3.5 * dof + 10 for dof <= 9 (e.g. 27.9 at dof 9).
    assert stat < 3.5 * dof + 10, (stat, dof, counts, want)


def test_min_tokens_masks_eos_and_stop_ids(sampler):
    logits = np.zeros((4, V))
    logits[:, 3] = 50.0  # EOS
    logits[:, 9] = 40.0  # a stop token id
    logits[:, 20] = 30.0
    rows = [
        row(output=[1, 2], min_tokens=3, stop_token_ids=[9], temperature=0.0),  # too short: neither
        row(output=[1, 2, 4], min_tokens=3, stop_token_ids=[9], temperature=0.0, logprobs=0),  # long enough: EOS
        row(output=[1], min_tokens=3, stop_token_ids=[9], ignore_eos=True, temperature=0.0),  # EOS not a stop
        row(output=[1], min_tokens=3, stop_token_ids=[9], seed=0),  # random rows too
    ]
    out = sampler(tensor(logits), rows, EOS)
    assert out.token_ids == [20, 3, 3, 20]
    # The reported logprob is still the raw one (EOS is by far the most likely token).
    assert out.sampled_logprobs[1] == pytest.approx(log_softmax(logits[1])[3], abs=1e-5)


def test_logprobs_topk_ranks_and_raw_values(sampler):
    rng = np.random.default_rng(8)
    logits = rng.normal(0.0, 2.0, size=(5, V))
    rows = [
        row(logprobs=3, seed=1),
        row(logprobs=5, temperature=0.0),  # sampled token is the top-1: k entries
        row(logprobs=0, seed=2, top_k=10),  # only the sampled token
        row(logprobs=4, seed=3, temperature=0.5, repetition_penalty=1.5, output=[1, 2]),  # still raw values
        row(logprobs=None, seed=4),
    ]
    out = sampler(tensor(logits), rows, EOS)
    raw = log_softmax(logits)
    assert out.logprobs[4] is None
    for i, r in enumerate(rows[:4]):
        k, d, tok = r.params.logprobs, out.logprobs[i], out.token_ids[i]
        order = np.argsort(-raw[i]).tolist()
        assert tok in d and len(d) in (k, k + 1)
        assert set(order[:k]) <= set(d)
        for t, lp in d.items():
            assert lp.logprob == pytest.approx(raw[i, t], abs=1e-5)
            assert lp.rank == order.index(t) + 1
        assert out.sampled_logprobs[i] == pytest.approx(raw[i, tok], abs=1e-5)
    assert len(out.logprobs[1]) == 5 and len(out.logprobs[2]) == 1


def test_rejects_mismatched_batch(sampler):
    with pytest.raises(ValueError, match="logits must be"):
        sampler(tensor(np.zeros((2, V))), [row()], EOS)
