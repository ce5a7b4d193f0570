"""Async scheduling prepares step N+1 before step N's tokens reach the host (vLLM v1's async scheduling): the
decode rows of N+1 read N's sampled tokens where the sampler left them (`TokenPatch`), and the rows that finish
in N compute one token that is dropped. Same outputs as without async scheduling, on the CPU path and on the
emulated GPU path (eager and graph replays); the early path is taken, and it falls back where it must."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_emulator
from fdlite.runner.worker import Worker
from fdlite import LLM, SamplingParams
from fdlite.runner.forward_buffers import ForwardBuffers
from fdlite.runner.input_batch import TokenPatch

COMMON = dict(skip_tokenizer_init=True, block_size=16, max_model_len=128, max_num_batched_tokens=64,
              kv_cache_memory_bytes=1 << 22)


def _requests(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, int(rng.integers(1, 40))).tolist()} for _ in range(n)]
    params = []
    for i in range(n):
        k = i % 4
        if k == 0:  # greedy, finishing at different steps
            params.append(SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True))
        elif k == 1:  # seeded, with logprobs, two children
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=7 + i, max_tokens=6, ignore_eos=True,
                                         logprobs=2, n=2))
        elif k == 2:
            params.append(SamplingParams(temperature=0, max_tokens=1))
        else:  # stops on token ids: leaves at a step nobody knows in advance
            params.append(SamplingParams(temperature=0, max_tokens=12, stop_token_ids=list(range(3, 150))))
    return prompts, params


def _view(outs):
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _cumlp(outs):
    return np.array([np.nan if c.cumulative_logprob is None else c.cumulative_logprob for o in outs for c in o.outputs])


def _compare(path, prompts, params, **kw):
    want = LLM(path, async_scheduling=False, **COMMON, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, async_scheduling=True, **COMMON, **kw)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _view(got) == _view(want)
    np.testing.assert_allclose(_cumlp(got), _cumlp(want), rtol=0, atol=1e-3, equal_nan=True)
    return llm


@pytest.mark.parametrize("batch", [1, 8])
def test_early_prepare_gives_the_same_outputs_on_cpu(model_dirs, batch):
    prompts, params = _requests(batch if batch > 1 else 1)
    if batch == 1:
        params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    llm = _compare(model_dirs["qwen3"], prompts, params, max_num_seqs=batch)
    steps = llm.last_generate_stats["num_steps"]
    # Every step after the first is prepared early (nothing here needs the host's tokens).
    assert llm.engine.num_early_prepares >= steps - 2, (llm.engine.num_early_prepares, steps)


def test_seeded_batch_one_and_a_single_token(model_dirs):
    prompts = [{"prompt_token_ids": [5, 7, 9, 11]}] * 3
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=15, ignore_eos=True, n=2),
              SamplingParams(temperature=0, max_tokens=1), SamplingParams(temperature=0.7, seed=4, max_tokens=2)]
    for p in params:
        llm = _compare(model_dirs["qwen3"], prompts[:1], [p], max_num_seqs=1)
    assert llm.engine.num_early_prepares >= 1


@pytest.mark.parametrize("graphs", [False, True])
def test_early_prepare_on_the_emulated_gpu_path(model_dirs, monkeypatch, graphs):
    if graphs:
        monkeypatch.setenv("FDLITE_CUDAGRAPH_BACKEND", "eager")
    calls = gpu_emulator.install_engine(monkeypatch)
    prompts, params = _requests(6, seed=1)
    params = [SamplingParams(**{**_kw(p), "max_tokens": min(p.max_tokens, 6)}) for p in params]
    handed_back = []
    real = Worker.execute
    monkeypatch.setattr(Worker, "execute", lambda self, prepared: handed_back.append(real(self, prepared)) or
                        handed_back[-1])
    llm = _compare(model_dirs["qwen3"], prompts, params, max_num_seqs=4, use_cudagraph=graphs)
    assert llm.engine.num_early_prepares > 0
    assert calls["gather_rows"] > 0
    # The async engine's step thread hands back ids still being copied (the sync engine's come resolved).
    kinds = {type(x).__name__ for x in handed_back if x is not None}
    assert kinds == {"PendingSample", "SamplerOutput"}
    if graphs:
        assert llm.last_generate_stats["cudagraph_replays"] > 0


def _kw(p: SamplingParams) -> dict:
    return dict(temperature=p.temperature, top_p=p.top_p, seed=p.seed, max_tokens=p.max_tokens, n=p.n,
                ignore_eos=p.ignore_eos, logprobs=p.logprobs, stop_token_ids=p.stop_token_ids)


def test_host_penalties_fall_back(model_dirs):
    prompts = [{"prompt_token_ids": [5, 7, 9, 11, 13]}]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)]
    llm = _compare(model_dirs["qwen3"], prompts, params, max_num_seqs=2)
    assert llm.engine.num_early_prepares == 0  # the CPU keeps penalty counts on the host: prepared late


@pytest.mark.parametrize("gpu", [False, True])
def test_a_patch_of_scattered_tokens(monkeypatch, gpu):
    """Patched tokens need not be consecutive: one gather per run of them."""
    if gpu:
        gpu_emulator.install(monkeypatch)
    import paddle
    from fdlite.layers.forward_meta import FlatBatch

    bufs = ForwardBuffers(max_tokens=16, max_rows=4, max_blocks=2, block_size=16)
    bufs.set_scratch_block(0)
    flat = FlatBatch(input_ids=np.arange(100, 108, dtype=np.int64), positions=np.arange(8, dtype=np.int64),
                     slot_mapping=np.arange(8, dtype=np.int64), token_rows=np.zeros(8, np.int64),
                     block_tables=np.zeros((1, 1), np.int32), seq_lens_kv=np.array([8], np.int32),
                     cu_seqlens_q=np.array([0, 8], np.int32), logits_indices=np.array([7], np.int64), num_decodes=0,
                     prefills=[])
    prev = np.array([7, 8, 9, 10], np.int64)
    ids = paddle.to_tensor(prev) if gpu else prev
    patch = TokenPatch(np.array([0, 1, 4, 6], np.int64), np.array([3, 0, 2, 1], np.int64), 1)
    bufs.write(flat, None, (patch, ids))
    assert bufs.input_ids.tensor.numpy()[:8].tolist() == [10, 7, 102, 103, 9, 105, 8, 107]
