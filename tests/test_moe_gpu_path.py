"""The GPU MoE path on a CPU: the numpy references of the kernels' contracts (`moe_ref.py`, which the device
harness compares the kernels with) against `FusedMoE`'s CPU path, the tile bound every grid of
ops_moe.cu depends on, the wrappers' input checks, and MoE models through the emulated GPU path (the
[E, out, in] expert layout the loader writes, `forward_gpu`'s calls). The kernels run on the device:
tools/gpu/ops_harness.py (`--checks moe`) and tools/gpu/e2e_harness.py (`moe` section).
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

import gpu_emulator
import moe_ref
from fdlite import LLM, SamplingParams
from fdlite.kernels import gpu as gpu_ops
from fdlite.layers.moe import FusedMoE

COMMON = dict(skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_model_len=256,
              max_num_batched_tokens=96, kv_cache_memory_bytes=1 << 22)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _op(E, k, hidden=16, inter=8, bias=False, renormalize=True, norm_min=0.0, seed=0) -> FusedMoE:
    paddle.seed(seed)
    op = FusedMoE(E, k, hidden, inter, "float32", renormalize, bias, norm_min)
    for p in op.parameters():
        p.set_value(paddle.randn(p.shape) * 0.5)
    return op


@pytest.mark.parametrize("E,k", [(8, 1), (8, 2), (8, 8), (64, 2), (64, 8)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("renormalize,norm_min", [(False, 0.0), (True, 0.0), (True, 1e-12), (True, 0.9)])
def test_route_reference_is_the_cpu_router(E, k, bias, renormalize, norm_min):
    op = _op(E, k, bias=bias, renormalize=renormalize, norm_min=norm_min)
    x = paddle.randn([37, 16])
    ids, w = op.route(x)
    logits = op.gate(x).numpy()
    b = op.e_score_correction_bias.numpy() if bias else None
    rids, rw = moe_ref.route(logits, k, renormalize, norm_min, b)
    np.testing.assert_array_equal(rids, ids.numpy())
    np.testing.assert_allclose(rw, w.numpy(), rtol=2e-6, atol=1e-7)


def test_route_reference_breaks_ties_to_the_lower_id_and_balances():
    logits = np.zeros((2, 8), np.float32)
    logits[1, [1, 5, 6]] = 1.0
    ids, w = moe_ref.route(logits, 2, False)
    assert ids.tolist() == [[0, 1], [1, 5]]
    np.testing.assert_allclose(w[0], 1 / 8)
    ids, w = moe_ref.route(logits, 3, True, balanced=True)
    assert ids.tolist() == [[0, 1, 2], [3, 4, 5]] and np.allclose(w, 1 / 3)


def _counts_tiles(ids: np.ndarray, E: int, bm: int) -> int:
    c = np.bincount(ids.reshape(-1), minlength=E)
    return int(sum(-(-int(n) // bm) for n in c))


@pytest.mark.parametrize("bm", [16, 64])
def test_tile_bound_holds_for_any_routing(bm):
    """tiles_max (the M grid of the GEMMs, fixed per token count) >= the tiles any routing needs."""
    rng = np.random.default_rng(0)
    for T in (1, 2, 3, 17, 100, 256, 1000):
        for E, k in ((8, 1), (8, 2), (8, 8), (64, 6), (128, 8)):
            if k > E:
                continue
            n = T * k
            bound = moe_ref.tiles_max(n, E, bm)
            cases = [np.arange(n) % E,                              # round robin
                     np.zeros(n, np.int64),                          # one expert (k = 1 only is legal, the bound still holds)
                     rng.integers(0, E, n),
                     np.minimum(np.arange(n) // (bm + 1), E - 1)]    # bm + 1 per expert: the most padding
            for ids in cases:
                assert _counts_tiles(ids, E, bm) <= bound, (T, E, k, bm)


@pytest.mark.parametrize("bm", [16, 64])
def test_align_reference_is_the_cpu_paths_stable_sort(bm):
    rng = np.random.default_rng(1)
    E, k, T = 8, 3, 50
    ids = np.stack([rng.choice(E - 2, k, replace=False) for _ in range(T)]).astype(np.int32)  # experts 6, 7 idle
    ids[:20] = np.array([0, 1, 2])  # uneven: expert 0..2 get many
    rows, tiles = moe_ref.align(ids, E, bm)
    real = rows[rows >= 0]
    np.testing.assert_array_equal(real, np.argsort(ids.reshape(-1), kind="stable"))
    used = tiles[tiles >= 0]
    assert (np.diff(used) >= 0).all() and set(used) == set(np.unique(ids))
    for t, e in enumerate(tiles):
        seg = rows[t * bm:(t + 1) * bm]
        if e < 0:
            assert (seg == -2).all()  # past the real tiles: never read
        else:
            assert ((seg == -1) | (ids.reshape(-1)[np.maximum(seg, 0)] == e)).all()
    assert moe_ref.block_m(T * k, E) == 64 and moe_ref.block_m(16 * E, E) == 16


def test_experts_reference_is_the_cpu_forward():
    op = _op(6, 2, hidden=16, inter=8)
    x = paddle.randn([9, 16])
    ids = np.array([[0, 1], [0, 2], [3, 0], [1, 0], [0, 3], [2, 1], [0, 1], [3, 2], [1, 0]], np.int64)
    w = np.random.default_rng(0).random(ids.shape).astype(np.float32)
    op.route = lambda h: (paddle.to_tensor(ids), paddle.to_tensor(w))
    want = op(x).numpy()
    got = moe_ref.experts(x.numpy(), ids, w, op.gate_up_proj.numpy().transpose(0, 2, 1),
                          op.down_proj.numpy().transpose(0, 2, 1))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_moe_wrappers_check_shapes_before_the_kernel(monkeypatch):
    ran, sent = [], []
    monkeypatch.setattr(gpu_ops, "_run", lambda name, *a: ran.append(name) or sent.append(a) or [None, None])
    monkeypatch.setattr(gpu_ops, "_check", lambda t, name, dtypes=None, ndim=None: None)  # no GPU here
    x, ids, w = paddle.zeros([3, 16]), paddle.zeros([3, 2], "int32"), paddle.zeros([3, 2])
    w13, w2 = paddle.zeros([4, 16, 16]), paddle.zeros([4, 16, 8])
    gpu_ops.moe_experts(x, ids, w, w13, w2)
    gpu_ops.moe_experts(x, ids, w, w13, w2, block_m=128)  # the wgmma kernels' tile, for side-by-side runs
    shared = paddle.zeros([3, 16])
    gpu_ops.moe_experts(x, ids, w, w13, w2, shared=shared)
    assert ran == ["fdl_moe_experts"] * 3
    # (..., Shared, block_m, has_shared): x stands in for a missing addend, which has_shared says to skip
    assert [a[5:] for a in sent] == [(x, 0, False), (x, 128, False), (shared, 0, True)]
    for bad in (paddle.zeros([3, 8]), paddle.zeros([2, 16])):
        with pytest.raises(gpu_ops.GpuOpsError, match="shared"):
            gpu_ops.moe_experts(x, ids, w, w13, w2, shared=bad)
    bad = [(x, ids, w, paddle.zeros([4, 8, 16]), w2),            # w13 rows != 2 I
           (x, ids, paddle.zeros([3, 3]), w13, w2),              # weights' k != ids' k
           (x, paddle.zeros([2, 2], "int32"), paddle.zeros([2, 2]), w13, w2),  # T differs
           (paddle.zeros([3, 12]), ids, w, paddle.zeros([4, 16, 12]), paddle.zeros([4, 12, 8]))]  # H % 8
    for args in bad:
        with pytest.raises(gpu_ops.GpuOpsError):
            gpu_ops.moe_experts(*args)
    with pytest.raises(gpu_ops.GpuOpsError, match="block_m"):
        gpu_ops.moe_experts(x, ids, w, w13, w2, block_m=32)
    with pytest.raises(gpu_ops.GpuOpsError, match="top_k"):
        gpu_ops.moe_route(paddle.zeros([3, 4]), 5, True)
    with pytest.raises(gpu_ops.GpuOpsError, match="correction_bias"):
        gpu_ops.moe_route(paddle.zeros([3, 4]), 2, True, correction_bias=paddle.zeros([1, 5]))
    assert ran == ["fdl_moe_experts"] * 3


def test_moe_block_folds_the_shared_experts_into_the_unpermute_with_one_rank(model_dirs, monkeypatch):
    """ERNIE's MoE block on the emulated GPU path: with one rank the shared experts' output goes into moe_experts'
    sum (no add pass); in the tensor-parallel order (the all-reduce is the identity in one process) it is added
    by add_ after the routed sum. No Paddle compute kernel either way, and the two agree."""
    from test_gpu_path_cpu import _forbid_builtin_compute

    from fdlite.models.model_config import ModelConfig
    from fdlite.models.moe import MoEBlock, MoESpec
    from fdlite.models.tp_partition import TPPartition

    calls = gpu_emulator.install(monkeypatch)
    cfg = ModelConfig.from_dir(model_dirs["ernie45_moe"])
    paddle.seed(0)
    block = MoEBlock(cfg, MoESpec.ernie(cfg), "float32", TPPartition.single(cfg))
    for p in block.parameters():
        p.set_value(paddle.randn(p.shape) * 0.5)
    x = paddle.randn([7, cfg.hidden_size])
    _forbid_builtin_compute(monkeypatch)
    folded = block(x).numpy()
    assert calls["moe_experts_shared"] == 1 and calls["add_"] == 0
    block.tp_size = 2
    added = block(x).numpy()
    assert calls["moe_experts_shared"] == 1 and calls["add_"] == 1
    np.testing.assert_allclose(folded, added, rtol=1e-5, atol=1e-6)
    assert np.abs(folded).max() > 0.1


def test_gpu_experts_are_stored_out_in(monkeypatch):
    cpu = FusedMoE(4, 2, 16, 8, "float32", True)
    gpu_emulator.install(monkeypatch)
    gpu = FusedMoE(4, 2, 16, 8, "float32", True)
    assert not cpu.weight_out_in and gpu.weight_out_in
    assert list(cpu.gate_up_proj.shape) == [4, 16, 16] and list(gpu.gate_up_proj.shape) == [4, 16, 16]
    assert list(cpu.down_proj.shape) == [4, 8, 16] and list(gpu.down_proj.shape) == [4, 16, 8]


@pytest.mark.parametrize("family", ["ernie45_moe", "qwen3_moe"])
@pytest.mark.parametrize("graphs", [False, True])
def test_emulated_gpu_moe_models_give_the_cpu_tokens(model_dirs, family, graphs, monkeypatch):
    """Both MoE families through forward_gpu (the kernels' contracts in numpy), loaded in the GPU's [E, out, in]
    expert layout, with chunked prefill and prefix hits; with graphs, through the emulated capture path."""
    from test_gpu_path_cpu import _forbid_builtin_compute, prompts

    want = LLM(model_dirs[family], device="cpu", **COMMON).generate(prompts(), GREEDY, use_tqdm=False)
    if graphs:
        monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    calls = gpu_emulator.install_engine(monkeypatch)
    llm = LLM(model_dirs[family], use_cudagraph=graphs, async_scheduling=False, **COMMON)
    _forbid_builtin_compute(monkeypatch)
    got = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert calls["moe_route"] > 0 and calls["moe_experts"] == calls["moe_route"]
    # ERNIE's shared experts folded into every routed sum (one rank), with no add pass; Qwen3-MoE has none
    assert calls["moe_experts_shared"] == (calls["moe_experts"] if family == "ernie45_moe" else 0)
    assert calls["add_"] == 0
    if graphs:
        assert llm.last_generate_stats["cudagraph_replays"] > 0
