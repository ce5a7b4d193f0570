#!/usr/bin/env python3
"""fdlite end to end on the GPU: token identity against transformers, CUDA graphs, throughput, step times.

Runs on the GPU machine after tools/gpu/run_e2e.sh has staged Paddle 2.6.2 (host framework only: its own
kernels do nothing on sm_90, so everything that computes is fdlite's kernels) and built the ops. torch and
transformers on that machine are the reference only. One section per process, so each `LLM()` starts on a
fresh allocator and its startup numbers are its own:

    python3 tools/gpu/e2e_harness.py parity     --out DIR   # fp32 greedy vs transformers fp32; bf16 logits/agreement
    python3 tools/gpu/e2e_harness.py graphs     --out DIR   # 1,000 decode steps with CUDA graphs vs eager
    python3 tools/gpu/e2e_harness.py hf_bench   --out DIR   # transformers batched generate on the protocol (subset)
    python3 tools/gpu/e2e_harness.py throughput --out DIR   # nano-vllm protocol + decode step times at 1/16/64/256
    python3 tools/gpu/e2e_harness.py latency    --out DIR   # ms per output token through LLM.generate, async scheduling on/off
    python3 tools/gpu/e2e_harness.py diag       --out DIR   # where a decode step's time goes (host parts, eager)
    python3 tools/gpu/e2e_harness.py breakdown  --out DIR   # the throughput protocol's time by step kind
    python3 tools/gpu/e2e_harness.py churn      --out DIR   # 2,048 requests over 256 rows, token-count graphs vs not
    python3 tools/gpu/e2e_harness.py sampling   --out DIR   # each sampling feature's tokens/s beside plain sampling
    python3 tools/gpu/e2e_harness.py sampling_checks --out DIR  # penalties, bans, logprobs vs transformers; seeded graphs
    python3 tools/gpu/e2e_harness.py memory     --out DIR   # create / generate / del three times: same KV cache, memory back
    python3 tools/gpu/e2e_harness.py moe_bench  --out DIR   # ERNIE-4.5-21B-A3B, Qwen3-30B-A3B, Qwen3-4B, Llama-3.1-8B (dummy
                                                             # weights): protocol + prefill-heavy beside their roofline
    python3 tools/gpu/e2e_harness.py tp         --out DIR   # tensor_parallel_size=2, two processes sharing the GPU:
                                                             # tokens vs tp=1 and transformers, graphs vs eager

Each writes DIR/<section>.json as it goes (a crash keeps what was measured).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

ap = argparse.ArgumentParser()
ap.add_argument("section", choices=["parity", "graphs", "hf_bench", "throughput", "latency", "diag", "breakdown", "sampling", "churn",
                                    "sampling_checks", "memory", "profile", "step_times", "moe", "fp8", "moe_bench", "tp",
                                    "tp_rank"])
ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "fdl_e2e_out"))
ap.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "fdl_e2e_models"))
ap.add_argument("--quick", action="store_true")
ap.add_argument("--families", default="qwen2,qwen3,llama", help="fp32 parity families ('' for none)")
ap.add_argument("--skip-bf16", action="store_true")
ap.add_argument("--cases", default="", help="sampling, fp8, moe_bench: only the cases (moe_bench: shapes) whose name holds "
                                            "one of these comma-separated words")
ap.add_argument("--jobs", default="protocol,prefill_heavy", help="moe_bench: the jobs run on each shape")
ARGS = ap.parse_args()
os.makedirs(ARGS.out, exist_ok=True)
RES: dict = {"section": ARGS.section, "results": {}, "errors": []}
T0 = time.time()
# fdlite's device and the reference's: the GPU on the device machine; a CPU dry run of the logic elsewhere.
FDL_DEVICE = os.environ.get("FDLITE_E2E_DEVICE", "gpu")
HF_DEVICE = "cuda" if FDL_DEVICE == "gpu" else "cpu"


def wanted_case(name: str) -> bool:
    """Whether --cases picks `name` (a case, or a moe_bench shape): it holds one of the words, or no word is given."""
    words = [w for w in ARGS.cases.split(",") if w]
    return not words or any(w in name for w in words)


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def save():
    with open(os.path.join(ARGS.out, f"{ARGS.section}.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


def run(name, fn):
    log("==", name)
    t = time.time()
    try:
        RES["results"][name] = fn()
        RES["results"][name]["seconds"] = round(time.time() - t, 1)
        log("  ->", json.dumps(RES["results"][name], default=str)[:1500])
    except Exception as e:  # noqa: BLE001 - record and go on to the next case
        RES["errors"].append({"case": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]})
        log("  !! FAILED", name, type(e).__name__, str(e)[:800])
    save()


# ---- models --------------------------------------------------------------------------------------

# Shapes the GPU kernels take (head_dim 64/128), small enough for fast references: GQA, every family's switch.
GPU_BASE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
FAMILY_OVERRIDES = {"qwen2": {}, "qwen3": dict(head_dim=128), "llama": {}, "ernie45": dict(head_dim=64),
                    # MoE (the `moe` section): ERNIE-4.5-21B-A3B's pattern (dense layers 0 and 2, MoE 1 and 3, 3 of 8
                    # experts, 2 shared, fp32 router with a correction bias); Qwen3-30B-A3B's (dense layer 0, 4 of 16,
                    # renormalised); expert widths the kernels' tiles do not divide
                    "ernie45_moe": dict(head_dim=64, num_hidden_layers=4, moe_intermediate_size=72),
                    "qwen3_moe": dict(head_dim=128, num_hidden_layers=3, num_experts=16, num_experts_per_tok=4,
                                      moe_intermediate_size=40)}
# The same MoE shapes for tensor parallelism ("family@tp"): expert widths whose halves the GPU kernels take (x8).
FAMILY_OVERRIDES["ernie45_moe@tp"] = dict(FAMILY_OVERRIDES["ernie45_moe"], moe_intermediate_size=80)
FAMILY_OVERRIDES["qwen3_moe@tp"] = dict(FAMILY_OVERRIDES["qwen3_moe"], moe_intermediate_size=48)


def small_model(family: str) -> str:
    from hf_models import write_random_model  # noqa: PLC0415

    path = os.path.join(ARGS.models, family.replace("@", "_"))
    if not os.path.isfile(os.path.join(path, "config.json")):
        write_random_model(path, family.split("@")[0], seed=1, **{**GPU_BASE, **FAMILY_OVERRIDES[family]})
    return path


def symlinked_sibling(src: str, dst: str, own: tuple[str, ...], written_last: str) -> bool:
    """Folder `dst` holding symlinks to `src`'s files except `own` (the caller writes those); False when it is
    complete already (its `written_last` file exists)."""
    if os.path.isfile(os.path.join(dst, written_last)):
        return False
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name not in own and not os.path.lexists(os.path.join(dst, name)):
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    return True


def with_eos(path: str, eos: int) -> str:
    """A sibling of the model folder `path` ("<path>-eos<N>", weights symlinked) whose config.json and
    generation_config.json say EOS is token `eos` (fdlite takes EOS from the model's config, plus the
    tokenizer's, which these folders do not have)."""
    src, dst = os.path.abspath(path), f"{os.path.abspath(path).rstrip('/')}-eos{eos}"
    if not symlinked_sibling(src, dst, ("config.json", "generation_config.json"), "config.json"):
        return dst
    for name in ("generation_config.json", "config.json"):
        if os.path.isfile(os.path.join(src, name)):
            with open(os.path.join(src, name)) as f:
                cfg = json.load(f)
            cfg["eos_token_id"] = eos
            with open(os.path.join(dst, name), "w") as f:
                json.dump(cfg, f, indent=1)
    return dst


def with_qwen3_tokenizer(path: str) -> str:
    """A sibling of the model folder `path` ("<path>-tok") with its files as symlinks plus fdlite's shipped Qwen3
    tokenizer (tokenizer.json gunzipped from fdlite/assets/qwen3_tokenizer/, and tokenizer_config.json), so an
    `LLM` on it has text (bad_words, structured outputs), while `path` stays what the other sections load."""
    from hf_models import add_qwen3_tokenizer  # noqa: PLC0415

    src = os.path.abspath(path)
    dst = src.rstrip("/") + "-tok"
    if not symlinked_sibling(src, dst, ("tokenizer.json", "tokenizer_config.json"), "tokenizer_config.json"):
        return dst
    return add_qwen3_tokenizer(dst)


def qwen3_06b() -> str:
    """Qwen3-0.6B's shapes, random bf16 weights (written by transformers)."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    path = os.path.join(ARGS.models, "qwen3-0.6b-random")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                   num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                   max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True, torch_dtype="bfloat16", bos_token_id=151643,
                                   eos_token_id=151645, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(path, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return path


# ---- the transformers reference (GPU) -----------------------------------------------------------

def hf_greedy(path: str, prompts: list[list[int]], max_new: int, dtype: str):
    """Greedy continuation of each prompt alone on the GPU, with each step's top-2 logit gap."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=tdt).to(HF_DEVICE).eval()
    toks, gaps = [], []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=HF_DEVICE)
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
                               min_new_tokens=max_new, eos_token_id=None, pad_token_id=0, output_logits=True,
                               return_dict_in_generate=True)
            toks.append(y.sequences[0, len(ids):].tolist())
            top2 = [torch.topk(step[0].float(), 2).values for step in y.logits]
            gaps.append([float(t[0] - t[1]) for t in top2])
    del model
    torch.cuda.empty_cache()
    return toks, gaps


def hf_prefill_logprobs(path: str, prompts: list[list[int]], dtype: str = "float32", fp8_kv: bool = False):
    """transformers' last-token log-softmax per prompt; fp8_kv: its attention reads K / V rounded as an FP8 cache
    stores them (tests/hf_models.py, FP8_KV_ATTENTION)."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    extra = {}
    if fp8_kv:
        from hf_models import register_fp8_kv_attention  # noqa: PLC0415

        extra["attn_implementation"] = register_fp8_kv_attention()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=tdt, **extra).to(HF_DEVICE).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids], device=HF_DEVICE)).logits[0, -1].double()
            out.append(torch.log_softmax(logits, -1).cpu().numpy())
    del model
    torch.cuda.empty_cache()
    return out


def hf_model(path: str):
    """transformers' fp32 model of `path` on HF_DEVICE (TF32 off), loaded once per path."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    if path not in _HF_MODELS:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        _HF_MODELS[path] = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32).to(HF_DEVICE).eval()
    return _HF_MODELS[path]


_HF_MODELS: dict = {}


def hf_greedy_processed(path: str, prompts: list[list[int]], max_new: int, processors, eos: int | None = None):
    """Greedy continuation of each prompt alone, fp32, with the last logits passed through `processors(prompt_len)`
    (transformers-style callables (input_ids, scores) -> scores, input_ids being prompt + output) before the
    argmax; stops after sampling `eos` (kept in the output, as fdlite's token_ids keep it). Returns the tokens and
    each step's top-2 gap of the processed logits."""
    import torch  # noqa: PLC0415

    model = hf_model(path)
    toks, gaps = [], []
    with torch.no_grad():
        for ids in prompts:
            seq = torch.tensor([ids], device=HF_DEVICE)
            procs = processors(len(ids))
            x, past, out, gap = seq, None, [], []
            for _ in range(max_new):
                o = model(x, past_key_values=past, use_cache=True)
                past = o.past_key_values
                scores = o.logits[:, -1].float()
                for proc in procs:
                    scores = proc(seq, scores)
                top2 = torch.topk(scores[0], 2).values
                tok = int(torch.argmax(scores[0]))
                gap.append(float(top2[0] - top2[1]))
                out.append(tok)
                x = torch.tensor([[tok]], device=HF_DEVICE)
                seq = torch.cat([seq, x], 1)
                if tok == eos:
                    break
            toks.append(out)
            gaps.append(gap)
    return toks, gaps


def presence_frequency(prompt_len: int, presence: float, frequency: float):
    """vLLM's (and OpenAI's) rule over the output tokens only: logit -= frequency * count + presence * (count > 0)."""
    import torch  # noqa: PLC0415

    def proc(input_ids, scores):
        counts = torch.bincount(input_ids[0, prompt_len:], minlength=scores.shape[-1]).to(scores.dtype)[None]
        return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)
    return proc


def only_allowed(allowed: list[int]):
    import torch  # noqa: PLC0415

    def proc(input_ids, scores):
        keep = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
        keep[allowed] = True
        return scores.masked_fill(~keep, float("-inf"))
    return proc


# ---- fdlite ----------------------------------------------------------------------------------------

def mixed_prompts(n: int, seed: int, vocab: int, max_len: int) -> list[list[int]]:
    """Mixed lengths across 16-token block edges, and a quarter sharing a 100-token prefix (prefix-cache hits)."""
    rng = np.random.default_rng(seed)
    edges = [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, max_len]
    lengths = (edges + rng.integers(1, max_len + 1, size=max(0, n - len(edges))).tolist())[:n]
    prompts = [rng.integers(3, vocab, size=int(k)).tolist() for k in lengths]
    shared = rng.integers(3, vocab, size=100).tolist()
    for i in range(n - n // 4, n):
        prompts[i] = shared + prompts[i][: max(1, max_len - 100)]
    return prompts


def compare(got: list[list[int]], ref: list[list[int]], gaps: list[list[float]], tie: float = 1e-4) -> dict:
    exact, near_ties, bad = 0, [], []
    for i, (g, r) in enumerate(zip(got, ref)):
        if g == r:
            exact += 1
            continue
        j = next((k for k in range(min(len(g), len(r))) if g[k] != r[k]), min(len(g), len(r)))  # lengths may differ
        j = min(j, len(gaps[i]) - 1)
        (near_ties if gaps[i][j] < tie else bad).append({"prompt": i, "position": j, "ref_top2_gap": gaps[i][j]})
    return {"prompts": len(got), "exact": exact, "near_ties": near_ties, "mismatches": bad[:10],
            "num_mismatches": len(bad), "pass": not bad}


def parity_case(family: str) -> dict:
    from fdlite import LLM, SamplingParams  # noqa: PLC0415

    path = small_model(family)
    max_new = 16
    prompts = mixed_prompts(16 if ARGS.quick else 64, seed={"qwen2": 1, "qwen3": 2, "llama": 3, "ernie45": 4,
                                                            "ernie45_moe": 5, "qwen3_moe": 6}[family],
                            vocab=1024, max_len=600)
    ref, gaps = hf_greedy(path, prompts, max_new, "float32")
    # 16 at a time out of 64; a 256-token step budget (chunked prefill of the long prompts); 160 blocks of 16
    # tokens for up to 16 x 616 tokens in flight (preemption); prefix caching on (default).
    llm = LLM(path, device=FDL_DEVICE, dtype="float32", skip_tokenizer_init=True, max_num_seqs=16, block_size=16,
              max_model_len=1024, max_num_batched_tokens=256, num_gpu_blocks_override=160)
    t = time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True), use_tqdm=False)
    elapsed = time.time() - t
    got = [o.outputs[0].token_ids for o in outs]
    res = compare(got, ref, gaps)
    st = llm.last_generate_stats
    res.update(fdlite_seconds=round(elapsed, 2), steps=st.get("num_steps"), preemptions=st.get("num_preemptions"),
               cudagraph_replays=st.get("cudagraph_replays"), mixed_graph_replays=st.get("cudagraph_mixed_replays"),
               prefix_cache_hit_tokens=st.get("prefix_cache_hit_tokens"),
               prefill_tokens=st.get("prefill_tokens_computed"), startup=llm.startup_report)
    res["pass"] = res["pass"] and (st.get("num_preemptions") or 0) > 0 and (st.get("prefix_cache_hit_tokens") or 0) > 0
    del llm
    return res


def bf16_case(family: str, kv_cache_dtype: str = "auto") -> dict:
    """bf16 prefill logprobs vs the fp32 reference, measured against transformers' own bf16 error on the
    same tokens (the tolerance bf16 allows on this model); greedy agreement with transformers bf16. With
    kv_cache_dtype="fp8" the KV cache is e4m3 (prompts prefilled 64 tokens a step, so later chunks read it)."""
    from fdlite import LLM, SamplingParams  # noqa: PLC0415

    path = small_model(family)
    prompts = mixed_prompts(16, seed=7, vocab=1024, max_len=300)
    ref32 = hf_prefill_logprobs(path, prompts, "float32")
    ref16 = hf_prefill_logprobs(path, prompts, "bfloat16")
    # FP8: transformers fp32 with its K / V rounded as the FP8 cache stores them, the format's own error
    ref8 = hf_prefill_logprobs(path, prompts, "float32", fp8_kv=True) if kv_cache_dtype == "fp8" else None
    llm = LLM(path, device=FDL_DEVICE, dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=16, block_size=16,
              max_model_len=1024, num_gpu_blocks_override=400, kv_cache_dtype=kv_cache_dtype,
              **({"max_num_batched_tokens": 64} if kv_cache_dtype == "fp8" else {}))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=1, logprobs=20), use_tqdm=False)
    ours, hfs, e4m3 = [], [], []
    for k, (o, r32, r16) in enumerate(zip(outs, ref32, ref16)):
        lp = o.outputs[0].logprobs[0]
        ids = np.asarray(list(lp), np.int64)
        ours.append(float(np.max(np.abs(np.asarray([lp[t].logprob for t in lp]) - r32[ids]))))
        hfs.append(float(np.max(np.abs(r16[ids] - r32[ids]))))
        if ref8 is not None:
            e4m3.append(float(np.max(np.abs(ref8[k][ids] - r32[ids]))))
    max_new = 16
    ref, _ = hf_greedy(path, prompts, max_new, "bfloat16")
    ref_fp32, _ = hf_greedy(path, prompts, max_new, "float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]

    def rates(a, b):
        same = sum(x == y for g, r in zip(a, b) for x, y in zip(g, r)) / (len(a) * max_new)
        before = sum(next((k for k in range(len(r)) if g[k] != r[k]), len(r)) for g, r in zip(a, b)) / (len(a) * max_new)
        return {"identical_sequences": sum(g == r for g, r in zip(a, b)), "tokens_before_first_divergence": before,
                "tokens_equal_positionwise": same}

    del llm
    tol = 2 * max(hfs) + 1e-3
    fp8_bar = {}
    if e4m3:  # the FP8 cache's bar: bf16 (transformers' own error) on top of e4m3's (transformers fp32 with e4m3 K / V)
        tol8 = 2 * (max(hfs) + max(e4m3)) + 1e-3
        fp8_bar = {"transformers_fp32_e4m3_kv_max_abs_err_vs_fp32": max(e4m3), "errs_hf_e4m3_kv": e4m3,
                   "tolerance_fp8(2x (transformers bf16 + e4m3 K / V) + 1e-3)": tol8, "pass_fp8_bar": max(ours) <= tol8}
    return {**fp8_bar, "prefill_logprob_max_abs_err_vs_fp32": max(ours), "transformers_bf16_max_abs_err_vs_fp32": max(hfs),
            "tolerance(2x transformers bf16 + 1e-3)": tol, "pass": max(ours) <= tol, "errs_ours": ours, "errs_hf_bf16": hfs,
            "sequences": len(got), "fdlite_bf16_vs_transformers_bf16": rates(got, ref),
            "transformers_bf16_vs_transformers_fp32 (context)": rates(ref, ref_fp32),
            "fdlite_bf16_vs_transformers_fp32": rates(got, ref_fp32), "greedy_tokens": got}


def section_parity():
    fams = [f for f in ARGS.families.split(",") if f]
    for fam in fams:
        run(f"fp32_greedy_{fam}", lambda f=fam: parity_case(f))
    if FDL_DEVICE == "gpu" and not ARGS.skip_bf16:  # no bfloat16 matmul on Paddle's CPU
        for fam in ("qwen3", "llama"):
            run(f"bf16_{fam}", lambda f=fam: bf16_case(f))


def eager_then_graphs(path: str, prompts: list[list[int]], params, **common):
    """The same requests on an eager engine, then on one with CUDA graphs: (eager tokens, graph tokens, the graph
    engine's generate stats, the graph engine)."""
    from fdlite import LLM  # noqa: PLC0415

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)]

    eager = LLM(path, use_cudagraph=False, **common)
    want = tokens(eager)
    del eager
    llm = LLM(path, use_cudagraph=True, **common)
    got = tokens(llm)
    return want, got, llm.last_generate_stats, llm


# ---- tensor parallelism: two processes sharing the GPU (issue 27) ---------------------------------

PARITY_OPTIONS = dict(dtype="float32", skip_tokenizer_init=True, max_num_seqs=16, block_size=16, max_model_len=1024,
                      max_num_batched_tokens=256, num_gpu_blocks_override=160)
TP_GRAPH_STEPS = [40, 30, 20, 10] if ARGS.quick else [1000, 700, 300, 100]  # the long run of the graph check: 4, 3, 2, 1 rows -> padded sizes 4, 2, 1


def tp_long_prompts() -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(21)
    return [rng.integers(3, 1024, size=int(k)).tolist() for k in (7, 60, 130, 33)], TP_GRAPH_STEPS


def tp_devices() -> list[str]:
    """The two ranks' GPUs: FDLITE_TP_DEVICES ("0,1": one GPU each, on a machine that has two; the custom all-reduce
    then reaches the peer's buffers over NVLink / PCIe) or GPU 0 for both (the one-GPU machines: ranks share it)."""
    ids = [d.strip() for d in os.environ.get("FDLITE_TP_DEVICES", "0,0").split(",") if d.strip()]
    if len(ids) != 2 or not all(d.isdigit() for d in ids):
        raise ValueError(f"FDLITE_TP_DEVICES must name two GPU ids, e.g. 0,1; got {ids}")
    return [f"gpu:{d}" for d in ids]


def section_tp():
    """tensor_parallel_size=2 on one GPU, two processes sharing it (`device="gpu:0"` in each, a gloo group, every
    collective of a step on fdlite's custom all-reduce library over CUDA IPC; FDLITE_TP_DEVICES=0,1 puts the ranks on
    two GPUs instead): fp32 greedy tokens against tp=1 and
    transformers fp32 on the parity check's job (joins, preemption, prefix hits, chunked prefill; CUDA graphs on),
    1,000 decode steps with graphs against eager at tp=2, the startup order from each rank's recorded phases, and the
    custom library's counters (all-reduces captured and registered, device error bits). This process computes the
    references and the tp=1 tokens, then starts the ranks (`tp_rank`, this script again) and reads their files."""
    import subprocess  # noqa: PLC0415

    from fdlite import LLM, SamplingParams  # noqa: PLC0415

    fams = [f for f in ARGS.families.split(",") if f]
    spec = {"families": {}, "out": ARGS.out}
    refs = {}
    small_model("qwen3")  # the ranks' graph check runs it: written here, not by two processes at once
    for fam in fams:
        path = small_model(fam)
        prompts = mixed_prompts(16 if ARGS.quick else 64, seed=40 + fams.index(fam), vocab=1024, max_len=600)
        ref, gaps = hf_greedy(path, prompts, 16, "float32")
        llm = LLM(path, device=FDL_DEVICE, **PARITY_OPTIONS)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        tp1 = [o.outputs[0].token_ids for o in outs]
        llm.close()
        refs[fam] = (ref, gaps, tp1)
        spec["families"][fam] = {"path": path, "prompts": prompts}
        log("  tp1", fam, compare(tp1, ref, gaps))
    spec_path = os.path.join(ARGS.out, "tp_spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    port = 30000 + os.getpid() % 20000
    eps = [f"127.0.0.1:{port + 1 + r}" for r in range(2)]
    procs = []
    for r in range(2):
        env = {**os.environ, "PADDLE_TRAINER_ID": str(r), "PADDLE_TRAINERS_NUM": "2", "PADDLE_CURRENT_ENDPOINT": eps[r],
               "PADDLE_TRAINER_ENDPOINTS": ",".join(eps), "PADDLE_MASTER": f"127.0.0.1:{port}",
               "PADDLE_RANK_IN_NODE": str(r), "PADDLE_LOCAL_RANK": str(r)}
        log_f = open(os.path.join(ARGS.out, f"tp_rank{r}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, __file__, "tp_rank", "--out", ARGS.out, "--models", ARGS.models]
                                       + ["--quick"] * ARGS.quick, env=env, stdout=log_f,
                                       stderr=subprocess.STDOUT), log_f))
    limit = float(os.environ.get("FDLITE_TP_LIMIT_S", "400"))
    t = time.time()
    for p, log_f in procs:
        try:
            p.wait(timeout=max(1.0, limit - (time.time() - t)))
        except subprocess.TimeoutExpired:
            p.kill()
        log_f.close()
    ranks = []
    for r in range(2):
        path = os.path.join(ARGS.out, f"tp_rank{r}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path) else {"missing": True})
        log(f"  rank {r} exit {procs[r][0].returncode}; log tail:",
            open(os.path.join(ARGS.out, f"tp_rank{r}.log")).read()[-1500:])
    r0 = ranks[0]
    for fam in fams:
        def case(f=fam):
            ref, gaps, tp1 = refs[f]
            got = r0.get("families", {}).get(f)
            if got is None or "error" in got:
                raise RuntimeError(f"rank 0 has no tokens for {f}: {got and got.get('error')}")
            res = {"vs_transformers": compare(got["tokens"], ref, gaps), "vs_tp1": compare(got["tokens"], tp1, gaps),
                   **{k: v for k, v in got.items() if k != "tokens"},
                   "rank1": {k: v for k, v in ranks[1].get("families", {}).get(f, {}).items() if k != "tokens"}}
            res["pass"] = bool(res["vs_transformers"]["pass"] and res["vs_tp1"]["pass"] and got["startup_order_ok"]
                               and (got.get("preemptions") or 0) > 0 and (got.get("prefix_cache_hit_tokens") or 0) > 0
                               and not got.get("device_errors") and got.get("custom_stats", {}).get("graph", 0) > 0)
            return res
        run(f"tp2_fp32_greedy_{fam}", case)

    def graphs():
        g = r0.get("graphs")
        if g is None or "error" in g:
            raise RuntimeError(f"rank 0 has no graph check: {g and g.get('error')}")
        return {**g, "pass": bool(g["identical"] and g["cudagraph_replays"] >= 990 and not g.get("device_errors"))}
    run("tp2_graphs_1000_decode_steps", graphs)

    def through_the_launcher():
        """The same ranks started the way a user starts them, `python -m paddle.distributed.launch --devices 0,0`
        (both on GPU 0), on the first family's job alone: its tokens against the ranks above. Not with
        FDLITE_TP_DEVICES (the launcher's own GPU selection per rank is not what the ranks above do)."""
        fam = fams[0]
        out = os.path.join(ARGS.out, "launch")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "tp_spec.json"), "w") as f:
            json.dump({"families": {fam: spec["families"][fam]}, "skip_graphs": True}, f)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--devices", "0,0", "--log_dir",
               os.path.join(out, "log"), __file__, "tp_rank", "--out", out, "--models", ARGS.models]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        got = json.load(open(os.path.join(out, "tp_rank0.json"))) if os.path.exists(
            os.path.join(out, "tp_rank0.json")) else {}
        tokens = got.get("families", {}).get(fam, {}).get("tokens")
        res = {"family": fam, "launcher_rc": p.returncode, "launcher_tail": (p.stdout + p.stderr)[-1500:],
               "same_tokens_as_the_ranks_above": tokens is not None and tokens == r0["families"][fam]["tokens"],
               "error": got.get("families", {}).get(fam, {}).get("error")}
        res["pass"] = bool(res["same_tokens_as_the_ranks_above"])
        return res
    if os.environ.get("FDLITE_TP_LAUNCH_CHECK") and "FDLITE_TP_DEVICES" not in os.environ:
        run("tp2_through_paddle_distributed_launch", through_the_launcher)


def section_tp_rank():
    """One rank of `section_tp` (started by it, with the launcher's environment variables)."""
    from fdlite import LLM, SamplingParams  # noqa: PLC0415
    from fdlite.distributed.communicator import Communicator  # noqa: PLC0415
    from fdlite.kernels.allreduce import is_capturing_custom_allreduce  # noqa: PLC0415

    counts = {"total": 0, "capturing": 0}
    real = Communicator.all_reduce

    def counting(self, x):
        counts["total"] += 1
        counts["capturing"] += int(is_capturing_custom_allreduce())
        return real(self, x)
    Communicator.all_reduce = counting
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    spec = json.load(open(os.path.join(ARGS.out, "tp_spec.json")))
    out = {"rank": rank, "families": {}}
    path_out = os.path.join(ARGS.out, f"tp_rank{rank}.json")

    def write():
        with open(path_out, "w") as f:
            json.dump(out, f, default=str)

    def startup_order_ok(llm) -> bool:
        ph = llm.phases
        if not any(e.name == "capture_custom_allreduce" for e in ph.events):
            return False  # no graphs were captured (a CPU dry run)
        order = [ph.index("end", "load_weights"), ph.index("end", "profile_run"), ph.index("end", "kv_cache"),
                 ph.index("begin", "capture_custom_allreduce"), ph.index("begin", "cudagraph_capture"),
                 ph.index("point", "cudagraph_captured"), ph.index("end", "cudagraph_capture"),
                 ph.index("end", "capture_custom_allreduce")]
        return order == sorted(order)

    def custom_state(llm) -> dict:
        custom = llm.runner.comm.custom
        return {"custom_stats": custom.stats() if custom else None,
                "device_errors": custom.device_errors(clear=True) if custom else ["no custom all-reduce"],
                "backend": llm.runner.comm.backend, "ranks_on_device": llm.runner.comm.ranks_on_device}

    device = tp_devices()[rank] if FDL_DEVICE == "gpu" else FDL_DEVICE  # a CPU dry run: gloo, no custom library
    out["device"] = device
    try:  # 1,000 decode steps, graphs against eager, at tp=2
        if spec.get("skip_graphs"):
            raise RuntimeError("skipped (the launcher check runs the first family's job only)")
        prompts, steps = tp_long_prompts()
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in steps]
        path = small_model("qwen3")
        common = dict(PARITY_OPTIONS, device=device, tensor_parallel_size=2, max_num_seqs=4, max_model_len=1200,
                      num_gpu_blocks_override=400)
        tok = {}
        for graphs_on in (False, True):
            t = time.time()
            llm = LLM(path, use_cudagraph=graphs_on, **common)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tok[graphs_on] = [o.outputs[0].token_ids for o in outs]
            st = llm.last_generate_stats
            if graphs_on:
                out["graphs"] = {"identical": tok[True] == tok[False], "steps": st.get("num_steps"),
                                 "cudagraph_replays": st.get("cudagraph_replays"),
                                 "padded_replays": st.get("cudagraph_padded_replays"),
                                 "graph_s": round(time.time() - t, 1), **custom_state(llm)}
            else:
                out["eager_s"] = round(time.time() - t, 1)
            llm.close()
    except Exception as e:  # noqa: BLE001
        out["graphs"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    log(f"rank {rank} graphs", out.get("graphs"))
    write()
    opts = dict(device=device, tensor_parallel_size=2, use_cudagraph=True)
    for fam, case in spec["families"].items():
        t = time.time()
        try:
            counts.update(total=0, capturing=0)
            llm = LLM(case["path"], **PARITY_OPTIONS, **opts)
            captured = dict(counts)
            outs = llm.generate([{"prompt_token_ids": p} for p in case["prompts"]],
                                SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
            st = llm.last_generate_stats
            out["families"][fam] = {
                "tokens": [o.outputs[0].token_ids for o in outs] if rank == 0 else [], "outputs": len(outs),
                "steps": st.get("num_steps"), "cudagraph_replays": st.get("cudagraph_replays"),
                "mixed_graph_replays": st.get("cudagraph_mixed_replays"), "preemptions": st.get("num_preemptions"),
                "prefix_cache_hit_tokens": st.get("prefix_cache_hit_tokens"), "startup_order_ok": startup_order_ok(llm),
                "all_reduces_at_startup": captured, "seconds": round(time.time() - t, 1),
                "startup_s": round(llm.startup_report.get("total_s", 0), 2), **custom_state(llm)}
            llm.close()
        except Exception as e:  # noqa: BLE001 - recorded; the parent reports it
            out["families"][fam] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        log(f"rank {rank}", fam, {k: v for k, v in out["families"][fam].items() if k != "tokens"})
        write()


def churning_job(family: str, seed: int, requests: int, prompt_lens: tuple[int, int], blocks: int):
    """`requests` random prompts (lengths in `prompt_lens`) with 4-29 greedy tokens each over 4 rows and a 64-token
    step budget, fp32: nearly every step mixes prefill chunks with decodes. `eager_then_graphs` of it."""
    from fdlite import SamplingParams  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 1024, size=int(k)).tolist() for k in rng.integers(*prompt_lens, size=requests)]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(4, 30, requests)]
    return eager_then_graphs(small_model(family), prompts, params, device=FDL_DEVICE, dtype="float32",
                             skip_tokenizer_init=True, max_num_seqs=4, block_size=16, max_model_len=1024,
                             max_num_batched_tokens=64, num_gpu_blocks_override=blocks)


# ---- CUDA graphs: 1,000 decode steps ------------------------------------------------------------

def section_graphs():
    def case():
        from fdlite import LLM, SamplingParams  # noqa: PLC0415

        path = small_model("qwen3")
        rng = np.random.default_rng(11)
        prompts = [rng.integers(3, 1024, size=int(k)).tolist() for k in (5, 40, 100, 17, 64, 250)]
        steps = [1000, 900, 700, 500, 300, 100]  # the batch shrinks: 6, 5, 4, 3, 2, 1 rows -> padded sizes 8, 4, 2, 1
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in steps]
        common = dict(device=FDL_DEVICE, dtype="float32", skip_tokenizer_init=True, max_num_seqs=8, block_size=16,
                      max_model_len=1400, num_gpu_blocks_override=600)
        eager = LLM(path, use_cudagraph=False, **common)  # graphs are on by default
        t = time.time()
        want = [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                use_tqdm=False)]
        eager_s = time.time() - t
        del eager
        llm = LLM(path, use_cudagraph=True, **common)
        bufs = llm.runner.buffers.tensors()
        before = {k: v.data_ptr() for k, v in bufs.items()}
        t = time.time()
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)]
        graph_s = time.time() - t
        after = {k: v.data_ptr() for k, v in llm.runner.buffers.tensors().items()}
        st = llm.last_generate_stats
        by_size = {f"{s}:{n}": c for (s, n), c in llm.runner.graph_runner.replays_by_size.items()}
        res = {"identical": got == want, "decode_steps": st.get("num_steps"), "tokens": sum(map(len, got)),
               "cudagraph_replays": st.get("cudagraph_replays"), "padded_replays": st.get("cudagraph_padded_replays"),
               "replays_by_size(graph:batch)": by_size, "buffer_addresses_stable": before == after,
               "captured_sizes": sorted(llm.runner.graph_runner.graphs), "eager_s": round(eager_s, 2),
               "graph_s": round(graph_s, 2), "startup": llm.startup_report}
        res["pass"] = bool(res["identical"] and res["buffer_addresses_stable"] and (res["padded_replays"] or 0) > 0
                           and (res["cudagraph_replays"] or 0) >= 990)
        return res

    def mixed_case():
        """Over 1,000 mixed steps of a churning job (130 requests over 4 rows, prompts prefilled 64 tokens a step
        beside the others' decodes): nearly every step mixes prefill and decode tokens and replays a token-count
        graph (issue 24 asks for 1,000 of them); the tokens equal the eager engine's."""
        want, got, st, llm = churning_job("qwen3", seed=12, requests=130, prompt_lens=(200, 800), blocks=400)
        mixed = llm.runner.mixed_graph_runner
        res = {"identical": got == want, "steps": st["num_steps"], "cudagraph_replays": st["cudagraph_replays"],
               "mixed_replays": st["cudagraph_mixed_replays"], "mixed_sizes": sorted(mixed.graphs) if mixed else [],
               "distinct_token_counts_replayed": len({t for _, t in mixed.replays_by_size}) if mixed else 0}
        res["pass"] = bool(res["identical"] and st["cudagraph_replays"] >= 0.9 * st["num_steps"]
                           and st["cudagraph_mixed_replays"] >= max(1000, 0.8 * st["num_steps"]))
        return res

    run("graphs_1000_decode_steps", case)
    run("graphs_mixed_steps", mixed_case)


# ---- memory: create / generate / delete, three times in one process ------------------------------

def section_memory():
    """What a notebook does: `LLM(...)`, generate, `del llm; gc.collect()`, and again. Every round must get the same
    KV cache, and each delete must give the memory back: Paddle's allocated bytes after each delete within 100 MiB
    of where they were before the first `LLM` (on a CPU dry run: the process's RSS, within 256 MiB)."""
    import gc  # noqa: PLC0415

    from fdlite import LLM, SamplingParams  # noqa: PLC0415

    gpu = FDL_DEVICE == "gpu"
    if gpu:
        import paddle  # noqa: PLC0415

    def mib(n):
        return round(n / 2**20, 1)

    def stats():
        if gpu:
            return {"allocated_MiB": mib(paddle.device.cuda.memory_allocated()),
                    "reserved_MiB": mib(paddle.device.cuda.memory_reserved())}
        with open("/proc/self/statm") as f:
            return {"rss_MiB": mib(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))}

    key, bound = ("allocated_MiB", 100) if gpu else ("rss_MiB", 256)
    state = {}

    def setup():
        # Qwen3-0.6B's shapes on the GPU (random bf16 weights); the dry run's small model on CPU.
        state["path"] = qwen3_06b() if gpu else small_model("qwen3")
        gc.collect()
        state["start"] = stats()
        out = {"model": os.path.basename(state["path"]), "start": state["start"]}
        if gpu:
            from paddle.base import core  # noqa: PLC0415

            out["peak_reset_available"] = bool(getattr(paddle.device.cuda, "reset_max_memory_allocated", None)
                                               or hasattr(core, "device_memory_stat_reset_peak_value"))
        return out

    def round_case(i):
        def f():
            rng = np.random.default_rng(i)
            prompts = [{"prompt_token_ids": rng.integers(3, 1000, size=int(k)).tolist()} for k in (7, 60, 200, 513)]
            before = stats()
            t = time.time()
            llm = LLM(state["path"], device=FDL_DEVICE, skip_tokenizer_init=True, max_model_len=4096 if gpu else 2048,
                      use_cudagraph=True)  # the dry run's model has 2048 positions
            created, create_s = stats(), time.time() - t
            outs = llm.generate(prompts, SamplingParams(temperature=0.8, seed=i, max_tokens=32, ignore_eos=True),
                                use_tqdm=False)
            generated = stats()
            res = {"kv_blocks": llm.num_blocks, "create_s": round(create_s, 1),
                   "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                   "cudagraph_sizes": llm.startup_report["cudagraph_sizes"],
                   "cudagraph_replays": llm.last_generate_stats.get("cudagraph_replays"),
                   "before": before, "after_create": created, "after_generate": generated}
            t = time.time()
            del llm  # no cycle keeps it: this alone releases it (the collector below should find nothing of it)
            res["after_del"], res["del_s"] = stats(), round(time.time() - t, 2)
            gc.collect()
            res["after_del_gc"] = stats()
            res["pass"] = (res["tokens"] == 32 * len(prompts)
                           and res["after_del_gc"][key] - state["start"][key] <= bound)
            return res
        return f

    def summary():
        rounds = [RES["results"].get(f"round_{i}") for i in range(3)]
        if any(r is None for r in rounds):
            return {"pass": False, "why": "a round failed (see errors)"}
        blocks = [r["kv_blocks"] for r in rounds]
        kept = [round(r["after_del_gc"][key] - state["start"][key], 1) for r in rounds]
        grown = [round(r["after_create"][key] - r["before"][key], 1) for r in rounds]
        return {"kv_blocks": blocks, f"{key}_kept_after_each_delete": kept, f"{key}_per_engine": grown,
                "bound_MiB": bound, "pass": len(set(blocks)) == 1 and blocks[0] > 0 and max(kept) <= bound
                and all(r["pass"] for r in rounds)}

    run("setup", setup)
    if "path" not in state:
        return
    for i in range(3):
        run(f"round_{i}", round_case(i))
    run("summary", summary)


# ---- throughput (nano-vllm's protocol) ------------------------------------------------------------

def set_kernels(attn_mma=True, decode_mma=True):
    """The ops library's attention kernels for the launches that follow: attn_mma (FDLITE_ATTN_MMA) True the default
    (wgmma on the H100), False the CUDA-core tile kernel, or a mode (0 CUDA cores, 1 mma.sync, 2 wgmma); decode_mma
    (FDLITE_DECODE_MMA) True the default (tensor cores), False the CUDA-core kernel. No argument: the defaults. Graphs
    keep what they captured. Nothing on CPU."""
    if FDL_DEVICE == "gpu":
        from fdlite.kernels import gpu as gpu_ops  # noqa: PLC0415

        gpu_ops.set_options(attn_mma=None if attn_mma is True else int(attn_mma),
                            decode_mma=None if decode_mma is True else False)


def protocol(n=256, max_in=1024, max_out=1024, seed=0):
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_in))] for _ in range(n)]
    outs = [random.randint(100, max_out) for _ in range(n)]
    return prompts, outs


def protocol_params(outs):
    """The protocol's sampling: temperature 0.6, ignore_eos, each request its own output length."""
    from fdlite import SamplingParams  # noqa: PLC0415

    return [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in outs]


def dense_llm(path: str | None = None, **options):
    """An engine on Qwen3-0.6B's shapes (or `path`) as the throughput sections measure it: 256 rows, 2,048-token
    context, 8,192-token steps, graphs on, no tokenizer; `options` on top."""
    from fdlite import LLM  # noqa: PLC0415

    return LLM(path or qwen3_06b(), **{
        "skip_tokenizer_init": True, "device": FDL_DEVICE, "max_num_seqs": 256, "max_model_len": 2048,
        "max_num_batched_tokens": 8192, "use_cudagraph": True, **options})


def prefill_heavy_prompts(n, lo=1024, hi=2040):
    """The prefill-heavy jobs' prompts (issue 25): n prompts of lo-hi random token ids (2,040 fits max_model_len
    2,048), the same ones in every section."""
    random.seed(1)
    return [[random.randint(0, 10000) for _ in range(random.randint(lo, hi))] for _ in range(n)]


def prefill_heavy_job(llm, prompts) -> dict:
    """Issue 25's prefill-heavy job on `llm`: `prompts` (prefill_heavy_prompts: 1,024-2,040 tokens, to fit
    max_model_len 2,048), 8 output tokens each, greedy; tokens/s over input and output tokens. `generate_s` is the
    generate call's own time (`run` writes the whole case's into "seconds")."""
    from fdlite import SamplingParams  # noqa: PLC0415

    t = time.time()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    s = time.time() - t
    n_in, n_out = sum(map(len, prompts)), sum(len(o.outputs[0].token_ids) for o in res)
    st = llm.last_generate_stats
    return {"requests": len(prompts), "input_tokens": n_in, "output_tokens": n_out, "generate_s": round(s, 2),
            "tokens_per_s": round((n_in + n_out) / s, 1), "steps": st.get("num_steps"),
            "cudagraph_replays": st.get("cudagraph_replays")}


def warm_up(llm) -> None:
    """One tiny request before a timed job (first-call costs out of its time; token ids no job's prompt starts
    with, so it leaves nothing in the prefix cache that a job could hit)."""
    from fdlite import SamplingParams  # noqa: PLC0415

    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)


def run_protocol(llm) -> dict:
    """nano-vllm's protocol on `llm` after a short warm-up: temperature 0.6, ignore_eos, output tokens/s."""

    prompts, outs = protocol()
    warm_up(llm)
    params = protocol_params(outs)
    t = time.time()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    s = time.time() - t
    produced = sum(len(o.outputs[0].token_ids) for o in res)
    st = llm.last_generate_stats
    return {"requests": len(prompts), "output_tokens": produced, "requested_output_tokens": sum(outs),
            "input_tokens": sum(map(len, prompts)), "seconds": round(s, 2),
            "output_tokens_per_s": round(produced / s, 1), "steps": st.get("num_steps"),
            "cudagraph_replays": st.get("cudagraph_replays"), "preemptions": st.get("num_preemptions")}


def section_hf_bench():
    def case():
        import torch  # noqa: PLC0415
        import transformers  # noqa: PLC0415

        path = qwen3_06b()
        prompts, outs = protocol()
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        batch = order[:64] if not ARGS.quick else order[:16]  # the first batch of 64 by length (time: see docs/benchmarks.md)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(HF_DEVICE).eval()
        width = max(len(prompts[i]) for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(batch):  # left padding
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        max_new = max(outs[i] for i in batch)
        with torch.no_grad():
            model.generate(ids[:2, -8:].cuda(), attention_mask=mask[:2, -8:].cuda(), max_new_tokens=4, do_sample=False,
                           pad_token_id=0)
            torch.cuda.synchronize()
            t = time.time()
            model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=max_new, min_new_tokens=max_new,
                           do_sample=True, temperature=0.6, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)
            torch.cuda.synchronize()
            s = time.time() - t
        requested = sum(outs[i] for i in batch)
        return {"batch_requests": len(batch), "max_new_tokens": max_new, "requested_output_tokens": requested,
                "seconds": round(s, 2), "requested_output_tokens_per_s": round(requested / s, 1),
                "torch": torch.__version__, "transformers": transformers.__version__}

    run("transformers_first_batch_of_64", case)


def decode_flat(b: int, ctx: int, bs: int, num_blocks: int, rng):
    """A decode batch of b rows, each at position ctx - 1 over its own blocks (timing only: the KV is whatever
    the cache holds)."""
    from fdlite.layers.forward_meta import FlatBatch  # noqa: PLC0415
    from fdlite.sample.sampler import SamplingBatch  # noqa: PLC0415

    nb = ctx // bs + 1
    tables = (np.arange(b * nb, dtype=np.int32).reshape(b, nb)) % num_blocks
    pos = np.full(b, ctx - 1, np.int64)
    flat = FlatBatch(input_ids=rng.integers(0, 10000, b).astype(np.int64), positions=pos,
                     slot_mapping=tables[np.arange(b), pos // bs].astype(np.int64) * bs + pos % bs,
                     token_rows=np.arange(b, dtype=np.int64), block_tables=tables,
                     seq_lens_kv=np.full(b, ctx, np.int32), cu_seqlens_q=np.arange(b + 1, dtype=np.int32),
                     logits_indices=np.arange(b, dtype=np.int64), num_decodes=b)
    sb = SamplingBatch(temperature=np.zeros(b, np.float32), top_k=np.zeros(b, np.int64),
                       top_p=np.ones(b, np.float32), min_p=np.zeros(b, np.float32),
                       seeds=np.zeros(b, np.uint64), positions=pos, num_logprobs=np.full(b, -1, np.int64))
    return flat, sb


def _median_ms(fn, n=25, warm=5) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(float(np.median(times[warm:])) * 1e3, 3)


def _gpu_ms(fn, n=25, warm=5) -> float:
    """Median GPU time of fn()'s work in ms: our cudaEvents on Paddle's current stream (Paddle 2.6's
    Event.elapsed_time is a stub), n calls, the first `warm` not counted."""
    from fdlite.kernels import gpu as gpu_ops  # noqa: PLC0415

    capi, stream = gpu_ops.capi(), gpu_ops.current_stream_handle()
    if "events" not in _EVENTS:
        _EVENTS["events"] = (capi.fdl_event_create(), capi.fdl_event_create())
    e0, e1 = _EVENTS["events"]
    times = []
    for _ in range(n):
        capi.fdl_event_record(e0, stream)
        fn()
        capi.fdl_event_record(e1, stream)
        times.append(capi.fdl_event_elapsed_ms(e0, e1))
    return round(float(np.median(times[warm:])), 3)


_EVENTS: dict = {}


def section_diag():
    """Where a decode step's time goes: the host parts of a graph step at batch 1, and the eager step with
    and without the wrappers' argument checks, before and after a throughput-sized run."""
    import paddle  # noqa: PLC0415

    from fdlite.kernels import gpu as gpu_ops  # noqa: PLC0415

    state = {}

    def startup():
        state["llm"] = dense_llm()
        return {"startup": state["llm"].startup_report}

    def parts(tag):
        def case():
            llm = state["llm"]
            runner = llm.runner
            gr = runner.graph_runner
            rng = np.random.default_rng(0)
            out = {}
            for b in ((1, 16, 64, 256) if ARGS.quick else (1, 64)):
                flat, sb = decode_flat(b, 512, llm.config.block_size, llm.num_blocks, rng)
                size = gr.size_for(flat)
                row = {}
                row["step_graph_ms"] = _median_ms(lambda: runner.sampler(runner.forward(flat, True), sb))
                row["write_padded_ms"] = _median_ms(lambda: gr._write(flat, size))
                row["graph_body_gpu_ms"] = _gpu_ms(lambda: gr.graphs[size].replay())
                row["replay_call_return_ms"] = _median_ms(lambda: gr.graphs[size].replay())
                paddle.device.synchronize()
                row["replay_synchronised_ms"] = _median_ms(
                    lambda: (gr.graphs[size].replay(), paddle.device.synchronize()))
                hidden = gr.graphs[size].replay()[:b]
                idx = runner.buffers.logits_index_view(b)
                runner.buffers.logits_indices.write(flat.logits_indices)
                row["compute_logits_call_ms"] = _median_ms(lambda: runner.model.compute_logits(hidden, idx))
                logits = runner.model.compute_logits(hidden, idx)
                paddle.device.synchronize()
                row["lm_head_gpu_ms"] = _gpu_ms(lambda: runner.model.compute_logits(hidden, idx), n=20, warm=0)
                row["sampler_call_ms"] = _median_ms(lambda: runner.sampler(logits, sb))
                row["argmax_call_ms"] = _median_ms(lambda: gpu_ops.argmax(logits))
                row["step_eager_ms"] = _median_ms(lambda: runner.sampler(runner.forward(flat, False), sb), n=12, warm=2)
                gpu_ops.set_checks(False)
                row["step_eager_no_checks_ms"] = _median_ms(lambda: runner.sampler(runner.forward(flat, False), sb),
                                                            n=12, warm=2)
                row["step_graph_no_checks_ms"] = _median_ms(lambda: runner.sampler(runner.forward(flat, True), sb))
                gpu_ops.set_checks(True)
                out[f"batch_{b}"] = row
                log("  ", tag, b, row)
            out["memory_allocated_GiB"] = round(paddle.device.cuda.memory_allocated() / 2**30, 2)
            out["memory_reserved_GiB"] = round(paddle.device.cuda.memory_reserved() / 2**30, 2)
            return out
        return case

    def generate():
        llm = state["llm"]
        prompts, outs = protocol()
        t = time.time()
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     protocol_params(outs), use_tqdm=False)
        return {"seconds": round(time.time() - t, 2)}

    run("startup", startup)
    if "llm" in state:
        run("parts_fresh", parts("fresh"))
        if ARGS.quick:  # the fresh engine only (a switch compared in a second process)
            return
        run("throughput_run", generate)
        run("parts_after_throughput", parts("after"))
        paddle.device.cuda.empty_cache()
        run("parts_after_empty_cache", parts("emptied"))


def section_throughput():
    import paddle  # noqa: PLC0415

    state = {}

    def startup():
        path = qwen3_06b()
        t = time.time()
        state["llm"] = dense_llm(path)
        llm = state["llm"]
        return {"wall_s": round(time.time() - t, 1), "startup": llm.startup_report,
                "kv_blocks": llm.num_blocks, "block_size": llm.config.block_size,
                "max_num_batched_tokens": llm.config.max_num_batched_tokens,
                "memory_allocated_GiB": round(paddle.device.cuda.memory_allocated() / 2**30, 2),
                "memory_reserved_GiB": round(paddle.device.cuda.memory_reserved() / 2**30, 2)}

    def bench():
        return run_protocol(state["llm"])

    def step_times():
        llm = state["llm"]
        runner = llm.runner
        bs = llm.config.block_size
        ctx = 512
        weight_bytes = sum(int(np.prod(p.shape)) * 2 for p in runner.model.parameters())
        kv_per_token = runner.bytes_per_block // bs
        rng = np.random.default_rng(0)
        out = {}
        for b in (1, 8, 16, 64, 256):
            flat, sb = decode_flat(b, ctx, bs, llm.num_blocks, rng)
            row = {}
            for graphs in (False, True):
                times = []
                for i in range(25):
                    t = time.perf_counter()
                    runner.sampler(runner.forward(flat, use_graphs=graphs), sb)  # ids reach the host: synchronised
                    times.append(time.perf_counter() - t)
                row["graph_ms" if graphs else "eager_ms"] = round(float(np.median(times[5:])) * 1e3, 3)
            # GPU time of the captured model body alone (our cudaEvents on Paddle's stream; Paddle 2.6's
            # Event.elapsed_time is a stub): what the step costs beyond it is the LM head, the sampler and host work.
            gr = runner.graph_runner
            size = gr.size_for(flat)
            gr._write(flat, size)
            row["graph_replay_gpu_ms"] = _gpu_ms(lambda: gr.graphs[size].replay())
            roof = (weight_bytes + b * ctx * kv_per_token) / 3.0e12
            row["roofline_ms"] = round(roof * 1e3, 3)
            row["bytes_read_MB"] = round((weight_bytes + b * ctx * kv_per_token) / 1e6, 1)
            out[f"batch_{b}"] = row
            log("   step", b, row)
        out["context"] = ctx
        out["weight_bytes"] = weight_bytes
        return out

    def prefill_heavy():
        return prefill_heavy_job(state["llm"], prefill_heavy_prompts(1024))

    run("startup_qwen3_0.6b_bf16", startup)
    if "llm" in state:
        run("throughput_nano_vllm_protocol", bench)
        run("decode_step_times_ctx512", step_times)
        run("prefill_heavy_tensor_cores", prefill_heavy)
        # the same job with the mma.sync and the CUDA-core prefill attention (own engines: graphs keep their kernels)
        for mode, name in ((1, "mma_sync"), (0, "cuda_cores")) if not ARGS.quick else ():
            if "llm" in state:
                state.pop("llm").close()
            set_kernels(attn_mma=mode)
            try:
                run(f"startup_{name}_attention", startup)
                if "llm" in state:
                    run(f"prefill_heavy_{name}", prefill_heavy)
            finally:
                set_kernels()
        # the protocol with the CUDA-core decode attention (its own engine)
        if not ARGS.quick:
            if "llm" in state:
                state.pop("llm").close()
            set_kernels(decode_mma=False)
            try:
                run("startup_cuda_core_decode", startup)
                if "llm" in state:
                    run("throughput_nano_vllm_protocol_cuda_core_decode", bench)
            finally:
                set_kernels()


def section_latency():
    """Decode latency through `LLM.generate` (the engine loop's host work included, issue 24): Qwen3-0.6B, 512-token
    prompts, 256 greedy output tokens (ignore_eos), CUDA graphs on, batch 1 / 16 / 64, with and without
    `async_scheduling`; at batch 1 one more run with the worker's prepare / execute and the engine's postprocess
    stamped (medians, and the step thread's idle time between executes: where the GPU may wait for the host). ms per output token = (wall of 256 tokens - wall of 1 token) / 255: the prefill step and
    the first token are left out. `--quick` on CPU (FDLITE_E2E_DEVICE=cpu): the small qwen3, 32-token prompts,
    16 tokens, batch 1 and 4 (a dry run of the logic)."""
    from fdlite import LLM, SamplingParams  # noqa: PLC0415

    cpu = FDL_DEVICE != "gpu"
    prompt_len, out_len = (32, 16) if cpu else (512, 256)
    batches = (1, 4) if cpu else (1, 16, 64)
    path = small_model("qwen3") if cpu else qwen3_06b()
    rows = max(batches)
    bs = 16
    blocks = rows * (-(-(prompt_len + out_len) // bs) + 1) + 64

    def timeline(llm):
        """Wrap the worker's prepare / execute and the engine's postprocess with wall-clock stamps (which thread
        runs each is async scheduling's business); returns (stamps, undo)."""
        from fdlite.graph.cuda import CudaGraph  # noqa: PLC0415
        from fdlite.runner.cudagraph_runner import CudaGraphRunner  # noqa: PLC0415
        from fdlite.sample.sampler import Sampler  # noqa: PLC0415

        stamps = []
        eng, worker, runner = llm.engine, llm.engine.worker, llm.runner
        saved = [(worker, "prepare", worker.prepare), (worker, "execute", worker.execute),
                 (eng, "_postprocess", eng._postprocess),
                 # inside execute (the step thread): inputs written, graph launched, LM head, sampler
                 (CudaGraphRunner, "_write", CudaGraphRunner._write), (CudaGraph, "replay", CudaGraph.replay),
                 (runner.model, "compute_logits", runner.model.compute_logits), (Sampler, "__call__", Sampler.__call__)]

        def wrap(name, fn):
            def w(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    stamps.append((name, t, time.perf_counter()))
            return w
        for obj, name, fn in saved:
            setattr(obj, name, wrap(name, fn))

        def undo():
            for obj, name, fn in saved:
                setattr(obj, name, fn)
        return stamps, undo

    def summarize(stamps):
        """Medians (ms) of each phase, of the step period (execute start to execute start) and of the step thread's
        idle time between one execute's end and the next one's start."""
        by = {}
        for name, t0, t1 in stamps:
            by.setdefault(name, []).append((t0, t1))
        ex = sorted(by.get("execute", []))
        med = lambda xs: round(float(np.median(xs)) * 1e3, 3) if xs else None  # noqa: E731
        return {**{f"{n}_ms": med([b - a for a, b in v]) for n, v in by.items()},
                "period_ms": med([b[0] - a[0] for a, b in zip(ex, ex[1:])]),
                "step_thread_idle_ms": med([b[0] - a[1] for a, b in zip(ex, ex[1:])]), "steps": len(ex)}

    def case(async_scheduling: bool):
        def f():
            llm = LLM(path, skip_tokenizer_init=True, device=FDL_DEVICE, max_num_seqs=rows, block_size=bs,
                      max_model_len=prompt_len + out_len + bs, num_gpu_blocks_override=blocks, use_cudagraph=True,
                      enable_prefix_caching=False, async_scheduling=async_scheduling)
            rng = np.random.default_rng(0)
            vocab = llm.model_config.vocab_size
            res = {}
            try:
                warm_up(llm)
                for b in batches:
                    prompts = [{"prompt_token_ids": rng.integers(10, vocab - 10, prompt_len).tolist()} for _ in range(b)]
                    walls = {}
                    for n in (1, out_len, 1, out_len):  # the second pair is measured (the first warms this batch size)
                        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=n)
                        t = time.perf_counter()
                        outs = llm.generate(prompts, params, use_tqdm=False)
                        walls[n] = time.perf_counter() - t
                        assert all(len(o.outputs[0].token_ids) == n for o in outs)
                    if b == 1:  # once more, stamped: where a batch-1 step's wall time goes (not in the ms above)
                        stamps, undo = timeline(llm)
                        try:
                            llm.generate(prompts, SamplingParams(temperature=0, ignore_eos=True, max_tokens=out_len),
                                         use_tqdm=False)
                        finally:
                            undo()
                        timeline_b1 = summarize(stamps)
                    st = llm.last_generate_stats
                    ms = (walls[out_len] - walls[1]) / (out_len - 1) * 1e3
                    res[f"batch_{b}"] = {"ms_per_output_token": round(ms, 3), "wall_s": round(walls[out_len], 3),
                                         "prefill_wall_s": round(walls[1], 3), "steps": st.get("num_steps"),
                                         "cudagraph_replays": st.get("cudagraph_replays"),
                                         "early_prepared_steps": llm.engine.num_early_prepares}
                    if b == 1:
                        res["batch_1"]["timeline"] = timeline_b1
                    log("   ", "async" if async_scheduling else "sync", b, res[f"batch_{b}"])
            finally:
                llm.close()
            return res
        return f

    def host_profile():
        """Where a batch-1 step's host time goes: cProfile of an async engine, 256 tokens, the engine's thread and
        the step thread (inside `execute`) apart, the top functions by own time (cProfile's overhead inflates all
        of them alike)."""
        import cProfile  # noqa: PLC0415
        import io  # noqa: PLC0415
        import pstats  # noqa: PLC0415

        llm = LLM(path, skip_tokenizer_init=True, device=FDL_DEVICE, max_num_seqs=rows, block_size=bs,
                  max_model_len=prompt_len + out_len + bs, num_gpu_blocks_override=blocks, use_cudagraph=True,
                  enable_prefix_caching=False, async_scheduling=True)
        main, step = cProfile.Profile(), cProfile.Profile()  # one thread at a time (Python 3.12 allows one profiler)
        worker = llm.engine.worker
        execute = worker.execute

        def profiled(*a, **k):
            step.enable()
            try:
                return execute(*a, **k)
            finally:
                step.disable()
        try:
            prompt = [{"prompt_token_ids": list(range(10, 10 + prompt_len))}]
            params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=out_len)
            llm.generate(prompt, params, use_tqdm=False)
            worker.execute = profiled
            llm.generate(prompt, params, use_tqdm=False)
            worker.execute = execute
            main.enable()
            llm.generate(prompt, params, use_tqdm=False)
            main.disable()
        finally:
            worker.execute = execute
            llm.close()
        text = ""
        for name, prof in (("engine thread", main), ("step thread (execute)", step)):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
            text += f"==== {name}\n" + buf.getvalue()
        with open(os.path.join(ARGS.out, "latency_host_profile.txt"), "w") as f:
            f.write(text)
        return {"top": text.splitlines()[:90]}

    def host_micro():
        """Microseconds per call of the host operations a GPU step makes, on Paddle 2.6 and this machine's CPU."""
        import timeit  # noqa: PLC0415

        import paddle  # noqa: PLC0415

        from fdlite.kernels import gpu as gpu_ops  # noqa: PLC0415
        from fdlite.kernels.no_grad import no_grad  # noqa: PLC0415

        gpu_ops.load()
        t = paddle.empty([1, 151936], dtype="float32")
        gpu_ops.fill_(t, 0.5)
        h = np.zeros(64, np.int64)
        d = paddle.empty([64], dtype="int64")

        @paddle.no_grad()
        def decorated(x):
            return x

        @no_grad
        def ours(x):
            return x
        stmts = {"t.place.is_gpu_place()": lambda: t.place.is_gpu_place(), "t.is_contiguous()": t.is_contiguous,
                 "t.dtype": lambda: t.dtype, "t.shape": lambda: t.shape, "t.data_ptr()": t.data_ptr,
                 "paddle.empty([64]) on GPU": lambda: paddle.empty([64], dtype="int64"), "t[:1]": lambda: t[:1],
                 "@paddle.no_grad() call": lambda: decorated(1), "fdlite no_grad call": lambda: ours(1),
                 "gpu.argmax (checks on)": lambda: gpu_ops.argmax(t),
                 "_run fdl_argmax (no checks)": lambda: gpu_ops._run("fdl_argmax", t),
                 "current_stream_handle()": gpu_ops.current_stream_handle,
                 "copy_from_host 512 B": lambda: gpu_ops.copy_from_host(d, h)}
        out = {}
        for name, fn in stmts.items():
            fn()
            n = 2000
            out[name] = round(min(timeit.repeat(fn, number=n, repeat=3)) / n * 1e6, 2)
        paddle.device.cuda.synchronize()
        return {"us_per_call": out}

    run("decode_latency_sync", case(False))
    run("decode_latency_async", case(True))
    if os.environ.get("FDLITE_E2E_HOST_PROFILE"):
        run("decode_latency_host_micro", host_micro)
        run("decode_latency_host_profile", host_profile)
    a, s_ = RES["results"].get("decode_latency_async"), RES["results"].get("decode_latency_sync")
    if a and s_:
        RES["results"]["async_vs_sync_ms_per_token"] = {
            k: [s_[k]["ms_per_output_token"], a[k]["ms_per_output_token"]] for k in s_ if k.startswith("batch_")}
        log("  sync vs async ms/token:", RES["results"]["async_vs_sync_ms_per_token"])


@contextlib.contextmanager
def timed_steps(runner, sync=None):
    """Inside: every `runner.execute` call recorded as (tokens, decodes, seconds, kv_tokens: the rows' context
    lengths summed) in the yielded list; `sync` (a device synchronize), when given, brackets each call so its time
    covers the step's GPU work."""
    inner, steps = runner.execute, []

    def timed(step):
        if sync:
            sync()
        t = time.perf_counter()
        out = inner(step)
        if sync:
            sync()
        steps.append((step.flat.num_tokens, step.flat.num_decodes, time.perf_counter() - t,
                      int(np.asarray(step.flat.seq_lens_kv, np.int64).sum())))
        return out

    runner.execute = timed
    try:
        yield steps
    finally:
        runner.execute = inner


@contextlib.contextmanager
def evented_steps(runner):
    """Inside: every `runner.execute` call bracketed by two of our cudaEvents on Paddle's current stream, no sync; the
    yielded dict gets, once the block ends, the GPU's view of the job: `busy_ms` (first event to second, summed: the
    step's work, or the host's issuing of it when that is slower) and `gap_ms` (a step's second event to the next
    one's first: time the GPU sat idle waiting for the host to start the next step), by step kind."""
    from fdlite.kernels import gpu as gpu_ops  # noqa: PLC0415

    capi, inner, marks, res = gpu_ops.capi(), runner.execute, [], {}

    def evented(step):
        e0, e1 = capi.fdl_event_create(), capi.fdl_event_create()
        stream = gpu_ops.current_stream_handle()
        capi.fdl_event_record(e0, stream)
        out = inner(step)
        capi.fdl_event_record(e1, stream)
        marks.append((step.flat.num_tokens, step.flat.num_decodes, e0, e1))
        return out

    runner.execute = evented
    try:
        yield res
    finally:
        runner.execute = inner
        if marks:
            capi.fdl_event_synchronize(marks[-1][3])
            kinds: dict = {}
            for i, (tokens, decodes, e0, e1) in enumerate(marks):
                key = step_kind(tokens, decodes, (16, 128))
                k = kinds.setdefault(key, {"steps": 0, "busy_ms": 0.0, "gap_ms": 0.0, "gaps_over_50us": 0})
                k["steps"] += 1
                k["busy_ms"] += capi.fdl_event_elapsed_ms(e0, e1)
                if i + 1 < len(marks):
                    gap = capi.fdl_event_elapsed_ms(e1, marks[i + 1][2])
                    k["gap_ms"] += gap
                    k["gaps_over_50us"] += gap > 0.05
            for e in (e for m in marks for e in m[2:]):
                capi.fdl_event_destroy(e)
            res.update({"busy_ms": round(sum(k["busy_ms"] for k in kinds.values()), 1),
                        "gap_ms": round(sum(k["gap_ms"] for k in kinds.values()), 1),
                        "by_kind": {key: {kk: round(v, 1) if isinstance(v, float) else v for kk, v in k.items()}
                                    for key, k in sorted(kinds.items())}})


def step_kind(tokens: int, decodes: int, bounds=(4, 16, 64, 128, 192, 256, 10**9)) -> str:
    """A step's kind: "with prefill tokens", else "decode <= b" for the first bound b its rows fit, or "decode >
    bounds[-1]" past them all."""
    if tokens > decodes:
        return "with prefill tokens"
    return next((f"decode <= {b}" for b in bounds if decodes <= b), f"decode > {bounds[-1]}")


def steps_by_kind(steps, wall: float) -> dict:
    """(tokens, decodes, seconds, ...) per step -> per kind (steps with prefill tokens; decode-only steps by batch
    size): count, seconds, share of `wall`, ms a step, tokens and output tokens."""
    kinds: dict[str, list] = {}
    for tokens, decodes, sec, *_ in steps:
        k = kinds.setdefault(step_kind(tokens, decodes), [0, 0.0, 0, 0])
        k[0] += 1
        k[1] += sec
        k[2] += tokens
        k[3] += decodes
    return {key: {"steps": n, "seconds": round(sec, 3), "share_of_wall": round(sec / wall, 3),
                  "ms_per_step": round(sec / n * 1e3, 3), "tokens": tok, "output_tokens": dec}
            for key, (n, sec, tok, dec) in sorted(kinds.items())}


def decode_fit(steps, kv_bytes_per_token: int) -> dict:
    """Least squares over the decode-only steps of `timed_steps`: seconds = fixed + per_row * rows + per_kv * kv_tokens.
    `fixed` and `per_row` are what a step costs besides reading its KV (weights, small kernels, sampling, host);
    per_kv's bandwidth (kv_bytes_per_token / per_kv) is what the attention reads at; the parts' sums say how much of
    the job's decode time each term takes."""
    rows = [(d, kv, sec) for tokens, d, sec, kv in steps if tokens == d and d > 0]
    if len(rows) < 3:
        return {}
    a = np.array([[1.0, d, kv] for d, kv, _ in rows])
    y = np.array([sec for *_, sec in rows])
    (fixed, per_row, per_kv), *_ = np.linalg.lstsq(a, y, rcond=None)
    fit = a @ np.array([fixed, per_row, per_kv])
    return {"steps": len(rows), "seconds": round(float(y.sum()), 3), "fixed_ms": round(fixed * 1e3, 4),
            "per_row_us": round(per_row * 1e6, 3), "per_kv_token_ns": round(per_kv * 1e9, 4),
            "kv_GB_s": round(kv_bytes_per_token / per_kv / 1e9, 1) if per_kv > 0 else None,
            "fixed_s": round(fixed * len(rows), 3), "rows_s": round(per_row * float(a[:, 1].sum()), 3),
            "kv_s": round(per_kv * float(a[:, 2].sum()), 3),
            "residual_rms_ms": round(float(np.sqrt(np.mean((fit - y) ** 2))) * 1e3, 4)}


def section_breakdown():
    """The throughput protocol's wall time split by step kind: each `ModelRunner.execute` call (forward, LM
    head, sampling, ids back on the host) timed with the batch it ran, the rest being the engine's host work
    around it (scheduling, output processing)."""

    state = {}

    def startup():
        state["llm"] = dense_llm(async_scheduling=os.environ.get("FDLITE_E2E_ASYNC") == "1")
        return {"async_scheduling": state["llm"].config.async_scheduling}

    def case():
        llm = state["llm"]
        prompts, outs = protocol()
        warm_up(llm)
        with timed_steps(llm.runner) as steps:
            t = time.time()
            llm.generate([{"prompt_token_ids": p} for p in prompts],
                         protocol_params(outs), use_tqdm=False)
            wall = time.time() - t
        in_steps = sum(x[2] for x in steps)
        return {"wall_s": round(wall, 2), "steps": len(steps), "in_execute_s": round(in_steps, 2),
                "outside_execute_s": round(wall - in_steps, 2), "by_kind": steps_by_kind(steps, wall)}

    run("startup", startup)
    if "llm" in state:
        run("protocol_by_step_kind", case)


def section_profile():
    """Kernel times of one step of the churn job, a mixed one or (FDLITE_PROFILE_KIND=decode) one of 128+ decodes
    only, or (FDLITE_PROFILE_KIND=prefill) one 8k-token prefill step of the prefill-heavy job on a full-size shape
    (FDLITE_PROFILE_MODEL, a MOE_BENCH_SHAPES name, random weights), run under Nsight Compute by
    tools/gpu/run_profile_step.sh (`--profile-from-start off`: only the step
    between cuProfilerStart and cuProfilerStop is profiled). Eager and synchronous, so each `ModelRunner.execute` is one step's kernels in
    launch order; the same kernels a graph replays (the attention plans its kernels and KV splits for the graph the
    step would replay in), on unpadded batches."""
    import ctypes  # noqa: PLC0415

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from churn_job import churn_requests  # noqa: PLC0415

    from fdlite import LLM  # noqa: PLC0415

    cuda = ctypes.CDLL("libcuda.so.1")
    kind = os.environ.get("FDLITE_PROFILE_KIND", "mixed")
    if kind == "prefill":
        llm = full_size_llm(shape_name(os.environ.get("FDLITE_PROFILE_MODEL", "ernie45_21b_a3b")), use_cudagraph=False,
                            async_scheduling=False)
        prompts = prefill_heavy_prompts(32)
        outs = [8] * len(prompts)
    else:
        llm = LLM(qwen3_06b(), skip_tokenizer_init=True, device=FDL_DEVICE, max_num_seqs=256, max_model_len=2048,
                  max_num_batched_tokens=8192, num_gpu_blocks_override=4000, use_cudagraph=False,
                  async_scheduling=False)
        prompts, outs = churn_requests(768)
    runner, inner = llm.runner, llm.runner.execute
    want = {"mixed": lambda f: f.num_tokens > f.num_decodes and f.num_decodes >= 192,
            "decode": lambda f: f.num_tokens == f.num_decodes and f.num_decodes >= 128,
            "prefill": lambda f: f.num_tokens >= 8000 and f.num_decodes <= 16}
    after = 2 if kind == "prefill" else 150  # steps before the profiled one (warm caches, the job under way)
    want = {k: v for k, v in want.items() if k == kind}
    seen = {"calls": 0}
    done = {}

    def timed(step):
        f = step.flat
        seen["calls"] += 1
        kind = next((k for k, ok in want.items() if k not in done and seen["calls"] > after and ok(f)), None)
        if kind is None:
            return inner(step)
        cuda.cuCtxSynchronize()
        cuda.cuProfilerStart()
        t = time.perf_counter()
        out = inner(step)
        cuda.cuCtxSynchronize()
        done[kind] = {"order": len(done), "tokens": f.num_tokens, "decodes": f.num_decodes,
                      "rows": f.num_rows,
                      "wall_ms_under_profiler": round((time.perf_counter() - t) * 1e3, 2)}
        cuda.cuProfilerStop()
        return out

    def case():
        runner.execute = timed
        try:
            llm.generate([{"prompt_token_ids": p} for p in prompts],
                         protocol_params(outs),
                         use_tqdm=False)
        finally:
            runner.execute = inner
        return {"steps": done, "calls": seen["calls"]}

    run("profiled_steps", case)


def section_fp8():
    """kv_cache_dtype="fp8" on the GPU (issue 25): quality beside a bf16 KV cache, transformers' own bf16 and
    transformers fp32 with K / V rounded as the FP8 cache stores them (prefill logprob error against fp32, greedy
    agreement; `pass_fp8_bar`: within 2x their two errors' sum + 1e-3), graphs = eager with either cache (bf16 models: the
    tensor-core decode attention, which the fp32 graph checks never reach), the nano-vllm protocol's output
    tokens/s and issue 25's prefill-heavy job's tokens/s with either cache (FP8 also on the mma.sync tile kernel),
    one LLM alive at a time."""
    from fdlite import LLM, SamplingParams  # noqa: PLC0415

    def case(name, fn):
        if wanted_case(name):
            run(name, fn)

    for fam in ("qwen3", "llama"):
        def quality(f=fam):
            auto, fp8 = bf16_case(f), bf16_case(f, "fp8")
            a, b = auto.pop("greedy_tokens"), fp8.pop("greedy_tokens")
            n = sum(len(x) for x in a)
            return {"fp8": fp8, "bf16_kv_prefill_logprob_err": auto["prefill_logprob_max_abs_err_vs_fp32"],
                    "pass_fp8_bar": fp8["pass_fp8_bar"],
                    "fp8_vs_bf16_kv_greedy": {"identical_sequences": sum(x == y for x, y in zip(a, b)),
                                              "tokens_equal_positionwise": sum(p == q for x, y in zip(a, b)
                                                                               for p, q in zip(x, y)) / n},
                    "pass": fp8["pass"]}
        case(f"quality_{fam}", quality)

    def graphs(kv):
        path = small_model("qwen3")
        rng = np.random.default_rng(3)
        prompts = [rng.integers(3, 1024, size=int(k)).tolist() for k in rng.integers(20, 300, size=40)]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        want, got, st, llm = eager_then_graphs(path, prompts, params, device=FDL_DEVICE, dtype="bfloat16",
                                               skip_tokenizer_init=True, max_num_seqs=8, block_size=16,
                                               max_model_len=1024, max_num_batched_tokens=64,
                                               num_gpu_blocks_override=120, kv_cache_dtype=kv)
        return {"identical": got == want, "sequences_differing": sum(a != b for a, b in zip(got, want)),
                "steps": st["num_steps"], "cudagraph_replays": st["cudagraph_replays"],
                "mixed_replays": st["cudagraph_mixed_replays"], "preemptions": st["num_preemptions"],
                "pass": got == want and st["cudagraph_replays"] >= 0.9 * st["num_steps"]}
    for kv in ("auto", "fp8"):
        case(f"graphs_equal_eager_kv_{kv}", lambda kv=kv: graphs(kv))

    for kv in ("auto", "fp8"):
        def bench(kv=kv):
            llm = LLM(qwen3_06b(), skip_tokenizer_init=True, device=FDL_DEVICE, max_num_seqs=256, max_model_len=2048,
                      max_num_batched_tokens=8192, kv_cache_dtype=kv)
            try:
                return {"kv_blocks": llm.num_blocks, **run_protocol(llm)}
            finally:
                llm.close()
        case(f"protocol_kv_{kv}", bench)

    def prefill_heavy(kv, attn_mma=True):
        """Issue 25's prefill-heavy job (1,024 prompts of 1,024-2,040 tokens, 8 output tokens) with either cache; FP8
        also on the mma.sync tile kernel (attn_mma=1, its own engine: graphs keep their kernels)."""
        set_kernels(attn_mma=attn_mma)
        try:
            llm = LLM(qwen3_06b(), skip_tokenizer_init=True, device=FDL_DEVICE, max_num_seqs=256, max_model_len=2048,
                      max_num_batched_tokens=8192, kv_cache_dtype=kv)
            try:
                warm_up(llm)
                return prefill_heavy_job(llm, prefill_heavy_prompts(1024 if not ARGS.quick else 16))
            finally:
                llm.close()
        finally:
            set_kernels()
    for kv, mode, tag in (("auto", True, ""), ("fp8", True, ""), ("fp8", 1, "_mma_sync")):
        case(f"prefill_heavy_kv_{kv}{tag}", lambda kv=kv, mode=mode: prefill_heavy(kv, mode))


# ---- sampling features at full speed (device-side logits processors) ---------------------------

def json_schema() -> dict:
    """The nested schema of benchmarks/structured_outputs.py (objects, arrays, enums, numbers, required)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from structured_outputs import SCHEMA  # noqa: PLC0415

    return SCHEMA


# ---- the churn job: more requests than rows (token-count graphs for the steps that mix) -----------------
def section_churn():
    """benchmarks/churn_job.py's job on Qwen3-0.6B shapes (bf16), in one process: today's defaults (token-count
    graphs, tensor-core prefill attention, async scheduling) beside the engine issue 24 was filed against (decode
    graphs only, prefill attention on CUDA cores, synchronous steps), each LLM with the same 4,000 KV blocks of
    64 tokens (256,000 tokens: the job's 256 rows of up to 1,280 tokens fit without preemption), and today's
    synchronous beside them (what async scheduling adds). Token-count graphs every 256 tokens instead of the
    default list were tried on 11-26: 1.5% more, for 22 more graphs."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from churn_job import churn_requests, run_job  # noqa: PLC0415

    from fdlite import LLM  # noqa: PLC0415

    n = 256 if ARGS.quick else 2048
    prompts, outs = churn_requests(n)
    common = dict(skip_tokenizer_init=True, device=FDL_DEVICE, max_num_seqs=256, max_model_len=2048,
                  max_num_batched_tokens=8192, num_gpu_blocks_override=4000)
    # The kernel switches (FDLITE_ATTN_MMA, FDLITE_DECODE_MMA) are set for each engine's capture and its runs; the
    # engine issue 24 was filed against had CUDA-core prefill and decode attention.
    before = {"graph_optimization_config": {"cudagraph_mixed_capture_sizes": []}, "async_scheduling": False}
    variants = [("before: decode graphs only, CUDA-core prefill and decode attention, sync", before, False),
                ("today's defaults (token-count graphs, tensor-core attention, async)", {}, True),
                ("today's, sync", {"async_scheduling": False}, True)]
    variants.append(("before (again)", before, False))
    llms = {}

    def startup(name, extra, use_mma):
        def f():
            t = time.time()
            set_kernels(attn_mma=use_mma, decode_mma=use_mma)
            llms[name] = LLM(qwen3_06b(), **common, **extra)
            return {"startup_s": round(time.time() - t, 1), "kv_blocks": llms[name].num_blocks,
                    "mixed_sizes": llms[name].startup_report["cudagraph_mixed_sizes"]}
        return f

    def job(name, use_mma):
        def f():
            set_kernels(attn_mma=use_mma, decode_mma=use_mma)
            run_job(llms[name], prompts[:16], outs[:16])  # warm-up
            return run_job(llms[name], prompts, outs)
        return f

    # One engine alive at a time (each holds 4,000 blocks = 28 GiB of KV cache); "before" runs first and last.
    for name, extra, use_mma in variants:
        run(f"startup: {name}", startup(name, extra, use_mma))
        if name in llms:
            try:
                run(name, job(name, use_mma))
            finally:
                llms.pop(name).close()
                set_kernels()
    b0, now, b1 = variants[0][0], variants[1][0], variants[-1][0]
    r = RES["results"]
    if now in r and b0 in r:
        base = max(r[b0]["output_tokens_per_s"], r.get(b1, {}).get("output_tokens_per_s", 0))
        r["speedup_vs_best_before"] = {"value": round(r[now]["output_tokens_per_s"] / base, 3),
                                       "replayed_share": r[now]["replayed_share"],
                                       "pass": r[now]["replayed_share"] >= 0.9
                                       and r[now]["output_tokens_per_s"] >= 1.5 * base}


def section_sampling():
    """Each sampling feature's output tokens/s beside plain temperature sampling, in one process (one `LLM`, with
    the shipped Qwen3 tokenizer for the cases that need text): 128 of the protocol's prompts (token ids), 128
    output tokens each (`ignore_eos` unless a case needs EOS), graphs on; then a JSON-schema batch of 64 beside
    its unconstrained twin."""
    from fdlite import SamplingParams  # noqa: PLC0415

    state = {}

    def startup():
        state["llm"] = dense_llm(with_qwen3_tokenizer(qwen3_06b()), skip_tokenizer_init=False)
        return {"kv_blocks": state["llm"].num_blocks}

    prompts, _ = protocol(n=128)
    base = dict(max_tokens=128, ignore_eos=True)
    bad_words = ["the", "and", "of", "to", "in", "is", "that", "it", "for", "with"]
    cases = {  # name: (params over `base`, number of prompts)
        "temperature=0.6": (dict(temperature=0.6), 128),
        "temperature=0.7, top_p=0.8, top_k=20": (dict(temperature=0.7, top_p=0.8, top_k=20), 128),
        "+ repetition_penalty=1.05": (dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05), 128),
        "presence_penalty=1.5": (dict(temperature=0.7, presence_penalty=1.5), 128),
        "frequency_penalty=0.5": (dict(temperature=0.6, frequency_penalty=0.5), 128),
        "min_tokens=64 (EOS banned until then)": (dict(temperature=0.6, min_tokens=64, ignore_eos=False), 128),
        "logprobs=5": (dict(temperature=0.6, logprobs=5), 128),
        "logprobs=20": (dict(temperature=0.6, logprobs=20), 128),
        "logit_bias (10 tokens)": (dict(temperature=0.6, logit_bias={t: 2.0 for t in range(1000, 1010)}), 128),
        "allowed_token_ids (1,000 tokens)": (dict(temperature=0.6, allowed_token_ids=list(range(5000, 6000))), 128),
        "bad_words (10 words)": (dict(temperature=0.6, bad_words=bad_words), 128),
        # the twin first: the same batch, the same lengths cap, no grammar (and no EOS, as a random model's
        # unconstrained text rarely stops); structured outputs refuse ignore_eos
        "json twin (unconstrained), batch 64": (dict(temperature=0.6), 64),
        "json schema, batch 64": (dict(temperature=0.6, ignore_eos=False,
                                       structured_outputs={"json": json_schema()}), 64),
    }

    def bench(kw, n):
        def f():
            llm = state["llm"]
            params = SamplingParams(**{**base, **kw})
            warm = {**base, **kw, "max_tokens": 4, "min_tokens": 0}
            llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], SamplingParams(**warm), use_tqdm=False)
            t = time.time()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:n]], params, use_tqdm=False)
            s = time.time() - t
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            res = {"requests": n, "output_tokens": tokens, "generate_s": round(s, 2),
                   "output_tokens_per_s": round(tokens / s, 1)}
            if "allowed_token_ids" in kw:  # the mask really held
                res["all_tokens_allowed"] = all(set(o.outputs[0].token_ids) <= set(kw["allowed_token_ids"]) for o in outs)
            if "structured_outputs" in kw:  # what the grammar let through: each finished output parses
                stopped = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
                parsed = sum(_parses(c.text) for c in stopped)
                res.update(finished_stop=len(stopped), parse_json=sum(_parses(o.outputs[0].text) for o in outs),
                           stopped_and_parse=parsed,
                           all_start_with_brace=all(o.outputs[0].text.lstrip().startswith("{") for o in outs))
                res["pass"] = parsed == len(stopped) and res["all_start_with_brace"]
            return res
        return f

    run("startup", startup)
    if "llm" not in state:
        return
    run("warm-up run (plain, not counted)", bench(*cases["temperature=0.6"]))
    for name, (kw, n) in cases.items():
        if wanted_case(name):
            run(name, bench(kw, n))
    if not ARGS.cases or "forced" in ARGS.cases.split(","):  # logit_bias +100 on one token decides every draw
        def forced():
            outs = state["llm"].generate([{"prompt_token_ids": p} for p in prompts[:8]], SamplingParams(
                temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, logit_bias={4242: 100.0}), use_tqdm=False)
            return {"pass": all(o.outputs[0].token_ids == [4242] * 16 for o in outs)}
        run("forced by logit_bias +100", forced)
    results = RES["results"]
    plain = results.get("temperature=0.6", {}).get("output_tokens_per_s")
    if plain:
        results["share_of_plain"] = {k: round(v["output_tokens_per_s"] / plain, 3)
                                     for k, v in results.items() if "output_tokens_per_s" in v}
    twin = results.get("json twin (unconstrained), batch 64", {}).get("output_tokens_per_s")
    constrained = results.get("json schema, batch 64", {}).get("output_tokens_per_s")
    if twin and constrained:
        results["json_share_of_twin"] = {"json_tokens_per_s": constrained, "twin_tokens_per_s": twin,
                                         "share": round(constrained / twin, 3)}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


# ---- sampling features: correctness against independent references -------------------------------

def logprob_problems(d: dict, ref, token: int, k: int, where: str, tol: float = 1e-4) -> tuple[list, float]:
    """What is wrong with one position's logprobs `d` (token id -> Logprob: `token` plus the top `k`) against the
    reference log-softmax row `ref` (numpy, float64); and the largest value error."""
    probs = []
    err = max((abs(lp.logprob - float(ref[t])) for t, lp in d.items()), default=0.0)
    if err > tol:
        probs.append(f"{where}: logprob off by {err:.2e}")
    if token not in d:
        probs.append(f"{where}: token {token} missing")
    else:  # its rank: 1 + the reference logprobs strictly above it, give or take ties within tol
        v = float(ref[token])
        lo, hi = 1 + int((ref > v + tol).sum()), int((ref >= v - tol).sum())
        if not lo <= d[token].rank <= hi:
            probs.append(f"{where}: token {token} rank {d[token].rank}, reference {lo}..{hi}")
    if k:
        ours = {t for t, lp in d.items() if lp.rank is not None and lp.rank <= k}
        order = np.argsort(-ref, kind="stable")
        kth = float(ref[order[k - 1]])
        odd = [t for t in ours ^ set(order[:k].tolist()) if abs(float(ref[t]) - kth) >= tol]  # not near-ties
        if odd or len(ours) < k:
            probs.append(f"{where}: top-{k} has {len(ours)} ids, {len(odd)} beyond near-ties of the reference's")
    return probs, err


def section_sampling_checks():
    """Sampling features on the device against references that share no code with fdlite: greedy fp32 under
    each logits processor vs transformers' processors (or a few lines of torch), token-identical; seeded
    sampling with penalties, eager vs CUDA graphs; logprobs and prompt logprobs vs transformers' log_softmax."""
    import torch  # noqa: PLC0415
    import transformers as tf  # noqa: PLC0415

    from fdlite import LLM, SamplingParams  # noqa: PLC0415

    # -- a. greedy under each processor, one LLM on the small qwen3 with a real EOS id --------------------
    state = {}
    path = small_model("qwen3")
    prompts = mixed_prompts(16, seed=21, vocab=1024, max_len=300)
    n_new, min_tokens = 24, 8
    bias = {t: 5.0 for t in (7, 100, 333, 512, 1000)}
    allowed = np.random.default_rng(3).choice(np.arange(3, 1024), 200, replace=False).tolist()

    def setup():
        plain, _ = hf_greedy(path, prompts, n_new, "float32")
        # EOS: the token plain greedy takes most often before min_tokens, so that the ban matters
        from collections import Counter  # noqa: PLC0415

        eos, hits = Counter(t for p in plain for t in p[:min_tokens]).most_common(1)[0]
        state.update(plain=plain, eos=eos)
        state["llm"] = LLM(with_eos(path, eos), device=FDL_DEVICE, dtype="float32", skip_tokenizer_init=True,
                           max_num_seqs=16, block_size=16, max_model_len=512, num_gpu_blocks_override=400)
        return {"eos_token_id": eos, "prompts_with_eos_before_min_tokens": sum(eos in p[:min_tokens] for p in plain),
                "times_before_min_tokens": hits}

    def greedy_case(kw, processors, uses_eos=False):
        def f():
            params = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=not uses_eos, **kw)
            outs = state["llm"].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            got = [o.outputs[0].token_ids for o in outs]
            ref, gaps = hf_greedy_processed(path, prompts, n_new, processors, state["eos"] if uses_eos else None)
            res = compare(got, ref, gaps)
            if uses_eos:  # min_tokens: the effect is EOS held back, then taken
                eos = state["eos"]
                unheld, _ = hf_greedy_processed(path, prompts, n_new, lambda n: processors(n)[:-1], eos)
                res.update(prompts_held_by_min_tokens=sum(t[-1] == eos and len(t) <= min_tokens for t in unheld),
                           lengths=[len(g) for g in got],
                           finished_stop=sum(o.outputs[0].finish_reason == "stop" for o in outs))
                res["pass"] = (res["pass"] and res["prompts_held_by_min_tokens"] > 0
                               and all(len(g) == n_new or (g[-1] == eos and len(g) > min_tokens) for g in got))
            else:  # the feature changed something, else the case proves nothing
                res["prompts_changed_vs_plain_greedy"] = sum(g != p for g, p in zip(got, state["plain"]))
                res["pass"] = res["pass"] and res["prompts_changed_vs_plain_greedy"] > 0
            if "allowed_token_ids" in kw:
                res["pass"] = res["pass"] and all(set(g) <= set(allowed) for g in got)
            return res
        return f

    run("startup (penalties, small qwen3 fp32)", setup)
    if "llm" in state:
        eos = state["eos"]
        # bad_words need a tokenizer (fdlite tokenizes the words), which the small models have none of: the
        # ban mechanism is covered by min_tokens' EOS ban here and by allowed_token_ids (every other token
        # masked) vs a torch mask; bad_words' throughput runs in section_sampling, with the Qwen3 tokenizer.
        greedy_cases = {
            "repetition": (dict(repetition_penalty=1.3), lambda n: [tf.RepetitionPenaltyLogitsProcessor(1.3)], False),
            "presence_frequency": (dict(presence_penalty=1.5, frequency_penalty=0.5),
                                   lambda n: [presence_frequency(n, 1.5, 0.5)], False),
            # EOS made likely by a +3 logit_bias (half the prompts would take it before min_tokens), the ban last
            "min_tokens": (dict(min_tokens=min_tokens, logit_bias={eos: 3.0}),
                           lambda n: [tf.SequenceBiasLogitsProcessor([[[eos], 3.0]]),
                                      tf.MinNewTokensLengthLogitsProcessor(n, min_tokens, eos, device=HF_DEVICE)], True),
            "logit_bias": (dict(logit_bias=bias),
                           lambda n: [tf.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])], False),
            "allowed_token_ids": (dict(allowed_token_ids=allowed), lambda n: [only_allowed(allowed)], False),
            # vLLM's order: repetition, then frequency and presence, then logit_bias
            "combined": (dict(repetition_penalty=1.3, presence_penalty=1.5, frequency_penalty=0.5, logit_bias=bias),
                         lambda n: [tf.RepetitionPenaltyLogitsProcessor(1.3), presence_frequency(n, 1.5, 0.5),
                                    tf.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])], False),
        }
        for name, (kw, procs, uses_eos) in greedy_cases.items():
            run(f"penalties_vs_transformers_{name}", greedy_case(kw, procs, uses_eos))
    state.clear()
    _HF_MODELS.clear()

    # -- b. seeded sampling with penalties: eager and CUDA graphs draw the same tokens ---------------------
    def seeded():
        rng = np.random.default_rng(12)
        ps = [rng.integers(3, 1024, size=int(k)).tolist() for k in (5, 40, 100, 17, 64, 250, 1, 33)]
        params = [SamplingParams(temperature=0.8, seed=100 + i, repetition_penalty=1.2, presence_penalty=0.5,
                                 frequency_penalty=0.3, max_tokens=200, ignore_eos=True) for i in range(len(ps))]
        common = dict(device=FDL_DEVICE, dtype="float32", skip_tokenizer_init=True, max_num_seqs=8, block_size=16,
                      max_model_len=1024, num_gpu_blocks_override=300)
        want, got, st, llm = eager_then_graphs(path, ps, params, **common)
        del llm
        steps, replays = st.get("num_steps") or 0, st.get("cudagraph_replays") or 0
        res = {"identical": got == want, "tokens": sum(map(len, got)), "steps": steps, "cudagraph_replays": replays,
               "distinct_sequences": len({tuple(g) for g in got}),
               "identical_rows": sum(g == w for g, w in zip(got, want))}
        # graphs on the GPU only (the CPU dry run ignores use_cudagraph; the identity must hold all the same)
        res["pass"] = bool(res["identical"] and res["distinct_sequences"] == len(ps)
                           and (FDL_DEVICE != "gpu" or replays >= 0.9 * steps))
        return res

    run("seeded_penalties_eager_vs_graphs", seeded)

    # -- c. logprobs and prompt logprobs vs transformers' log_softmax ---------------------------------
    def logprobs_case(family):
        def f():
            fpath = small_model(family)
            rng = np.random.default_rng({"qwen2": 41, "qwen3": 42, "llama": 43}[family])
            ps = [rng.integers(3, 1024, size=k).tolist() for k in (1, 2, 15, 16, 17, 33, 64, 65, 100, 129, 200, 300)]
            shared = rng.integers(3, 1024, size=40).tolist()  # prefix-cache hits (two full blocks of 16)
            ps += [shared + rng.integers(3, 1024, size=k).tolist() for k in (1, 10, 30, 90)]
            # a 64-token step budget: the long prompts are prefilled in chunks; prefix caching on (default)
            llm = LLM(fpath, device=FDL_DEVICE, dtype="float32", skip_tokenizer_init=True, max_num_seqs=8,
                      block_size=16, max_model_len=512, max_num_batched_tokens=64, num_gpu_blocks_override=200)
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=20, prompt_logprobs=5)
            outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
            st = llm.last_generate_stats
            del llm
            model = hf_model(fpath)
            problems, max_err, greedy_off = [], 0.0, 0
            for i, (p, o) in enumerate(zip(ps, outs)):
                c = o.outputs[0]
                with torch.no_grad():
                    logits = model(torch.tensor([p + c.token_ids], device=HF_DEVICE)).logits[0].double()
                ref = torch.log_softmax(logits, -1).cpu().numpy()
                if len(c.logprobs or []) != len(c.token_ids):
                    problems.append(f"prompt {i}: {len(c.logprobs or [])} logprob entries for {len(c.token_ids)} tokens")
                for k, (tok, d) in enumerate(zip(c.token_ids, c.logprobs or [])):
                    row = ref[len(p) - 1 + k]
                    greedy_off += int(tok != int(row.argmax()) and row.max() - row[tok] >= 1e-4)
                    pr, err = logprob_problems(d, row, tok, 20, f"prompt {i} output {k}")
                    problems += pr
                    max_err = max(max_err, err)
                pl = o.prompt_logprobs
                if pl is None or len(pl) != len(p) or pl[0] is not None:
                    problems.append(f"prompt {i}: prompt_logprobs {None if pl is None else len(pl)} entries for "
                                    f"{len(p)} tokens (the first must be None)")
                    continue
                for j in range(1, len(p)):
                    if len(pl[j]) not in (5, 6):
                        problems.append(f"prompt {i} prompt token {j}: {len(pl[j])} entries")
                    pr, err = logprob_problems(pl[j], ref[j - 1], p[j], 5, f"prompt {i} prompt token {j}")
                    problems += pr
                    max_err = max(max_err, err)
            return {"prompts": len(ps), "max_abs_err": max_err, "greedy_not_argmax_beyond_ties": greedy_off,
                    "num_problems": len(problems), "problems": problems[:10], "steps": st.get("num_steps"),
                    "prefix_cache_hit_tokens": st.get("prefix_cache_hit_tokens"),
                    "pass": not problems and not greedy_off}
        return f

    for fam in ("qwen2", "qwen3", "llama"):
        run(f"logprobs_vs_transformers_{fam}", logprobs_case(fam))


# ---- mixture of experts (issue 26): parity, graphs, bf16 ---------------------------------------------

def section_moe():
    """ERNIE-4.5-MoE and Qwen3-MoE (small random models, FAMILY_OVERRIDES): fp32 greedy token-identical to
    transformers fp32 with chunked prefill, preemption and prefix hits (`parity_case`); CUDA graphs = eager over
    1,000 decode steps (issue 26) and over a churning job whose steps replay token-count graphs (the MoE kernels'
    grids fixed per size, the routing different at each replay); bf16 prefill logprobs within twice transformers'
    own bf16 error (`bf16_case`)."""
    from fdlite import SamplingParams  # noqa: PLC0415

    fams = ("ernie45_moe", "qwen3_moe")
    for fam in fams:
        run(f"fp32_greedy_{fam}", lambda f=fam: parity_case(f))

    def decode_case(family):
        def f():
            path = small_model(family)
            rng = np.random.default_rng(21)
            prompts = [rng.integers(3, 1024, size=int(k)).tolist() for k in (5, 40, 100, 17, 64, 250)]
            steps = [1000, 900, 700, 500, 300, 100]  # the batch shrinks: 6, 5, 4, 3, 2, 1 rows -> padded 8, 4, 2, 1
            params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in steps]
            common = dict(device=FDL_DEVICE, dtype="float32", skip_tokenizer_init=True, max_num_seqs=8, block_size=16,
                          max_model_len=1400, num_gpu_blocks_override=600)
            want, got, st, llm = eager_then_graphs(path, prompts, params, **common)
            res = {"identical": got == want, "steps": st.get("num_steps"), "cudagraph_replays": st.get("cudagraph_replays"),
                   "padded_replays": st.get("cudagraph_padded_replays"), "startup": llm.startup_report}
            res["pass"] = bool(res["identical"] and (res["cudagraph_replays"] or 0) >= 990
                               and (res["padded_replays"] or 0) > 0)
            return res
        return f

    def mixed_case(family):
        def f():
            want, got, st, llm = churning_job(family, seed=22, requests=40, prompt_lens=(100, 600), blocks=300)
            res = {"identical": got == want, "steps": st["num_steps"], "cudagraph_replays": st["cudagraph_replays"],
                   "mixed_replays": st["cudagraph_mixed_replays"]}
            res["pass"] = bool(res["identical"] and st["cudagraph_mixed_replays"] >= 0.5 * st["num_steps"])
            return res
        return f

    for fam in fams:
        run(f"graphs_decode_{fam}", decode_case(fam))
        run(f"graphs_mixed_{fam}", mixed_case(fam))
    if FDL_DEVICE == "gpu" and not ARGS.skip_bf16:
        for fam in fams:
            run(f"bf16_{fam}", lambda f=fam: bf16_case(f))


# ---- MoE at full size: throughput and its roofline (issue 26's measurement) -----------------------

# The real models' config.json (the keys fdlite reads: fdlite/models/model_config.py, MoESpec in fdlite/models/moe.py),
# written alone into a folder: the engine runs them with load_format="dummy", so no weight is on disk.
MOE_BENCH_SHAPES = {
    # ERNIE-4.5-21B-A3B(-PT): layer 0 dense (12288 wide), layers 1-27 MoE: 6 of 64 experts of 1536, 2 shared,
    # a float32 router with the score-correction bias (moe_use_aux_free), tied embeddings
    "ernie45_21b_a3b": dict(
        architectures=["Ernie4_5_MoeForCausalLM"], model_type="ernie4_5_moe", hidden_size=2560,
        intermediate_size=12288, num_hidden_layers=28, num_attention_heads=20, num_key_value_heads=4, head_dim=128,
        vocab_size=103424, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, use_bias=False,
        tie_word_embeddings=True, moe_num_experts=64, moe_k=6, moe_intermediate_size=1536, moe_num_shared_experts=2,
        moe_layer_start_index=1, moe_layer_end_index=27, moe_layer_interval=1, moe_use_aux_free=True,
        moe_norm_min=1e-12, hidden_act="silu", torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2),
    # Qwen3-30B-A3B: every layer MoE, 8 of 128 experts of 768, renormalised, no shared experts, untied head
    "qwen3_30b_a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu", torch_dtype="bfloat16",
        initializer_range=0.02, bos_token_id=151643, eos_token_id=151645),
    # the dense comparison of about the same active parameters: Qwen3-4B (4.0B, vs 3.0B and 3.3B active above)
    "qwen3_4b_dense": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2560, intermediate_size=9728,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        hidden_act="silu", torch_dtype="bfloat16", initializer_range=0.02, bos_token_id=151643,
        eos_token_id=151645),
    # Llama-3.1-8B: issue 25's 8B rows (the protocol, and this section's prefill-heavy job: 256 prompts of 1-2k tokens)
    "llama31_8b_dense": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        hidden_act="silu", torch_dtype="bfloat16", initializer_range=0.02, bos_token_id=128000,
        eos_token_id=128001),
}
# --quick (CPU): the same families and switches at toy sizes
MOE_BENCH_QUICK = {
    "ernie45_21b_a3b": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=16384, moe_num_experts=8, moe_k=3,
                            moe_intermediate_size=32, moe_layer_end_index=2),
    "qwen3_30b_a3b": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=16384, num_experts=16,
                          num_experts_per_tok=4, moe_intermediate_size=32),
    "qwen3_4b_dense": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=16384),
    "llama31_8b_dense": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=16384),
}


def shape_name(value: str, also: tuple = ()) -> str:
    """FDLITE_PROFILE_MODEL's shape: a MOE_BENCH_SHAPES name (or one of `also`), or the one such name that holds
    `value` (moe_bench's --cases words: llama31_8b for llama31_8b_dense); otherwise an error naming the choices."""
    names = (*MOE_BENCH_SHAPES, *also)
    if value in names:
        return value
    hits = [n for n in names if value in n]
    if len(hits) == 1:
        return hits[0]
    raise ValueError(f"FDLITE_PROFILE_MODEL={value!r} names {'more than one' if hits else 'no'} shape: one of "
                     f"{', '.join(names)}")


def config_only_model(name: str) -> str:
    """A folder holding only `name`'s config.json (MOE_BENCH_SHAPES; toy sizes under --quick)."""
    cfg = {**MOE_BENCH_SHAPES[name], **(MOE_BENCH_QUICK[name] if ARGS.quick else {})}
    path = os.path.join(ARGS.models, f"{name}{'-quick' if ARGS.quick else ''}-config-only")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def full_size_llm(name: str, **options):
    """An engine on `name`'s shape (MOE_BENCH_SHAPES) with random weights, as section_moe_bench measures it (bf16 on
    the GPU, 256 rows, 2,048-token context, 8,192-token steps); `options` on top (the profile section's eager runs)."""
    from fdlite import LLM  # noqa: PLC0415

    return LLM(config_only_model(name), **{
        "load_format": "dummy", "skip_tokenizer_init": True, "device": FDL_DEVICE,
        "dtype": "bfloat16" if FDL_DEVICE == "gpu" else "float32", "max_num_seqs": 256, "max_model_len": 2048,
        "max_num_batched_tokens": 8192, **options})


def section_step_times():
    """Where a job's wall time goes, without a profiler (the lent machines have none that sees inside graphs): a job
    (FDLITE_STEP_TIMES_JOB: prefill_heavy, the default, or protocol) on FDLITE_PROFILE_MODEL (a MOE_BENCH_SHAPES
    name with random weights, or qwen3_06b as section_throughput builds it; `shape_name`) with graphs and the KV cache
    FDLITE_STEP_TIMES_KV (`kv_cache_dtype`: auto, the default, or fp8), run twice: async
    scheduling (the default: its generate wall time), then synchronous with each `ModelRunner.execute` bracketed by
    device syncs, so its time is the step's GPU time plus the host work that issues it. Their difference is host
    time the GPU waits for; the step times by kind (`steps_by_kind`, as section_breakdown's) say which steps cost
    what."""
    import ctypes  # noqa: PLC0415
    import gc  # noqa: PLC0415

    from fdlite import SamplingParams  # noqa: PLC0415

    sync = ctypes.CDLL("libcuda.so.1").cuCtxSynchronize if FDL_DEVICE == "gpu" else None
    name = shape_name(os.environ.get("FDLITE_PROFILE_MODEL", "qwen3_30b_a3b"), also=("qwen3_06b",))
    job_name = os.environ.get("FDLITE_STEP_TIMES_JOB", "prefill_heavy")
    kv = os.environ.get("FDLITE_STEP_TIMES_KV", "auto")
    if job_name == "protocol":
        ids, outs = protocol(n=8, max_in=200, max_out=120) if ARGS.quick else protocol()
        params = protocol_params(outs)
    else:
        ids = prefill_heavy_prompts(8, 64, 120) if ARGS.quick else prefill_heavy_prompts(1024 if name == "qwen3_06b"
                                                                                          else 256)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ids]

    def engine(async_scheduling: bool):
        if name == "qwen3_06b":
            return dense_llm(async_scheduling=async_scheduling, kv_cache_dtype=kv)
        return full_size_llm(name, use_cudagraph=True, async_scheduling=async_scheduling, kv_cache_dtype=kv)

    def job(async_scheduling: bool, events: bool = False):
        llm = engine(async_scheduling)
        # K and V of one token over every layer, as the runner sizes the cache (FP8: its scales too)
        kv_bytes = llm.runner.bytes_per_block // llm.config.block_size
        kv_dtype = llm.config.kv_cache_dtype  # what the engine made of FDLITE_STEP_TIMES_KV
        gpu_view: dict = {}
        try:
            warm_up(llm)
            # synchronous: every step timed with its GPU work; async: the wall time only, or (events) the GPU's
            # busy and idle time between steps
            if events:
                timing = evented_steps(llm.runner)
            else:
                timing = timed_steps(llm.runner, sync) if not async_scheduling else contextlib.nullcontext([])
            with timing as steps:
                t = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - t
            if events:
                gpu_view, steps = steps, []
        finally:
            llm.close()
            gc.collect()
        out = {"generate_s": round(wall, 3), "kv_cache_dtype": kv_dtype, "kv_bytes_per_token": kv_bytes,
               **({"gpu_view": gpu_view} if gpu_view else {})}
        if steps:
            out.update({"execute_s": round(sum(s[2] for s in steps), 3), "steps": len(steps),
                        "by_kind": steps_by_kind(steps, wall), "decode_fit": decode_fit(steps, kv_bytes),
                        # the same fit over decode steps of 1-64, 65-128 and 129+ rows: where the KV read slows
                        "decode_fit_by_rows": {f"{lo}-{hi}": decode_fit([st for st in steps if lo <= st[1] <= hi],
                                                                          kv_bytes)
                                               for lo, hi in ((1, 64), (65, 128), (129, 10**9))},
                        # every step (tokens, decodes, microseconds, kv_tokens): other fits need no device time
                        "steps_raw": [[t, d, round(sec * 1e6), kv] for t, d, sec, kv in steps]})
        return out

    tag = f"{job_name}_{name}" + ("" if kv == "auto" else f"_kv_{kv}")
    run(f"async_{tag}", lambda: job(True))
    if FDL_DEVICE == "gpu":
        run(f"async_events_{tag}", lambda: job(True, events=True))
    run(f"sync_timed_{tag}", lambda: job(False))


def section_moe_bench():
    """ERNIE-4.5-21B-A3B and Qwen3-30B-A3B shapes, Qwen3-4B's as the dense comparison and Llama-3.1-8B's (issue 25's
    8B rows), bf16, random weights
    (load_format="dummy": only config.json on disk), graphs on, one engine at a time: (a) the nano-vllm protocol's
    output tokens/s and steps, (b) a prefill-heavy job (256 prompts of 1,024-2,040 tokens, 8 output tokens each)
    in tokens/s; beside each, its roofline over the steps the engine ran (tools/gpu/moe_roofline.py: the experts a
    step's tokens touch + the dense weights + KV at 3.0 TB/s, FLOPs at 790 TFLOP/s). `--cases a,b` runs only the
    shapes whose name holds one of them (each full-size model is minutes of device time)."""
    import gc  # noqa: PLC0415

    from fdlite import SamplingParams  # noqa: PLC0415
    from moe_roofline import ModelCosts, StepLog, job_roofline  # noqa: PLC0415

    names = [n for n in MOE_BENCH_SHAPES if wanted_case(n)]
    for name in names:
        state = {}
        costs = ModelCosts.from_dir(config_only_model(name))

        def startup(name=name, costs=costs):
            t = time.time()
            # max_num_batched_tokens 8192 as section_throughput's dense runs, so the numbers compare.
            state["llm"] = full_size_llm(name, use_cudagraph=True)
            llm = state["llm"]
            held = sum(int(np.prod(p.shape)) for p in llm.runner.model.parameters())
            out = {"wall_s": round(time.time() - t, 1), "startup": llm.startup_report, "kv_blocks": llm.num_blocks,
                   "kv_token_capacity": llm.num_blocks * llm.config.block_size,
                   "params_held_B": float(f"{held / 1e9:.4g}"),
                   "params_total_B": float(f"{costs.total_params / 1e9:.4g}"),
                   "params_active_per_token_B": float(f"{costs.active_params / 1e9:.4g}"),
                   "moe_layers": costs.num_moe_layers, "experts": costs.num_experts, "top_k": costs.top_k,
                   "load_weights_GB_per_s": round(held * (2 if FDL_DEVICE == "gpu" else 4) / 1e9
                                                    / max(llm.startup_report["load_weights_s"], 1e-9), 2)}
            if FDL_DEVICE == "gpu":
                import paddle  # noqa: PLC0415

                out["memory_allocated_GiB"] = round(paddle.device.cuda.memory_allocated() / 2**30, 2)
            return out

        def timed(prompts, params, costs=costs):
            llm = state["llm"]
            log_steps = StepLog([len(p) for p in prompts])
            llm.engine.schedule_listeners.append(log_steps)
            try:
                t = time.time()
                res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                s = time.time() - t
            finally:
                llm.engine.schedule_listeners.remove(log_steps)
            n_in, n_out = sum(map(len, prompts)), sum(len(o.outputs[0].token_ids) for o in res)
            st = llm.last_generate_stats
            out = {"requests": len(prompts), "input_tokens": n_in, "output_tokens": n_out, "generate_s": round(s, 2),
                   "steps": st.get("num_steps"), "cudagraph_replays": st.get("cudagraph_replays"),
                   "preemptions": st.get("num_preemptions")}
            return out, job_roofline(costs, log_steps.steps, s)

        def protocol_case():
            llm = state["llm"]
            prompts, outs = protocol(n=8, max_in=200, max_out=120) if ARGS.quick else protocol()
            warm_up(llm)
            out, roof = timed(prompts, protocol_params(outs))
            out["requested_output_tokens"] = sum(outs)
            out["output_tokens_per_s"] = round(out["output_tokens"] / out["generate_s"], 1)
            out["roofline_output_tokens_per_s"] = round(out["output_tokens"] / roof["step_roofline_s"], 1)
            return {**out, "roofline": roof}

        def prefill_case():
            prompts = prefill_heavy_prompts(8, 64, 120) if ARGS.quick else prefill_heavy_prompts(256)
            warm_up(state["llm"])  # as the protocol's: with `--jobs prefill_heavy` alone this is the first generate
            out, roof = timed(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            out["tokens_per_s"] = round((out["input_tokens"] + out["output_tokens"]) / out["generate_s"], 1)
            out["flop_roofline_tokens_per_s"] = round((out["input_tokens"] + out["output_tokens"])
                                                      / max(roof["flop_roofline_s"], 1e-12), 1)
            return {**out, "roofline": roof}

        run(f"startup_{name}", startup)
        if "llm" in state:
            for job, case in (("protocol", protocol_case), ("prefill_heavy", prefill_case)):
                if job in ARGS.jobs.split(","):
                    run(f"{job}_{name}", case)
            state.pop("llm").close()  # one full-size model on the device at a time
            gc.collect()


if __name__ == "__main__":
    {"parity": section_parity, "graphs": section_graphs, "hf_bench": section_hf_bench,
     "throughput": section_throughput, "latency": section_latency, "diag": section_diag, "breakdown": section_breakdown,
     "sampling": section_sampling, "sampling_checks": section_sampling_checks, "churn": section_churn, "memory": section_memory,
     "profile": section_profile, "step_times": section_step_times, "moe": section_moe, "fp8": section_fp8,
     "moe_bench": section_moe_bench, "tp": section_tp, "tp_rank": section_tp_rank}[ARGS.section]()
    RES["total_s"] = round(time.time() - T0, 1)
    save()
    log("done", ARGS.section, "errors:", len(RES["errors"]))
