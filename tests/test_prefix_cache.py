"""Prefix caching: the allocator's hashing, reference counts and LRU, then end to end on the
transformers-checked models: same tokens with caching on and off, the hit rate of a shared-prefix
batch, and (with freed blocks poisoned) no read of a block the cache let go of."""

import numpy as np
import pytest

from fdlite import LLM, SamplingParams
from fdlite.kvcache.block_allocator import BlockAllocator
from fdlite.kvcache.prefix_cache import ROOT_HASH, hash_block
from fdlite.runner.sequence import Sequence
from hf_models import load_reference, reference_greedy

BS = 4


def seq_of(tokens):
    return Sequence(0, 0, list(tokens), SamplingParams(), np.random.default_rng(0))


def run_prefill(alloc, seq):
    """What the scheduler and engine do for a new sequence whose prompt is computed in one step."""
    hits = alloc.match_prefix(seq)
    alloc.admit(seq, hits, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    alloc.cache_full_blocks(seq)
    return hits


# ---- unit: hashing, reference counts, LRU ------------------------------------------------------

def test_hash_chain_names_the_whole_prefix():
    a = seq_of(range(10, 22))  # 3 full blocks
    b = seq_of(list(range(10, 18)) + [99, 98, 97, 96])  # same first 2 blocks
    c = seq_of([0] + list(range(11, 22)))  # first token differs
    alloc = BlockAllocator(8, BS, enable_prefix_caching=True)
    ha, hb, hc = (alloc.prefix_cache.seq_hashes(s, 3) for s in (a, b, c))
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    assert all(x != y for x, y in zip(ha, hc))  # a change in block 0 changes every later hash
    assert ha[1] == hash_block(hash_block(ROOT_HASH, [10, 11, 12, 13]), [14, 15, 16, 17])
    assert ha[1] != hash_block(ROOT_HASH, [14, 15, 16, 17])  # same block tokens, other parent


def test_shared_blocks_are_reference_counted_and_parked_when_unused():
    alloc = BlockAllocator(8, BS, enable_prefix_caching=True)
    a = seq_of(range(10, 23))  # 13 tokens: 3 full blocks + 1
    assert run_prefill(alloc, a) == []
    b = seq_of(list(range(10, 22)) + [50, 51, 52])  # shares a's 3 full blocks
    hits = run_prefill(alloc, b)
    assert hits == a.block_table[:3] and b.block_table[:3] == hits
    assert [alloc.ref_count(x) for x in hits] == [2, 2, 2]
    assert b.block_table[3] != a.block_table[3]  # the partial last block is never shared
    assert alloc.num_free_blocks == 8 - 5
    alloc.free(a.block_table)
    assert [alloc.ref_count(x) for x in hits] == [1, 1, 1]
    assert alloc.num_free_blocks == 8 - 4 and alloc.prefix_cache.num_evictable == 0
    b_blocks = list(b.block_table)
    alloc.free(b.block_table)
    # Both sequences' full blocks stay cached but count as free; partial blocks went to the free list.
    assert alloc.num_free_blocks == 8 and alloc.prefix_cache.num_evictable == 3
    again = seq_of(list(range(10, 22)) + [7])
    assert alloc.match_prefix(again) == b_blocks[:3]


def test_hit_leaves_the_last_token_to_compute():
    alloc = BlockAllocator(8, BS, enable_prefix_caching=True)
    a = seq_of(range(10, 18))  # exactly 2 full blocks
    run_prefill(alloc, a)
    alloc.free(a.block_table)
    same = seq_of(range(10, 18))
    hits = alloc.match_prefix(same)
    assert len(hits) == 1  # the block with the last token is recomputed into a block of its own
    alloc.admit(same, hits, same.num_tokens)
    alloc.check_writable(same.block_table, 4, 8)  # positions 4..7 go to a private, uncached block
    with pytest.raises(AssertionError):
        alloc.check_writable(same.block_table, 0, 8)


def test_lru_evicts_least_recently_freed_tails_first_and_only_when_needed():
    alloc = BlockAllocator(6, BS, enable_prefix_caching=True)
    a = seq_of(range(100, 109))  # 2 full blocks + 1
    b = seq_of(range(200, 209))
    run_prefill(alloc, a)
    run_prefill(alloc, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    alloc.free(a.block_table)
    alloc.free(b.block_table)
    assert alloc.prefix_cache.num_evictable == 4 and alloc.num_free_blocks == 6
    # Two never-cached free blocks are used before anything is evicted.
    table = []
    alloc.grow(table, 2 * BS)
    assert set(table) == {a_blocks[2], b_blocks[2]} and alloc.prefix_cache.num_evictions == 0
    alloc.grow(table, 3 * BS)  # evicts a's tail: a was freed first, tails go before heads
    assert table[-1] == a_blocks[1] and alloc.prefix_cache.num_evictions == 1
    assert alloc.match_prefix(seq_of(range(100, 109))) == a_blocks[:1]
    assert alloc.match_prefix(seq_of(range(200, 209))) == b_blocks[:2]
    # A hit on a parked block takes it out of the LRU, so it costs a free block.
    c = seq_of(range(200, 209))
    hits = alloc.match_prefix(c)
    assert alloc.num_free_blocks == 3
    assert alloc.can_admit(hits, 3 * BS) and not alloc.can_admit(hits, 5 * BS)
    alloc.admit(c, hits, 3 * BS)
    assert c.block_table == b_blocks[:2] + [a_blocks[0]]  # the last parked block was evicted for it
    assert alloc.num_free_blocks == 0 and alloc.prefix_cache.num_evictions == 2


def test_duplicate_block_stays_uncached_and_reset_needs_idle_cache():
    alloc = BlockAllocator(8, BS, enable_prefix_caching=True)
    a, b = seq_of(range(10, 19)), seq_of(range(10, 19))
    for s in (a, b):  # both computed in the same step: neither found the other's blocks
        alloc.admit(s, alloc.match_prefix(s), s.num_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        alloc.cache_full_blocks(s)
    assert alloc.prefix_cache.num_cached_blocks == 2
    assert not alloc.prefix_cache.is_cached(b.block_table[0])
    assert alloc.reset_prefix_cache() is False  # blocks in use
    alloc.free(a.block_table)
    alloc.free(b.block_table)
    assert alloc.prefix_cache.num_evictable == 2
    assert alloc.reset_prefix_cache() is True
    assert alloc.prefix_cache.num_cached_blocks == 0 and alloc.num_free_blocks == 8
    assert alloc.match_prefix(seq_of(range(10, 19))) == []


# ---- end to end: 100 requests behind one 300-token prefix ----------------------------------------

MAX_NEW = 4
PREFIX = 300
COMMON = dict(skip_tokenizer_init=True, max_num_seqs=16, block_size=16, max_model_len=512)
CONFIGS = {
    # name: (prefix caching, chunked prefill, budget); 200 cuts the prefix mid-block.
    "plain": dict(enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=1024),
    "cache": dict(enable_prefix_caching=True, enable_chunked_prefill=False, max_num_batched_tokens=1024),
    "chunk": dict(enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=200),
    "both": dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=200),
}


def shared_prefix_batch(seed: int, n: int = 100) -> list[list[int]]:
    """n prompts: one 300-token prefix, then suffixes of 5..39 tokens that differ from their first
    token on, so only the prefix is shared."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 512, size=PREFIX).tolist()
    firsts = rng.permutation(np.arange(3, 512))[:n]
    return [prefix + [int(f)] + rng.integers(3, 512, size=int(rng.integers(4, 39))).tolist() for f in firsts]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_shared_prefix_batch_same_tokens_with_caching_and_chunking_on_or_off(model_dirs, family):
    prompts = shared_prefix_batch(seed=len(family))
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    got, stats = {}, {}
    for name, opts in CONFIGS.items():
        llm = LLM(model_dirs[family], **COMMON, **opts)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got[name] = [o.outputs[0].token_ids for o in outs]
        stats[name] = llm.last_generate_stats
        if opts["enable_prefix_caching"]:
            assert sum(o.metrics["num_cached_tokens"] for o in outs) == stats[name]["prefix_cache_hit_tokens"]
    for name in CONFIGS:
        assert got[name] == got["plain"], f"{family}: {name} differs from caching and chunking off"
    subset = [0, 1, 57, 99]
    ref = reference_greedy(load_reference(model_dirs[family]), [prompts[i] for i in subset], MAX_NEW)
    assert [got["both"][i] for i in subset] == ref

    # Over 90% of the shared tokens come from the cache (ceiling: 288 of 300 are in full blocks,
    # and the first request computes them): and only the rest is computed.
    shared = len(prompts) * PREFIX
    total = sum(len(p) for p in prompts)
    for name in ("cache", "both"):
        s = stats[name]
        assert s["prefix_cache_hit_tokens"] > 0.9 * shared, (name, s)
        assert s["prefix_cache_queried_tokens"] == total
        assert s["prefill_tokens_computed"] == total - s["prefix_cache_hit_tokens"]
    assert stats["plain"]["prefill_tokens_computed"] == total
    assert stats["plain"]["prefix_cache_queried_tokens"] == 0


def test_n_children_share_the_prompt_through_the_cache(model_dirs):
    prompt = list(np.random.default_rng(4).integers(3, 512, size=100))
    params = SamplingParams(temperature=0.9, seed=7, n=4, max_tokens=6, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        llm = LLM(model_dirs["qwen3"], enable_prefix_caching=caching, **COMMON)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        outs[caching] = [c.token_ids for c in out.outputs]
    # The first child computes the prompt; the other three wait one step and take its 6 full blocks.
    assert out.metrics["num_cached_tokens"] == 3 * 96
    assert llm.last_generate_stats["prefill_tokens_computed"] == 100 + 3 * 4
    assert outs[True] == outs[False]


def test_reset_prefix_cache(model_dirs):
    llm = LLM(model_dirs["qwen2"], **COMMON)
    prompt = {"prompt_token_ids": list(range(3, 103))}
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    assert second.metrics["num_cached_tokens"] == 96  # 6 full blocks; the last 4 tokens recomputed
    assert llm.reset_prefix_cache() is True
    third = llm.generate(prompt, params, use_tqdm=False)[0]
    assert third.metrics["num_cached_tokens"] == 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == third.outputs[0].token_ids
    # While a request holds blocks the reset is refused and drops nothing.
    seq = seq_of(range(3, 40))
    llm.engine.allocator.grow(seq.block_table, seq.num_tokens)
    assert llm.reset_prefix_cache() is False
    llm.engine.allocator.free(seq.block_table)


def test_finished_outputs_are_cached_like_prompt_tokens(model_dirs):
    """A follow-up prompt that repeats a finished request's prompt and answer (a second chat turn)
    finds the answer's full blocks too."""
    llm = LLM(model_dirs["llama"], **COMMON)
    prompt = list(np.random.default_rng(5).integers(3, 512, size=100))
    first = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    # 129 tokens were computed (the last sampled one never is): 8 full blocks, 2 of them with output.
    follow_up = prompt + first + [7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": follow_up}, params, use_tqdm=False)[0]
    assert out.metrics["num_cached_tokens"] == 128
    plain = LLM(model_dirs["llama"], enable_prefix_caching=False, **COMMON)
    assert out.outputs[0].token_ids == plain.generate({"prompt_token_ids": follow_up}, params,
                                                      use_tqdm=False)[0].outputs[0].token_ids


def test_a_block_is_shared_only_behind_the_same_prefix(model_dirs):
    """End to end: a block's tokens seen before behind another prefix are no hit (its KV depends on all
    the tokens before it); behind the same prefix they are."""
    rng = np.random.default_rng(8)
    x, y, z = (rng.integers(3, 512, size=16).tolist() for _ in range(3))
    first = x + y + z + [5, 6, 7]
    shifted = y + z + [8, 9]  # y and z again, but at the start
    same = x + y + [10, 11]  # x and y again, at the same place
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(model_dirs["qwen3"], **COMMON)
    plain = LLM(model_dirs["qwen3"], enable_prefix_caching=False, **COMMON)
    for prompt, hits in ((first, 0), (shifted, 0), (same, 32)):
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert out.metrics["num_cached_tokens"] == hits
        assert out.outputs[0].token_ids == plain.generate({"prompt_token_ids": prompt}, params,
                                                          use_tqdm=False)[0].outputs[0].token_ids


def test_eviction_under_pressure_keeps_the_head_of_a_chain(model_dirs):
    """End to end: evicting a finished request's tail blocks first leaves its head findable."""
    rng = np.random.default_rng(9)
    a = rng.integers(3, 512, size=100).tolist()  # 6 full blocks + 4 tokens
    b = rng.integers(3, 512, size=130).tolist()  # 9 blocks with its output
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(model_dirs["qwen2"], num_gpu_blocks_override=12, **dict(COMMON, max_model_len=192))
    first = llm.generate({"prompt_token_ids": a}, params, use_tqdm=False)[0]
    # a's 6 full blocks stay cached; 6 blocks are free. b needs 9: 3 of a's are evicted, tails first.
    llm.generate({"prompt_token_ids": b}, params, use_tqdm=False)
    assert llm.last_generate_stats["prefix_cache_evicted_blocks"] == 3
    again = llm.generate({"prompt_token_ids": a}, params, use_tqdm=False)[0]
    assert again.metrics["num_cached_tokens"] == 3 * 16  # a's first 3 blocks, still chained from the root
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_preempted_sequences_find_their_own_blocks_again(model_dirs):
    rng = np.random.default_rng(11)
    prompts = [{"prompt_token_ids": rng.integers(3, 512, size=int(n)).tolist()} for n in rng.integers(90, 200, size=12)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    opts = dict(COMMON, max_num_seqs=8, max_model_len=256)
    expected = LLM(model_dirs["qwen2"], enable_prefix_caching=False, **opts).generate(prompts, params, use_tqdm=False)
    tight = LLM(model_dirs["qwen2"], num_gpu_blocks_override=24, **opts)
    outs = tight.generate(prompts, params, use_tqdm=False)
    s = tight.last_generate_stats
    # The prompts share nothing, so every hit is a preempted sequence taking back its own blocks.
    assert s["num_preemptions"] > 0 and s["prefix_cache_hit_tokens"] > 0, s
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


# ---- poisoned freed blocks: an evicted block is never read ----------------------------------------

def churn_batch(seed: int) -> list[list[int]]:
    """Three prefixes, interleaved, with long distinct tails: a small cache keeps evicting."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, 512, size=int(n)).tolist() for n in (120, 70, 150)]
    return [prefixes[i % 3] + rng.integers(3, 512, size=int(rng.integers(20, 90))).tolist() for i in range(30)]


def test_poisoned_freed_blocks_leave_outputs_unchanged_under_eviction(model_dirs, monkeypatch):
    prompts = [{"prompt_token_ids": p} for p in churn_batch(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    opts = dict(COMMON, max_num_seqs=8, max_num_batched_tokens=160)
    plain = LLM(model_dirs["llama"], enable_prefix_caching=False, enable_chunked_prefill=False,
                **dict(opts, max_num_batched_tokens=512))
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]

    monkeypatch.setenv("FDLITE_DEBUG_POISON_FREED_BLOCKS", "1")
    # 40 blocks of 16 tokens for 8 sequences of up to ~260 tokens: evictions and preemptions.
    llm = LLM(model_dirs["llama"], num_gpu_blocks_override=40, **opts)
    assert llm.engine.debug_poison
    k0 = llm.runner.kv_cache.caches[0][0].numpy()
    assert np.isnan(k0[:-1]).all()  # every block starts unreadable
    outs = llm.generate(prompts, params, use_tqdm=False)
    s = llm.last_generate_stats
    assert s["prefix_cache_evicted_blocks"] > 10 and s["num_preemptions"] > 0 and s["prefix_cache_hit_tokens"] > 0, s
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.allocator.num_free_blocks == 40

    # The poison is visible: make the cache lie about blocks it still names (their KV wiped, as
    # an eviction that forgot to drop the hash would), and the same prompts come out different.
    cache = llm.engine.allocator.prefix_cache
    parked = list(cache._unused)
    assert parked
    llm.runner.kv_cache.poison_blocks(parked)
    lied = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in lied] != expected
