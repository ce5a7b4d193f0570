"""The C++ CPU paged attention (fdlite/kernels/csrc_cpu) against the Paddle-op reference (fdlite/layers/attention.py).

Random caches and block tables (blocks shuffled, so a row's blocks are not contiguous), for decode
batches, prefills after a cached prefix, chunked prefills, mixed batches, GQA group sizes 1-7, block
sizes 16 / 64 and odd ones, table widths wider than needed, and graph mode (per-token rows and
positions with padded tokens on a scratch row). Skipped, with the reason, where the op cannot be built.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fdlite.kernels import cpu_attention
from fdlite.layers.attention import paged_attention, reference_attention
from fdlite.layers.forward_meta import ForwardMeta, PrefillSpan

paddle.set_device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _op():
    try:
        ok = cpu_attention.load()
    except ValueError as e:  # a bad FDLITE_CPU_ATTENTION value
        pytest.skip(str(e))
    if not ok:
        pytest.skip(f"C++ CPU attention unavailable: {cpu_attention.status().get('reason')}")


def _t(a, dtype):
    return paddle.to_tensor(np.ascontiguousarray(a, dtype=dtype))


def make_case(rows, h, kvh, d, bs, extra_width=0, seed=0):
    """rows: [(q_len, kv_len)], decodes (q_len 1) first -> q, caches, meta (eager form)."""
    rng = np.random.default_rng(seed)
    need = [-(-kv // bs) for _, kv in rows]
    width = max(need) + extra_width
    num_blocks = sum(need) + 3
    perm = rng.permutation(num_blocks)
    tables = np.full((len(rows), width), num_blocks - 1, np.int32)  # unused entries: some valid block
    at = 0
    for r, n in enumerate(need):
        tables[r, :n] = perm[at : at + n]
        at += n
    kc = rng.standard_normal((num_blocks, kvh, bs, d)).astype(np.float32)
    vc = rng.standard_normal((num_blocks, kvh, bs, d)).astype(np.float32)
    qlens = np.array([q for q, _ in rows])
    kvs = np.array([kv for _, kv in rows], np.int32)
    cu = np.zeros(len(rows) + 1, np.int32)
    np.cumsum(qlens, out=cu[1:])
    t = int(cu[-1])
    token_rows = np.repeat(np.arange(len(rows)), qlens)
    pos = np.arange(t) - np.repeat(cu[:-1] - (kvs - qlens), qlens)
    num_decodes = int(np.argmax(qlens != 1)) if (qlens != 1).any() else len(rows)
    prefills = [PrefillSpan(row=r, token_start=int(cu[r]), q_len=int(qlens[r]), kv_len=int(kvs[r]))
                for r in range(num_decodes, len(rows))]
    blocks = tables[token_rows, pos // bs].astype(np.int64)
    meta = ForwardMeta(slot_mapping=_t(blocks * bs + pos % bs, "int64"), token_rows=_t(token_rows, "int64"),
                       positions=_t(pos, "int64"), block_tables=_t(tables, "int32"), seq_lens_kv=_t(kvs, "int32"),
                       cu_seqlens_q=_t(cu, "int32"), num_decodes=num_decodes, block_size=bs, prefills=prefills)
    q = _t(rng.standard_normal((t, h, d)), "float32")
    return q, _t(kc, "float32"), _t(vc, "float32"), meta


def run_cpp(q, kc, vc, meta, scale, threads=0):
    """Graph mode (prefills None): per-token rows and positions; eager: cu_seqlens_q and seq_lens_kv."""
    if meta.prefills is None:
        return cpu_attention.paged_attention(q, kc, vc, meta.block_tables, meta.token_rows, meta.positions, scale,
                                             True, threads)
    return cpu_attention.paged_attention(q, kc, vc, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens_kv, scale,
                                         False, threads)


def check(rows, h=8, kvh=4, d=32, bs=64, extra_width=0, seed=0, graph=False, threads=0):
    q, kc, vc, meta = make_case(rows, h, kvh, d, bs, extra_width, seed)
    if graph:
        meta.prefills = None
    scale = d**-0.5
    ref = reference_attention(q, kc, vc, meta, scale).numpy()
    got = run_cpp(q, kc, vc, meta, scale, threads).numpy()
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


DECODE = [(1, n) for n in (1, 5, 63, 64, 65, 130, 300, 17)]


@pytest.mark.parametrize("bs", [16, 64, 7, 1])
def test_decode(bs):
    check(DECODE, bs=bs)


@pytest.mark.parametrize("h,kvh", [(8, 8), (8, 4), (8, 1), (14, 2), (12, 4)])
def test_gqa_groups(h, kvh):
    check(DECODE[:5] + [(9, 40), (3, 3)], h=h, kvh=kvh)


@pytest.mark.parametrize("d", [32, 64, 128, 24, 5])
def test_head_dims(d):
    check(DECODE[:4] + [(20, 90)], d=d, bs=16)


def test_prefill_from_empty_and_after_prefix():
    check([(50, 50)], bs=16)  # a whole prompt
    check([(30, 200)], bs=16)  # a prompt after a 170-token cached prefix
    check([(1, 1), (40, 64), (7, 129)], bs=64)


def test_chunked_and_mixed():
    # decodes, then chunks of long prompts at several offsets, then a fresh prompt
    check([(1, 77), (1, 3), (1, 256), (64, 128), (64, 320), (13, 13)], bs=16, seed=3)
    check([(1, 500), (100, 100), (100, 200)], bs=64, seed=4)


@pytest.mark.parametrize("extra", [0, 1, 5])
def test_table_widths(extra):
    check(DECODE + [(17, 50)], bs=16, extra_width=extra)


@pytest.mark.parametrize("bs", [16, 64])
def test_graph_mode_per_token(bs):
    check(DECODE, bs=bs, graph=True)
    check([(1, 40), (1, 2), (33, 80), (5, 5)], bs=bs, graph=True, seed=1)


def test_graph_mode_padded_tokens():
    """Padded tokens read the scratch row (the table row after the batch) at position 0."""
    q, kc, vc, meta = make_case([(1, 40), (1, 90), (6, 30)], 8, 4, 32, 16)
    rows = meta.block_tables.numpy()
    tables = np.concatenate([rows, np.full((1, rows.shape[1]), kc.shape[0] - 1, np.int32)])
    pad = 3
    t = q.shape[0]
    q = paddle.concat([q, paddle.randn([pad, 8, 32])])
    meta.block_tables = _t(tables, "int32")
    meta.token_rows = _t(np.concatenate([meta.token_rows.numpy(), np.full(pad, len(rows))]), "int64")
    meta.positions = _t(np.concatenate([meta.positions.numpy(), np.zeros(pad)]), "int64")
    meta.prefills = None
    ref = reference_attention(q, kc, vc, meta, 32**-0.5).numpy()
    got = run_cpp(q, kc, vc, meta, 32**-0.5).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert got.shape[0] == t + pad


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts(threads):
    check([(1, n) for n in range(1, 200, 7)] + [(50, 120)], bs=16, threads=threads, seed=5)


def test_large_scores_stable():
    """Scores of a few hundred (no overflow in the online softmax, same answer as the reference)."""
    q, kc, vc, meta = make_case([(1, 300), (20, 100)], 8, 4, 32, 16, seed=6)
    q = q * 40.0
    ref = reference_attention(q, kc, vc, meta, 32**-0.5).numpy()
    got = run_cpp(q, kc, vc, meta, 32**-0.5).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_paged_attention_uses_op_and_writes_cache():
    """The public entry point writes the step's K/V, then attends through the C++ op."""
    q, kc, vc, meta = make_case([(1, 10), (4, 20)], 8, 4, 32, 16, seed=7)
    t = q.shape[0]
    k_new, v_new = paddle.randn([t, 4, 32]), paddle.randn([t, 4, 32])
    kc2, vc2 = kc.clone(), vc.clone()
    got = paged_attention(q, k_new, v_new, kc, vc, meta, 32**-0.5).numpy()
    from fdlite.layers.attention import write_kv

    write_kv(kc2, meta, k_new)
    write_kv(vc2, meta, v_new)
    np.testing.assert_array_equal(kc.numpy(), kc2.numpy())
    ref = reference_attention(q, kc2, vc2, meta, 32**-0.5).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_rejects_bad_tables():
    q, kc, vc, meta = make_case([(1, 40)], 8, 4, 32, 16)
    bad = paddle.to_tensor(np.full((1, 3), 10_000, np.int32))
    with pytest.raises(Exception, match="block id"):
        cpu_attention.paged_attention(q, kc, vc, bad, meta.cu_seqlens_q, meta.seq_lens_kv, 1.0, False)


@pytest.mark.parametrize("graph", [False, True])
def test_fp8_cache_matches_the_reference(graph):
    """The _fp8 op widens e4m3 bytes by a 256-entry table times each slot's scale: the same floats the reference's
    Paddle cast gives, so the two agree to float32 rounding, in eager and graph form, for decodes and prefills."""
    from fdlite.kvcache.fp8_cache import Fp8Cache

    rows = [(1, 77), (1, 3), (1, 130), (20, 90), (9, 9)]
    q, kc, vc, meta = make_case(rows, 8, 4, 32, 16, seed=5)
    if graph:
        meta.prefills = None
    caches = []
    for src in (kc, vc):
        c = Fp8Cache(list(src.shape))
        flat = src.reshape([-1, src.shape[-1]])
        c.write(paddle.arange(flat.shape[0], dtype="int64"), flat * 3.0)  # every slot, scales well away from 1
        caches.append(c)
    scale = 32**-0.5
    ref = reference_attention(q, caches[0], caches[1], meta, scale).numpy()
    got = run_cpp(q, caches[0], caches[1], meta, scale).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    exact = reference_attention(q, kc * 3.0, vc * 3.0, meta, scale).numpy()
    err = np.abs(got - exact).max() / np.abs(exact).max()
    assert 1e-3 < err < 0.15, err  # really FP8: near the float32 cache's result, not equal to it
