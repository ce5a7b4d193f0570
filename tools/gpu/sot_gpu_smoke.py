"""graph_opt_level 1 (SOT) under Python 3.11 + Paddle 2.6.2 (issue 27): same greedy tokens as level 0, and only
fdlite's kernels in the translated programs.

PyPI's paddlepaddle-gpu 2.6.2 translates with SOT only on Python <= 3.11 (fdlite/graph/static_graph.py), and its
built-in kernels do nothing on sm_90: a built-in computing op in a translated program would show as wrong tokens, and
is listed here by name. A random Qwen3 model from a config.json and load_format="dummy" (no torch, no transformers).

    py311 tools/gpu/sot_gpu_smoke.py --out DIR                 # on the GPU (tools/gpu/run_sot_gpu.sh)
    python tools/gpu/sot_gpu_smoke.py --out DIR --device cpu   # dry run of the logic, no CUDA graphs, no sentinel
                                                               # (fdlite's CPU path needs Paddle 3: run it there)

Runs: level 0 eager, then level 1 eager, and on the GPU level 0 and level 1 with CUDA graphs. Writes DIR/sot_smoke.json;
exits 1 when Paddle or SOT cannot start, or a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

ap = argparse.ArgumentParser()
ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "fdl_sot_out"))
ap.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
ap.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "fdl_sot_models"))
ap.add_argument("--max-tokens", type=int, default=24)
ap.add_argument("--no-sentinel", action="store_true", help="no Python-level sentinel (should SOT itself call a "
                                                            "sentinelled API while it translates)")
ARGS = ap.parse_args()
os.makedirs(ARGS.out, exist_ok=True)
RES: dict = {"python": sys.version.split()[0], "device": ARGS.device, "results": {}, "errors": []}
T0 = time.time()

# The GPU harness's Qwen3 shapes (tools/gpu/e2e_harness.py GPU_BASE, head_dim 128), as Qwen3Config writes them.
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1024, "hidden_size": 256,
         "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 2048, "initializer_range": 0.1,
         "rms_norm_eps": 1e-06, "tie_word_embeddings": True, "rope_theta": 1000000.0, "attention_bias": False,
         "use_sliding_window": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
# Ops that move or name data without a Paddle arithmetic kernel (feeds, fetches, copies, views).
PLUMBING = {"feed", "fetch", "fetch_v2", "data", "shadow_output", "share_data", "share_data_", "assign", "assign_out_",
            "memcpy", "memcpy_h2d", "memcpy_d2h", "parameter", "set_parameter", "builtin.parameter",
            "builtin.set_parameter", "builtin.shadow_output", "builtin.combine", "builtin.split", "builtin.slice",
            "reshape2", "reshape", "reshape_"}


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def save():
    with open(os.path.join(ARGS.out, "sot_smoke.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


def fail(case: str, e: BaseException) -> None:
    RES["errors"].append({"case": case, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]})
    log("!! FAILED", case, type(e).__name__, str(e)[:1500])
    save()


def fdlite_op_names() -> set[str]:
    names = set()
    for src in (ROOT / "fdlite" / "kernels" / "csrc").glob("*.cu"):
        names |= set(re.findall(r"PD_BUILD_OP\((\w+)\)", src.read_text()))
    return names


_SEEN_PROGRAMS: set[int] = set()  # compiled programs already counted (the probe's, earlier runs')


def translated_op_types() -> tuple[int, Counter]:
    """(programs, op type counts) of the static programs SOT compiled in this process since the last call
    (Paddle 2.6's legacy Program; PIR's in Paddle 3)."""
    from paddle.jit.sot.symbolic.compile_cache import FallbackWrapper  # noqa: PLC0415

    ops: Counter = Counter()
    programs = 0
    for w in gc.get_objects():
        if not isinstance(w, FallbackWrapper) or getattr(w, "concrete_program", None) is None:
            continue
        if id(w) in _SEEN_PROGRAMS:
            continue
        _SEEN_PROGRAMS.add(id(w))
        prog = w.concrete_program.main_program
        programs += 1
        for block in getattr(prog, "blocks", None) or [prog.global_block()]:
            for op in block.ops:
                ops[op.type if isinstance(getattr(op, "type", None), str) else op.name()] += 1
    return programs, ops


def classify(ops: Counter) -> dict:
    ours = fdlite_op_names()
    buckets: dict[str, dict] = {"fdlite": {}, "plumbing": {}, "builtin_compute": {}}
    for name, n in sorted(ops.items()):
        bare = name.split(".", 1)[-1] if name.startswith(("custom_op.", "pd_op.")) else name
        kind = "fdlite" if bare.rstrip("_") in {o.rstrip("_") for o in ours} else (
            "plumbing" if name in PLUMBING or bare in PLUMBING else "builtin_compute")
        buckets[kind][name] = n
    return buckets


class Sentinel:
    """tests/test_gpu_path_cpu.py's check: Paddle's computing ops raise while it is on (on the Hopper GPUs each
    would silently do nothing). Here for the GPU only: the CPU path computes with them by design."""

    def __init__(self, on: bool):
        self.on, self.saved = on, []

    def __enter__(self):
        if not self.on:
            return self
        import paddle  # noqa: PLC0415
        import paddle.nn.functional as F  # noqa: PLC0415

        def refuse(name):
            def f(*a, **k):
                raise AssertionError(f"Paddle built-in {name} ran on the GPU path")
            return f

        for mod, names in ((paddle, ("matmul", "gather", "scatter_", "split", "chunk", "concat", "where", "full",
                                     "zeros", "arange", "rsqrt", "take_along_axis")),
                           (F, ("embedding", "silu", "softmax")),
                           (paddle.Tensor, ("astype", "__add__", "__radd__", "__sub__", "__mul__", "__rmul__"))):
            for name in names:
                self.saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, refuse(f"{getattr(mod, '__name__', 'Tensor')}.{name}"))
        return self

    def __exit__(self, *exc):
        for mod, name, fn in reversed(self.saved):
            setattr(mod, name, fn)
        self.saved.clear()


def sot_probe() -> dict:
    """SOT alone, on the CPU (Paddle's own kernels do nothing on sm_90): a function with a Python-side branch
    translated by to_static(full_graph=False); its tokens-free check that this Python and Paddle translate."""
    import numpy as np  # noqa: PLC0415
    import paddle  # noqa: PLC0415
    from fdlite.graph.static_graph import translation_count  # noqa: PLC0415

    def f(x, w, n: int):
        y = paddle.matmul(x, w)
        return y * 2 if n > 1 else y

    from paddle.jit.sot.utils import min_graph_size_guard  # noqa: PLC0415

    before, device = translation_count(), paddle.get_device()
    paddle.set_device("cpu")
    try:
        x, w = np.arange(6, dtype="float32").reshape(2, 3), np.ones((3, 2), "float32")
        g = paddle.jit.to_static(f, full_graph=False)
        with min_graph_size_guard(0):  # SOT runs graphs under MIN_GRAPH_SIZE (10) ops eagerly
            got = [g(paddle.to_tensor(x), paddle.to_tensor(w), n).numpy() for n in (1, 2, 2)]
    finally:
        paddle.set_device(device)
    programs, ops = translated_op_types()
    ok = all(np.allclose(a, x @ w * k) for a, k in zip(got, (1, 2, 2)))
    return {"translations": translation_count() - before, "programs": programs, "ops": dict(ops), "correct": ok}


def model_dir() -> str:
    path = os.path.join(ARGS.models, "qwen3")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(QWEN3, f, indent=1)
    return path


def prompts() -> list[list[int]]:
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(27)
    return [rng.integers(3, 1024, size=int(k)).tolist() for k in (5, 40, 100, 17, 64, 250)]


def one_run(name: str, level: int, cudagraph: bool, path: str, want: list | None,
            min_graph_size: int | None = None) -> list | None:
    """One engine: its greedy tokens, SOT's translations (those inside CUDA-graph capture apart) and the op types
    of the programs it compiled. `min_graph_size`: SOT's MIN_GRAPH_SIZE for this run (its default, 10, runs smaller
    translated pieces eagerly, so none of them shows as a program)."""
    import contextlib  # noqa: PLC0415

    log("==", name)
    guard = contextlib.nullcontext()
    if min_graph_size is not None:
        from paddle.jit.sot.utils import min_graph_size_guard  # noqa: PLC0415

        guard = min_graph_size_guard(min_graph_size)
    try:
        with guard:
            return _run_engine(name, level, cudagraph, path, want, min_graph_size)
    except Exception as e:  # noqa: BLE001 - recorded with its trace, the next run goes on
        fail(name, e)
        return None


def _run_engine(name: str, level: int, cudagraph: bool, path: str, want: list | None, min_graph_size) -> list:
    from fdlite import LLM, SamplingParams  # noqa: PLC0415
    from fdlite.graph.static_graph import translation_count  # noqa: PLC0415

    t = time.time()
    before = translation_count()
    llm = LLM(path, load_format="dummy", device=ARGS.device, dtype="float32", skip_tokenizer_init=True,
              max_num_seqs=8, block_size=16, max_model_len=512, max_num_batched_tokens=256,
              kv_cache_memory_bytes=64 << 20, num_gpu_blocks_override=256 if ARGS.device == "gpu" else None,
              graph_optimization_config={"graph_opt_level": level, "use_cudagraph": cudagraph})
    at_init = translation_count() - before
    params = SamplingParams(temperature=0, max_tokens=ARGS.max_tokens, ignore_eos=True)
    with Sentinel(ARGS.device == "gpu" and not ARGS.no_sentinel):
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts()], params,
                                                             use_tqdm=False)]
    st = llm.last_generate_stats
    ph = llm.phases
    inside = None
    if any(e.name == "cudagraph_capture" for e in ph.events):
        inside = (ph.probe_at("end", "cudagraph_capture", "sot_translations")
                  - ph.probe_at("begin", "cudagraph_capture", "sot_translations"))
    res = {"graph_opt_level": level, "use_cudagraph": cudagraph, "min_graph_size": min_graph_size,
           "sot_translations_at_init": at_init, "sot_translations_inside_capture": inside,
           "sot_translations_total": translation_count() - before, "tokens": sum(map(len, got)),
           "steps": st.get("num_steps"), "cudagraph_replays": st.get("cudagraph_replays"),
           "seconds": round(time.time() - t, 2)}
    if want is not None:
        res["identical_to_level0_eager"] = got == want
        res["first_diff"] = next(([i, a[:8], b[:8]] for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if level >= 1:
        programs, ops = translated_op_types()
        res["translated_programs"] = programs
        res["translated_ops"] = classify(ops)
    RES["results"][name] = res
    log("  ->", json.dumps(res, default=str)[:1500])
    del llm
    gc.collect()
    save()
    return got


def main() -> int:
    log("python", sys.version.split()[0], sys.executable)
    try:
        import paddle  # noqa: PLC0415

        RES["paddle"] = {"version": paddle.__version__, "cuda_build": paddle.is_compiled_with_cuda()}
        import paddle.jit.sot  # noqa: F401, PLC0415

        RES["paddle"]["sot"] = True
        from fdlite.graph.static_graph import sot_unavailable_reason  # noqa: PLC0415

        reason = sot_unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        if ARGS.device == "gpu":
            from fdlite.kernels import build  # noqa: PLC0415

            RES["paddle"]["ops_library"] = build.build()
    except Exception as e:  # noqa: BLE001 - the reportable outcome: Python 3.11 / Paddle / SOT cannot start here
        fail("startup", e)
        return 1
    log("paddle", RES["paddle"])
    try:
        RES["sot_probe"] = sot_probe()
        log("sot probe", RES["sot_probe"])
    except Exception as e:  # noqa: BLE001
        fail("sot_probe", e)
        return 1
    path = model_dir()
    want = one_run("level0_eager", 0, False, path, None)
    if want is None:
        return 1
    # The first SOT engine translates (later ones reuse its code cache): on the GPU it is the one with graphs, so that
    # its translations happen inside capture, as the startup order wants; the last forces every piece into a program.
    runs = [("level0_cudagraph", 0, True, None), ("level1_cudagraph", 1, True, None), ("level1_eager", 1, False, None),
            ("level1_cudagraph_min_graph_size_0", 1, True, 0)] if ARGS.device == "gpu" else [
        ("level1_eager", 1, False, None)]
    for name, level, graphs, min_size in runs:
        one_run(name, level, graphs, path, want, min_size)
    r = RES["results"]
    first_sot = next(k for k, *_ in runs if k.startswith("level1"))
    checks = {
        "tokens_identical": all(v.get("identical_to_level0_eager") for k, v in r.items() if k != "level0_eager"),
        "sot_translated": r.get(first_sot, {}).get("sot_translations_total", 0) > 0,
        "sot_inside_capture": ARGS.device != "gpu" or (r.get(first_sot, {}).get("sot_translations_inside_capture")
                                                       or 0) > 0,
        "no_builtin_compute_in_translated_programs": all(not v["translated_ops"]["builtin_compute"]
                                                         for k, v in r.items() if "translated_ops" in v),
        "sot_probe": bool(RES["sot_probe"]["correct"] and RES["sot_probe"]["translations"] > 0),
        "all_runs_done": len(r) == 1 + len(runs) and not RES["errors"],
    }
    if ARGS.device == "cpu":  # the CPU path computes with Paddle's ops by design
        checks.pop("no_builtin_compute_in_translated_programs")
    RES["checks"], RES["pass"] = checks, all(checks.values())
    save()
    log("checks", checks, "PASS" if RES["pass"] else "FAIL")
    return 0 if RES["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
