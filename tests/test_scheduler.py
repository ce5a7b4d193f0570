"""Scheduler unit tests: continuous batching under max_num_seqs and the shared token budget."""

import numpy as np

from fdlite.config import EngineConfig
from fdlite.kvcache.block_allocator import BlockAllocator
from fdlite.runner.scheduler import Scheduler
from fdlite.runner.sequence import Sequence, SequenceStatus
from fdlite.sampling_params import SamplingParams


def make_seq(i: int, prompt_len: int) -> Sequence:
    return Sequence(request_index=i, child_index=0, prompt_token_ids=list(range(3, 3 + prompt_len)),
                    params=SamplingParams(temperature=0, max_tokens=8), seed=i)


def run_step(sched: Scheduler) -> list[tuple[int, int]]:
    """Schedule one step and pretend the model ran it: every caught-up row samples token 7."""
    batch = sched.schedule()
    sampled = [seq for seq, _ in batch.rows if seq.num_output_placeholders]
    sched.update_from_output(batch, sampled, [7] * len(sampled), candidates=[], stop_strings={}, now=0.0)
    return [(seq.request_index, n) for seq, n in batch.rows]


def test_new_prompt_joins_while_others_decode():
    cfg = EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64, block_size=4)
    sched = Scheduler(cfg, BlockAllocator(64, 4))
    a, b, c = make_seq(0, 10), make_seq(1, 5), make_seq(2, 6)
    for s in (a, b, c):
        sched.add(s)
    # Step 1: two prefills fill the batch (max_num_seqs=2); c waits.
    assert run_step(sched) == [(0, 10), (1, 5)]
    # Step 2: both decode.
    assert run_step(sched) == [(0, 1), (1, 1)]
    sched.finish(a, "length")
    assert a.block_table == [] and a.status is SequenceStatus.FINISHED
    # Step 3: b keeps decoding and c's prefill joins in the same step: a mixed batch.
    assert run_step(sched) == [(1, 1), (2, 6)]
    assert not sched.waiting and [s.request_index for s in sched.running] == [1, 2]


def test_token_budget_holds_back_a_prompt_until_it_fits():
    cfg = EngineConfig(max_model_len=16, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                       enable_chunked_prefill=False)
    sched = Scheduler(cfg, BlockAllocator(64, 4))
    for i, n in enumerate((10, 10)):
        sched.add(make_seq(i, n))
    # 10 + 10 > 16: without chunked prefill the second prompt waits whole for the next step.
    assert run_step(sched) == [(0, 10)]
    assert run_step(sched) == [(0, 1), (1, 10)]


def test_preemption_frees_blocks_and_requeues_at_front():
    cfg = EngineConfig(max_model_len=16, max_num_seqs=2, max_num_batched_tokens=16, block_size=4)
    sched = Scheduler(cfg, BlockAllocator(4, 4))  # 16 token slots in all
    a, b, c = make_seq(0, 8), make_seq(1, 8), make_seq(2, 4)
    for s in (a, b, c):
        sched.add(s)
    assert run_step(sched) == [(0, 8), (1, 8)]  # c waits: max_num_seqs=2
    # Each now needs a third block to decode; none is free, so the later arrival (b) is preempted.
    assert run_step(sched) == [(0, 1)]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.num_preemptions == 1
    # b goes back in front of c, which has waited all along, not behind it.
    assert list(sched.waiting) == [b, c]
    sched.finish(a, "length")
    # b comes back first (prompt + its sampled token recomputed), then c joins behind it.
    assert run_step(sched) == [(1, 9), (2, 4)]
    assert not sched.waiting
