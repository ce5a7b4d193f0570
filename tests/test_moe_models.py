"""ERNIE 4.5 (dense, MoE) and Qwen3-MoE against transformers, both checkpoint layouts, and the MoE op itself."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fdlite import LLM, SamplingParams
from fdlite.layers.moe import FusedMoE, balanced_routing
from hf_models import MOE_FAMILIES, load_reference, reference_greedy, save_paddle_layout
from test_hf_parity import mixed_prompts

MAX_NEW = 10
NEW_FAMILIES = ["ernie45", "ernie45_moe", "qwen3_moe"]
PROMPT_SEEDS = {"ernie45": 404, "ernie45_moe": 505, "qwen3_moe": 606}
# 8 sequences at a time out of 32, a 48-token budget (prompts up to 300 tokens are chunked), prefix caching on.
OPTIONS = dict(skip_tokenizer_init=True, max_num_seqs=8, block_size=16, max_model_len=512,
               max_num_batched_tokens=48, enable_chunked_prefill=True, enable_prefix_caching=True)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
PADDLE_NAMES = {"ernie45": ("ernie.", "Ernie4_5_ForCausalLM"), "ernie45_moe": ("ernie.", None),
                "qwen3_moe": ("qwen3_moe.", None)}


def prompts_for(family: str) -> list[list[int]]:
    """32 prompts: 24 of mixed lengths (1 to 300 tokens) and 8 sharing a 40-token prefix (cache hits)."""
    prompts = mixed_prompts(24, seed=PROMPT_SEEDS[family])
    rng = np.random.default_rng(PROMPT_SEEDS[family] + 1)
    shared = rng.integers(3, 512, size=40).tolist()
    return prompts + [shared + rng.integers(3, 512, size=int(n)).tolist() for n in rng.integers(1, 30, size=8)]


def run(path: str, prompts: list[list[int]], **options) -> tuple[LLM, list[list[int]]]:
    llm = LLM(path, **{**OPTIONS, **options})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def moe_ops(llm: LLM) -> list[FusedMoE]:
    return [layer for layer in llm.runner.model.sublayers() if isinstance(layer, FusedMoE)]


@pytest.fixture(scope="module")
def paddle_dirs(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("paddle_layout")
    return {fam: save_paddle_layout(model_dirs[fam], str(root / fam), *PADDLE_NAMES[fam]) for fam in NEW_FAMILIES}


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_greedy_matches_transformers_and_paddle_layout(model_dirs, paddle_dirs, family):
    prompts = prompts_for(family)
    seen = []  # per step and MoE layer: token choices per expert
    llm = LLM(model_dirs[family], **OPTIONS)
    for op in moe_ops(llm):
        op.register_forward_post_hook(lambda layer, inputs, output: seen.append(layer.last_counts.copy()))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    ref = reference_greedy(load_reference(model_dirs[family]), prompts, MAX_NEW)
    mismatched = [i for i, (a, b) in enumerate(zip(got, ref)) if a != b]
    assert not mismatched, f"{family}: prompts {mismatched} differ from transformers"
    stats = llm.last_generate_stats
    assert stats["prefix_cache_hit_tokens"] > 0  # the shared prefix was reused
    assert max(len(p) for p in prompts) > OPTIONS["max_num_batched_tokens"]  # and long prompts were chunked
    if family in MOE_FAMILIES:
        assert seen and any((c == 0).any() for c in seen)  # steps where some expert got no token
        assert any((c > 0).all() for c in seen)  # and steps where every expert had work
        top_k = moe_ops(llm)[0].top_k
        assert all(c.sum() % top_k == 0 for c in seen)  # every token made k choices
    # The same weights written the way -Paddle repositories hold them give the same tokens.
    _, paddle_tokens = run(paddle_dirs[family], prompts)
    assert paddle_tokens == got


def test_moe_layers_follow_the_config_pattern(model_dirs):
    from fdlite.models.moe import MoEBlock

    def kinds(family):
        llm = LLM(model_dirs[family], skip_tokenizer_init=True, max_num_seqs=2, max_model_len=64)
        return ["moe" if isinstance(layer.mlp, MoEBlock) else "dense" for layer in llm.runner.model.model.layers], llm

    ernie, llm = kinds("ernie45_moe")
    assert ernie == ["dense", "moe", "dense", "moe"]  # moe_layer_start_index=1, moe_layer_interval=2
    block = llm.runner.model.model.layers[1].mlp
    assert block.shared_experts is not None and block.experts.e_score_correction_bias is not None
    qwen, _ = kinds("qwen3_moe")
    assert qwen == ["dense", "moe", "moe"]  # mlp_only_layers=[0]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_profile_run_routes_tokens_to_every_expert(model_dirs, family):
    llm = LLM(model_dirs[family], skip_tokenizer_init=True, max_num_seqs=4, max_model_len=64)
    ops = moe_ops(llm)
    assert ops and all(op.balanced_counts is not None and (op.balanced_counts > 0).all() for op in ops)


def reference_moe(op: FusedMoE, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Token by token, choice by choice: what FusedMoE computes without grouping."""
    w13, w2 = op.gate_up_proj.numpy(), op.down_proj.numpy()
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t], weights[t]):
            gate, up = np.split(x[t] @ w13[e], 2)
            out[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ w2[e])
    return out


def test_grouped_experts_equal_the_per_token_loop():
    paddle.seed(0)
    op = FusedMoE(num_experts=6, top_k=2, hidden_size=16, intermediate_size=8, dtype="float32", renormalize=True)
    for p in op.parameters():
        p.set_value(paddle.randn(p.shape) * 0.3)
    x = paddle.randn([9, 16])
    # Routing forced so experts 4 and 5 get nothing and expert 0 most tokens.
    ids = np.array([[0, 1], [0, 2], [3, 0], [1, 0], [0, 3], [2, 1], [0, 1], [3, 2], [1, 0]], np.int64)
    weights = np.random.default_rng(0).random(ids.shape).astype(np.float32)
    op.route = lambda h: (paddle.to_tensor(ids), paddle.to_tensor(weights))
    got = op(x).numpy()
    np.testing.assert_allclose(got, reference_moe(op, x.numpy(), ids, weights), rtol=1e-5, atol=1e-5)
    assert op.last_counts.tolist() == [7, 5, 3, 3, 0, 0]


def test_balanced_routing_covers_every_expert():
    op = FusedMoE(num_experts=8, top_k=3, hidden_size=4, intermediate_size=4, dtype="float32", renormalize=True)
    with balanced_routing():
        ids, weights = op.route(paddle.zeros([5, 4]))
    assert sorted(set(ids.numpy().ravel().tolist())) == list(range(8))
    assert all(len(set(row)) == 3 for row in ids.numpy().tolist())  # distinct choices per token
    np.testing.assert_allclose(weights.numpy(), 1 / 3)


def test_paddle_layout_shape_mismatch_names_the_tensor(model_dirs, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = save_paddle_layout(model_dirs["ernie45_moe"], str(tmp_path / "m"), "ernie.")
    tensors = load_file(f"{path}/model.safetensors")
    name = "ernie.layers.1.mlp.experts.3.up_gate_proj.weight"
    tensors[name] = np.ascontiguousarray(tensors[name][:, :-2])
    save_file(tensors, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match=f"'{name}'.*expected \\[64, 64\\].*Paddle"):
        LLM(path, skip_tokenizer_init=True, max_model_len=64)


def test_paddle_layout_unfused_names_load(model_dirs, tmp_path):
    """Paddle checkpoints with separate q/k/v and gate/up tensors (older exports) load the same."""
    prompts = prompts_for("ernie45")[:4]
    fused = save_paddle_layout(model_dirs["ernie45"], str(tmp_path / "a"), "ernie.")
    unfused = save_paddle_layout(model_dirs["ernie45"], str(tmp_path / "b"), "ernie.", fuse=False)
    assert run(fused, prompts)[1] == run(unfused, prompts)[1]


@pytest.mark.parametrize("family", ["ernie45_moe", "paddle:ernie45_moe"])
def test_each_rank_loads_its_columns_of_every_expert(model_dirs, paddle_dirs, family):
    from safetensors.numpy import load_file

    from fdlite.models.model_config import ModelConfig
    from fdlite.models.registry import model_class
    from fdlite.models.tp_partition import TPPartition
    from fdlite.models.weight_loader import load_weights

    full = load_file(f"{model_dirs['ernie45_moe']}/model.safetensors")
    path = paddle_dirs["ernie45_moe"] if family.startswith("paddle:") else model_dirs["ernie45_moe"]
    cfg = ModelConfig.from_dir(path)
    for rank in (0, 1):
        tp = TPPartition.of(cfg, rank, 2)
        model = model_class(cfg.architecture)(cfg, "float32", 64, tp)
        load_weights(model, path)
        p = {k: v.numpy() for k, v in model.named_parameters()}
        m = "model.layers.3.mlp."
        i0, i1 = tp.shard(cfg.moe_intermediate_size)
        for e in (0, 7):
            x = f"{m}experts.{e}."
            want = np.concatenate([full[x + "gate_proj.weight"][i0:i1], full[x + "up_proj.weight"][i0:i1]]).T
            np.testing.assert_array_equal(p[m + "experts.gate_up_proj"][e], want)
            np.testing.assert_array_equal(p[m + "experts.down_proj"][e], full[x + "down_proj.weight"][:, i0:i1].T)
        s0, s1 = tp.shard(2 * cfg.moe_intermediate_size)  # 2 shared experts, one MLP twice as wide
        np.testing.assert_array_equal(p[m + "shared_experts.down_proj.weight"],
                                      full[m + "shared_experts.down_proj.weight"][:, s0:s1].T)
        np.testing.assert_array_equal(p[m + "experts.gate.weight"], full[m + "gate.weight"].T)  # replicated
        np.testing.assert_array_equal(p[m + "experts.e_score_correction_bias"],
                                      full[m + "moe_statics.e_score_correction_bias"])
