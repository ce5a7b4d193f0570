"""How fast `LLM(path)` is ready: startup phases, model build, and load_weights throughput from the page cache.

Writes (once, then reuses) a random bfloat16 checkpoint of a given shape: transformers builds the model's
config and its parameter names and shapes (on the meta device, nothing allocated), the values are random
bfloat16 numbers tiled from a small pool (random enough for loading, and fast to write at 8B), sharded
like Hugging Face's own files (5 GB shards and an index beyond one shard). Then `LLM(path)` is built with
defaults (the model's own max_model_len: 40960 for Qwen3-0.6B), the file read once beforehand so that it is
in the page cache, and the report says the startup phases, the model's construction (rotary tables
included) and `load_weights` alone with its MB/s (checkpoint bytes / seconds).

    python benchmarks/load_weights.py                              # Qwen3-0.6B's shape, this machine's device
    python benchmarks/load_weights.py --shape qwen3-0.6b --layers 4 --device cpu
    python benchmarks/load_weights.py --shape llama-8b --device gpu  # about 16 GB of disk
    python benchmarks/load_weights.py --model /path/to/folder --json out.json

On CPU the model computes in float32 (the bf16 checkpoint is converted while loading); on GPU in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import numpy as np

SHAPES = {
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)),
    "llama-8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
}
SHARD_BYTES = 5 * 10**9


def _random_bf16(shape: list[int], pool: np.ndarray, rng: np.random.Generator, norm: bool) -> np.ndarray:
    """bfloat16 bits (uint16) of `shape`: ones for norms, else the pool tiled from a random offset."""
    n = int(np.prod(shape))
    if norm:
        return np.full(shape, 0x3F80, np.uint16)  # 1.0
    start = int(rng.integers(0, len(pool)))
    return np.resize(np.roll(pool, -start), n).reshape(shape)


def write_model(path: str, shape: str, layers: int | None) -> str:
    """A random bf16 checkpoint of `shape` in `path` (reused when its config.json is there)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers
    from safetensors.torch import save_file

    cfg_cls, model_cls, kw = SHAPES[shape]
    if layers:
        kw = {**kw, "num_hidden_layers": layers}
    cfg = getattr(transformers, cfg_cls)(**kw, torch_dtype="bfloat16", architectures=[model_cls])
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(cfg)
    names = {n: list(p.shape) for n, p in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    rng = np.random.default_rng(0)
    # N(0, 0.02) as bfloat16 bits (truncated: any finite values do).
    pool = (rng.standard_normal(1 << 20).astype(np.float32) * 0.02).view(np.uint32) >> 16
    pool = pool.astype(np.uint16)
    os.makedirs(path, exist_ok=True)
    shards, current, size = [], {}, 0
    for name, shp in names.items():
        nbytes = 2 * int(np.prod(shp))
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = shp
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shp in shard.items():
            bits = _random_bf16(shp, pool, rng, norm=name.endswith("norm.weight"))
            tensors[name] = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
            weight_map[name] = file
            total += bits.nbytes
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    cfg.save_pretrained(path)  # config.json last: its presence says the folder is complete
    return path


def checkpoint_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def warm_page_cache(path: str) -> float:
    """Read every weight file once (so load_weights reads from the page cache); returns the seconds it took."""
    t = time.perf_counter()
    buf = bytearray(64 << 20)
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with open(os.path.join(path, f), "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass
    return time.perf_counter() - t


def measure(path: str, device: str | None, options: dict) -> dict:
    """`LLM(path, **options)` with the model's construction and load_weights timed on their own."""
    from fdlite import LLM
    from fdlite.runner import model_runner

    timings: dict[str, float] = {}
    real_load, real_class = model_runner.load_weights, model_runner.model_class

    def timed_load(model, p):
        t = time.perf_counter()
        real_load(model, p)
        timings["load_weights_only_s"] = time.perf_counter() - t

    def timed_class(arch):
        cls = real_class(arch)

        def build(*a, **k):
            t = time.perf_counter()
            m = cls(*a, **k)
            timings["model_build_s"] = time.perf_counter() - t
            return m
        return build

    model_runner.load_weights, model_runner.model_class = timed_load, timed_class
    try:
        t = time.perf_counter()
        llm = LLM(path, device=device, skip_tokenizer_init=True, **options)
        wall = time.perf_counter() - t
    finally:
        model_runner.load_weights, model_runner.model_class = real_load, real_class
    report = {k: round(v, 3) if isinstance(v, float) else v for k, v in llm.startup_report.items()}
    out = dict(wall_s=round(wall, 3), device=llm.runner.device, dtype=llm.runner.dtype,
               max_model_len=llm.config.max_model_len, **{k: round(v, 3) for k, v in timings.items()},
               startup=report)
    del llm
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's")
    ap.add_argument("--model", default=None, help="an existing model folder instead of a written one")
    ap.add_argument("--dir", default=None, help="where written models live (default: the temporary folder)")
    ap.add_argument("--device", default=None, help="cpu, gpu (default: Paddle's current device)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's own")
    ap.add_argument("--repeat", type=int, default=1, help="build LLM this many times (one process)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    path = args.model
    if path is None:
        name = f"fdlite-{args.shape}" + (f"-{args.layers}l" if args.layers else "") + "-bf16"
        path = os.path.join(args.dir or tempfile.gettempdir(), name)
        t = time.perf_counter()
        existed = os.path.isfile(os.path.join(path, "config.json"))
        write_model(path, args.shape, args.layers)
        print(f"model {path}: {'reused' if existed else f'written in {time.perf_counter() - t:.1f} s'}")
    nbytes = checkpoint_bytes(path)
    warm = warm_page_cache(path)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; checkpoint {nbytes / 1e6:.0f} MB "
          f"(read once in {warm:.2f} s to warm the page cache)")
    options = {} if args.max_model_len is None else {"max_model_len": args.max_model_len}
    runs = []
    for i in range(args.repeat):
        r = measure(path, args.device, options)
        r["load_mb_per_s"] = round(nbytes / 1e6 / r["load_weights_only_s"], 1) if r.get("load_weights_only_s") else None
        runs.append(r)
        s = r["startup"]
        print(f"run {i}: {r['device']} {r['dtype']} max_model_len={r['max_model_len']}: ready in {r['wall_s']:.2f} s "
              f"(load_weights phase {s.get('load_weights_s', 0):.2f} s: model build {r.get('model_build_s', 0):.2f} s, "
              f"load_weights() {r.get('load_weights_only_s', 0):.2f} s = {r['load_mb_per_s']} MB/s; "
              f"profile_run {s.get('profile_run_s', 0):.2f} s, kv_cache {s.get('kv_cache_s', 0):.2f} s, "
              f"graph_optimization {s.get('graph_optimization_s', 0):.2f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=path, checkpoint_bytes=nbytes, runs=runs), f, indent=1)


if __name__ == "__main__":
    main()
