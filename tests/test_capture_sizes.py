"""Capture-size lists and padding, against FastDeploy's list (docs/design.md, section "CUDA-graph capture sizes and padding")."""

import numpy as np
import paddle
import pytest

from fdlite.graph.capture_sizes import (decode_capture_sizes, mixed_capture_sizes, padded_size,
                                        prefill_capture_sizes, random_split, worst_case_prefill_split)
from fdlite.layers.forward_meta import FlatBatch, PrefillSpan
from fdlite.runner.cudagraph_runner import graph_size
from fdlite.runner.forward_buffers import ForwardBuffers

# Written out from FastDeploy's guide, not computed by the code under test.
SEED = ([1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128]
        + [144, 160, 176, 192, 208, 224, 240, 256]
        + [288, 320, 352, 384, 416, 448, 480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800, 832, 864, 896,
           928, 960, 992, 1024])


@pytest.mark.parametrize("max_num_seqs", [1, 8, 100, 256, 1024])
def test_decode_sizes_are_the_seed_list_cut_to_max_num_seqs(max_num_seqs):
    sizes = decode_capture_sizes(max_num_seqs)
    assert sizes == sorted({s for s in SEED if s <= max_num_seqs} | {max_num_seqs})
    assert sizes[0] == 1 and sizes[-1] == max_num_seqs


def test_specific_lists():
    assert decode_capture_sizes(1) == [1]
    assert decode_capture_sizes(8) == [1, 2, 4, 8]
    assert decode_capture_sizes(100)[-3:] == [88, 96, 100]
    assert len(decode_capture_sizes(1024)) == len(SEED)


def test_user_list_and_max_capture_size_override():
    assert decode_capture_sizes(64, user_sizes=[1, 3, 5, 7, 9]) == [1, 3, 5, 7, 9]
    assert decode_capture_sizes(4, user_sizes=[1, 3, 5, 7, 9]) == [1, 3]  # never above max_num_seqs
    assert decode_capture_sizes(256, max_capture_size=32) == [1, 2, 4, 8, 16, 24, 32]
    assert prefill_capture_sizes(8192)[-1] == 512  # FastDeploy's default prefill cap (PR #3459)
    assert prefill_capture_sizes(100)[-1] == 100


@pytest.mark.parametrize("n,expected", [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (97, 100), (100, 100), (101, None)])
def test_padding_picks_smallest_captured_size_at_least_n(n, expected):
    assert padded_size(decode_capture_sizes(100), n) == expected


def test_worst_case_prefill_split():
    assert worst_case_prefill_split(160, 2) == [1, 159]
    assert worst_case_prefill_split(10, 4) == [1, 1, 1, 7]
    assert worst_case_prefill_split(3, 8) == [1, 1, 1]
    assert sum(worst_case_prefill_split(512, 64)) == 512


def test_worst_case_split_keeps_each_row_within_its_block_table():
    # 2048 tokens, 8 rows of at most 256: as many one-token rows as leave room for the rest.
    lens = worst_case_prefill_split(2048, 8, max_len=256)
    assert sum(lens) == 2048 and len(lens) == 8 and max(lens) <= 256
    lens = worst_case_prefill_split(300, 8, max_len=256)
    assert lens == [1] * 6 + [147, 147]
    assert worst_case_prefill_split(300, 8, max_len=1024) == [1] * 7 + [293]
    with pytest.raises(ValueError):
        worst_case_prefill_split(2049, 8, max_len=256)


def test_random_splits_fit_the_rows_and_lengths():
    rng = np.random.default_rng(0)
    for n, rows, max_len in [(2048, 8, 256), (7, 8, 256), (100, 3, 40), (64, 64, 1), (5000, 256, 4096)]:
        for _ in range(20):
            parts = random_split(n, rows, max_len, rng)
            assert sum(parts) == n and len(parts) <= rows and max(parts) <= max_len and parts == sorted(parts)


def test_mixed_sizes_are_token_counts_up_to_the_step_budget():
    assert mixed_capture_sizes(8192) == [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert mixed_capture_sizes(2048)[-1] == 2048 and mixed_capture_sizes(1000)[-2:] == [768, 1000]
    assert mixed_capture_sizes(16384)[-1] == 8192  # above it steps run eagerly
    assert mixed_capture_sizes(8192, user_sizes=[100, 9000]) == [100] and mixed_capture_sizes(512, user_sizes=[]) == []


def test_padded_rows_write_and_read_only_the_scratch_block():
    buf = ForwardBuffers(max_tokens=8, max_rows=6, max_blocks=3, block_size=64)
    buf.set_scratch_block(10)
    batch = FlatBatch(input_ids=np.array([5, 6, 7]), positions=np.array([3, 0, 9]), slot_mapping=np.array([3, 4, 73]),
                      token_rows=np.array([0, 1, 2]), block_tables=np.array([[0, 0], [1, 0], [2, 9]], np.int32),
                      seq_lens_kv=np.array([4, 1, 10], np.int32), cu_seqlens_q=np.array([0, 1, 2, 3], np.int32),
                      logits_indices=np.array([0, 1, 2]), num_decodes=3)
    buf.write_padded(batch, size=4, decode=True)
    ids, _, meta = buf.graph_views(4, decode=True, caches=[])
    assert ids.tolist() == [5, 6, 7, 0]
    assert meta.slot_mapping.tolist() == [3, 4, 73, 640]          # padded token -> scratch slot
    assert meta.seq_lens_kv.tolist() == [4, 1, 10, 1]             # padding sees one slot
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert meta.token_rows.tolist() == [0, 1, 2, 6]               # padding reads the scratch row
    assert meta.block_tables[3].tolist() == [10, 10, 10]          # padded row's table: the scratch block
    assert meta.block_tables[6].tolist() == [10, 10, 10]          # the scratch row
    assert meta.block_tables[2].tolist() == [2, 9, 10]
    # Tokens past the padded size are left alone.
    before = paddle.clone(buf.input_ids.tensor[4:])
    buf.write_padded(batch, size=3, decode=True)
    assert buf.input_ids.tensor[4:].tolist() == before.tolist()

def test_an_eager_step_plans_attention_as_the_graph_it_would_run_in():
    """The GPU attention chooses each row's kernel and KV split count from ForwardMeta's max_q_len, graph_tokens and
    max_kv_len: an eager step written with its graph (`graph_size`) gets that graph's values, not its own row count,
    max_q_len (here 2: a prompt's last chunk) or table width."""
    buf = ForwardBuffers(max_tokens=64, max_rows=6, max_blocks=4, block_size=16)
    buf.set_scratch_block(10)
    decode = FlatBatch(input_ids=np.array([5, 6, 7]), positions=np.array([3, 0, 9]), slot_mapping=np.array([3, 16, 41]),
                       token_rows=np.array([0, 1, 2]), block_tables=np.array([[0], [1], [2]], np.int32),
                       seq_lens_kv=np.array([4, 1, 10], np.int32), cu_seqlens_q=np.array([0, 1, 2, 3], np.int32),
                       logits_indices=np.array([0, 1, 2]), num_decodes=3)
    mixed = FlatBatch(input_ids=np.array([5, 6, 7]), positions=np.array([3, 0, 1]), slot_mapping=np.array([3, 16, 17]),
                      token_rows=np.array([0, 1, 1]), block_tables=np.array([[0], [1]], np.int32),
                      seq_lens_kv=np.array([4, 2], np.int32), cu_seqlens_q=np.array([0, 1, 3], np.int32),
                      logits_indices=np.array([0, 2]), num_decodes=1,
                      prefills=[PrefillSpan(row=1, token_start=1, q_len=2, kv_len=2)])
    decode_sizes, mixed_sizes = [1, 2, 4], [16, 32]
    assert graph_size(decode, decode_sizes, False, 6) == 4 and graph_size(mixed, decode_sizes, False, 6) is None
    assert graph_size(mixed, mixed_sizes, True, 6) == 16 and graph_size(mixed, mixed_sizes, True, 1) is None

    def plan(meta):
        return meta.max_q_len, meta.graph_tokens, meta.max_kv_len

    for batch, size, is_decode in ((decode, 4, True), (mixed, 16, False)):
        _, _, meta, _ = buf.write(batch, [], graph=(size, is_decode))
        assert meta.block_tables.shape == [batch.num_rows, 1]  # the step's own narrow table
        assert plan(meta) == plan(buf.graph_views(size, is_decode, [])[2]) == (1 if is_decode else 0, size, 64)
    assert plan(buf.write(mixed, [])[2]) == (2, 0, 64)  # no graph takes it: its own max_q_len and T
