"""The persistent batch: per-slot state kept by diffs equals a rebuild from scratch, after random joins and leaves."""

import numpy as np

from fdlite.kvcache.block_allocator import BlockAllocator, blocks_for
from fdlite.runner.input_batch import InputBatch
from fdlite.runner.sequence import Sequence
from fdlite.sampling_params import SamplingParams
from sampling_helpers import SamplingRow, rows_to_batch

BS, LEN, VOCAB, SLOTS = 4, 64, 50, 6
EOS = {2}


def reference_flat(rows):
    """The flat batch written out row by row from the sequences themselves (decodes first)."""
    rows = [r for r in rows if r[1] == 1] + [r for r in rows if r[1] != 1]
    ids, pos, slots, samples = [], [], [], []
    start = 0
    for seq, n in rows:
        tokens = seq.prompt_token_ids + seq.output_token_ids
        c = seq.num_computed_tokens
        for p in range(c, c + n):
            ids.append(tokens[p])
            pos.append(p)
            slots.append(seq.block_table[p // BS] * BS + p % BS)
        if c + n == seq.num_tokens:
            samples.append(start + n - 1)
        start += n
    return ids, pos, slots, samples, [s.num_computed_tokens + n for s, n in rows]


def random_params(rng):
    return SamplingParams(temperature=float(rng.choice([0.0, 0.7])), top_k=int(rng.choice([0, 5])),
                          top_p=float(rng.choice([1.0, 0.8])), min_tokens=int(rng.choice([0, 3])),
                          repetition_penalty=float(rng.choice([1.0, 1.3])), stop_token_ids=[7],
                          logprobs=None if rng.random() < 0.5 else 2, seed=int(rng.integers(100)))


def test_diffs_match_a_rebuild_after_random_joins_and_leaves():
    rng = np.random.default_rng(0)
    alloc = BlockAllocator(400, BS)
    batch = InputBatch(SLOTS, LEN, BS, VOCAB, EOS)
    running: list[Sequence] = []
    waiting: list[Sequence] = []
    for step in range(300):
        # Random joins (possibly a preempted sequence coming back with outputs) and leaves.
        while len(running) < SLOTS and rng.random() < 0.5:
            if waiting and rng.random() < 0.5:
                seq = waiting.pop(0)
            else:
                seq = Sequence(0, 0, rng.integers(3, VOCAB, int(rng.integers(1, 20))).tolist(), random_params(rng),
                               seed=int(rng.integers(2**63)))
            seq.num_computed_tokens = 0
            alloc.grow(seq.block_table, seq.num_tokens)
            batch.add(seq)
            running.append(seq)
        for seq in list(running):
            if rng.random() < 0.1:
                running.remove(seq)
                batch.remove(seq)
                alloc.free(seq.block_table)
                if rng.random() < 0.5:
                    waiting.append(seq)  # preempted: recomputes later, keeping its outputs
        if not running:
            continue
        rows = []
        for seq in running:
            left = seq.num_tokens - seq.num_computed_tokens
            n = left if left == 1 else int(rng.integers(1, left + 1))  # chunked prefills too
            if alloc.grow(seq.block_table, seq.num_computed_tokens + n):
                batch.sync_blocks(seq)
            rows.append((seq, n))
        order = rng.permutation(len(rows))
        rows = [rows[i] for i in order]
        ids, pos, slots, samples, kv = reference_flat(rows)
        for seq, n in rows:  # what the scheduler does when it schedules the step
            seq.num_computed_tokens += n
        got = batch.prepare_inputs(rows)
        assert got.flat.input_ids.tolist() == ids
        assert got.flat.positions.tolist() == pos
        assert got.flat.slot_mapping.tolist() == slots
        assert got.flat.logits_indices.tolist() == samples
        assert got.flat.seq_lens_kv.tolist() == kv
        want_sampling = rows_to_batch([SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, s.seed)
                                       for s in got.sample_seqs], EOS, VOCAB)
        if got.sampling is not None:
            for field in ("temperature", "top_k", "top_p", "seeds", "positions", "num_logprobs", "banned_rows",
                          "banned_tokens", "penalty_rows", "output_counts", "prompt_seen"):
                a, b = getattr(got.sampling, field), getattr(want_sampling, field)
                assert (a is None) == (b is None), field
                if a is not None:
                    np.testing.assert_array_equal(a, b, err_msg=f"step {step}: {field}")
        tokens = rng.integers(0, VOCAB, len(got.sample_seqs))
        batch.write_tokens(got, tokens)
        for seq, t in zip(got.sample_seqs, tokens.tolist()):
            seq.output_token_ids.append(t)
            if seq.num_tokens >= LEN - 1:
                running.remove(seq)
                batch.remove(seq)
                alloc.free(seq.block_table)
        assert batch.num_running == len(running)
        assert sorted(batch.slot_of[s] for s in running) == sorted(i for i, s in enumerate(batch.seqs) if s is not None)
