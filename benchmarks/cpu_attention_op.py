"""Per-call time of CPU decode attention: the C++ op vs the Paddle-op reference (fdlite/layers/attention.py).

The shape of `cpu_throughput.py`'s model and workload: a decode batch of 32 rows with contexts of
~300 tokens, 8 query heads / 4 KV heads, head_dim 32, block size 64, 4 layers (the reference derives
its cache row indices once per step and shares them over the layers, so a step of 4 calls is timed
and divided by 4). The cache write (`write_kv`, the same in both) is not included.

    python benchmarks/cpu_attention_op.py [--batch 32 --ctx 300 --layers 4 --steps 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block-size", type=int, default=64)
    args = ap.parse_args()

    import fdlite  # noqa: F401  (MKL setup first, as the engine does)
    import paddle

    from fdlite.kernels import cpu_attention
    from fdlite.layers.attention import reference_attention
    from test_cpu_attention_op import make_case

    paddle.set_device("cpu")
    rng = np.random.default_rng(0)
    rows = [(1, int(n)) for n in rng.integers(args.ctx - 20, args.ctx + 21, size=args.batch)]
    cases = [make_case(rows, 8, 4, 32, args.block_size, seed=i) for i in range(args.layers)]
    meta = cases[0][3]
    scale = 32**-0.5

    def ref_step():
        meta.derived.clear()  # a new step: the row indices are derived again, once for all layers
        for q, kc, vc, _ in cases:
            reference_attention(q, kc, vc, meta, scale)

    def cpp_step():
        for q, kc, vc, _ in cases:
            cpu_attention.paged_attention(q, kc, vc, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens_kv, scale,
                                          False)

    def best_of(fn, reps=5) -> float:
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(args.steps // reps):
                fn()
            times.append((time.perf_counter() - t) / (args.steps // reps))
        return min(times) / args.layers * 1e6

    if not cpu_attention.load():
        sys.exit(f"C++ op unavailable: {cpu_attention.status()['reason']}")
    ref = best_of(ref_step)
    cpp = best_of(cpp_step)
    print(f"decode attention, batch {args.batch}, context ~{args.ctx}, 8/4 heads, d 32, block {args.block_size}, "
          f"{os.cpu_count()} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"| path | us per layer call |\n|---|---|\n| Paddle-op reference | {ref:.0f} |\n| C++ op | {cpp:.0f} |")
    print(f"speed-up: {ref / cpp:.1f}x")


if __name__ == "__main__":
    main()
