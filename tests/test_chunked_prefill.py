"""Chunked prefill: prompts longer than the step's token budget come out the same as unchunked (and
as transformers), decodes keep running while a long prompt is chunked, FastDeploy's partial-prefill
limits hold at every step, and the option defaults and checks."""

from dataclasses import dataclass

import numpy as np
import pytest

from fdlite import LLM, SamplingParams
from fdlite.config import EngineConfig
from hf_models import load_reference, reference_greedy

COMMON = dict(skip_tokenizer_init=True, block_size=16, max_model_len=512)


@dataclass
class Row:
    seq_id: int
    n: int              # tokens computed this step
    start: int          # num_computed_tokens before the step
    num_tokens: int     # tokens the sequence has
    decode: bool        # a one-token step of a sequence that already has output

    @property
    def partial(self) -> bool:
        return self.start + self.n < self.num_tokens


def record_schedule(llm) -> list[dict]:
    """Wrap the scheduler so each step's rows and partial-prefill counts are kept."""
    sched = llm.engine.scheduler
    steps = []
    inner = sched.schedule

    def schedule():
        batch = inner()
        # Read just after scheduling, which counted the step's tokens as computed and gave each row that
        # samples a placeholder token: undo both to see the sequence as it was before the step.
        rows = []
        for s, n in batch.rows:
            start, tokens = s.num_computed_tokens - n, s.num_tokens - s.num_output_placeholders
            rows.append(Row(s.seq_id, n, start, tokens, n == 1 and tokens > s.num_prompt_tokens and start == tokens - 1))

        steps.append({"rows": rows, "partial": len(sched.partial_prefills),
                      "long_partial": sum(sched.partial_prefills.values()), "waiting": [s.seq_id for s in sched.waiting]})
        return batch

    sched.schedule = schedule
    return steps


def long_prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [150, 230, 310, 97, 65, 64, 400, 12]
    return [rng.integers(3, 512, size=n).tolist() for n in lengths]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_prompts_longer_than_the_budget_same_tokens_chunked_or_not(model_dirs, family):
    prompts = long_prompts(seed=len(family))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = {
        "unchunked": dict(enable_chunked_prefill=False, enable_prefix_caching=False, max_num_batched_tokens=512),
        "chunked": dict(enable_chunked_prefill=True, enable_prefix_caching=False, max_num_batched_tokens=64),
        "chunked+cache": dict(enable_chunked_prefill=True, enable_prefix_caching=True, max_num_batched_tokens=50),
    }
    got = {}
    for name, opts in runs.items():
        llm = LLM(model_dirs[family], max_num_seqs=4, **COMMON, **opts)
        steps = record_schedule(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got[name] = [o.outputs[0].token_ids for o in outs]
        budget = opts["max_num_batched_tokens"]
        assert all(sum(r.n for r in st["rows"]) <= budget for st in steps)
        if opts["enable_chunked_prefill"]:
            assert any(r.partial for st in steps for r in st["rows"])  # prompts really were split
            assert max(st["partial"] for st in steps) == 1  # default max_num_partial_prefills=1
    ref = reference_greedy(load_reference(model_dirs[family]), prompts, 6)
    assert got["unchunked"] == ref
    assert got["chunked"] == ref
    assert got["chunked+cache"] == ref


def test_decodes_keep_running_while_a_long_prompt_is_chunked(model_dirs):
    rng = np.random.default_rng(2)
    short = [rng.integers(3, 512, size=20).tolist() for _ in range(3)]
    long = rng.integers(3, 512, size=450).tolist()
    llm = LLM(model_dirs["qwen3"], max_num_seqs=4, max_num_batched_tokens=64, **COMMON)
    steps = record_schedule(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in short + [long]],
                        [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 3
                        + [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)], use_tqdm=False)
    long_id = max({r.seq_id for st in steps for r in st["rows"]})
    chunks = [(i, r) for i, st in enumerate(steps) for r in st["rows"] if r.seq_id == long_id and not r.decode]
    assert sum(r.n for _, r in chunks) == 450 and len(chunks) >= 450 // 64
    # The first step prefills the short prompts and starts the long one with the 4 tokens left;
    # every later step that carried a chunk of it also advanced the three short decodes, and the
    # chunk took the rest of the budget.
    assert chunks[0][0] == 0 and chunks[0][1].n == 64 - 3 * 20
    for k, (i, r) in enumerate(chunks[1:], start=1):
        decodes = [x for x in steps[i]["rows"] if x.decode]
        assert len(decodes) == 3, (i, steps[i]["rows"])
        assert r.n == 64 - 3 or k == len(chunks) - 1
    ref = reference_greedy(load_reference(model_dirs["qwen3"]), [short[0], long], 4)
    assert outs[0].outputs[0].token_ids[:4] == ref[0] and outs[3].outputs[0].token_ids == ref[1]


def test_partial_prefill_limits_are_honoured(model_dirs):
    rng = np.random.default_rng(9)
    # Two long prompts, then three short ones (<= the threshold of 40) that still need two chunks
    # when the 64-token budget is split between two prefills.
    lengths = [200, 180, 36, 38, 39, 150, 37]
    prompts = [rng.integers(3, 512, size=n).tolist() for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    limits = dict(max_num_partial_prefills=2, max_long_partial_prefills=1, long_prefill_token_threshold=40)
    llm = LLM(model_dirs["qwen2"], max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False,
              **limits, **COMMON)
    steps = record_schedule(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    assert max(st["partial"] for st in steps) == 2
    assert max(st["long_partial"] for st in steps) == 1
    for st in steps:  # recount from the rows, not the scheduler's own bookkeeping
        partial_now = [r for r in st["rows"] if r.partial]
        assert len(partial_now) <= 2
        assert sum(r.num_tokens > 40 for r in partial_now) <= 1
        if len(partial_now) == 2:  # two prefills in flight split the 64-token budget
            assert all(r.n <= 32 for r in partial_now)
    # The second long prompt waited while the short one behind it started.
    first_step = {}
    for i, st in enumerate(steps):
        for r in st["rows"]:
            first_step.setdefault(r.seq_id, i)
    ids = sorted(first_step)
    assert first_step[ids[2]] < first_step[ids[1]]

    plain = LLM(model_dirs["qwen2"], max_num_seqs=8, enable_chunked_prefill=False, enable_prefix_caching=False,
                **COMMON)
    expected = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


def test_defaults_and_checks():
    cfg = EngineConfig()
    assert cfg.enable_prefix_caching and cfg.enable_chunked_prefill
    assert cfg.max_num_batched_tokens == 2048
    assert EngineConfig(max_model_len=32768).max_num_batched_tokens == 2048  # chunks, does not grow
    assert EngineConfig(max_num_seqs=4096).max_num_batched_tokens == 4096
    assert EngineConfig(max_model_len=128, max_num_seqs=4).max_num_batched_tokens == 512  # no more fits a step
    assert EngineConfig(enable_chunked_prefill=False, max_model_len=8192).max_num_batched_tokens == 8192
    assert EngineConfig(max_model_len=32768, max_num_batched_tokens=512).max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        EngineConfig(enable_chunked_prefill=False, max_model_len=4096, max_num_batched_tokens=2048)
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        EngineConfig(max_num_partial_prefills=2, max_long_partial_prefills=3)
    with pytest.raises(ValueError, match="must be a bool"):
        EngineConfig(enable_prefix_caching="yes")
    assert EngineConfig(max_model_len=4096).long_prefill_token_threshold == 163
