#!/usr/bin/env python3
"""Decode step time vs batch (eager, CUDA graphs, graph body on the GPU, roofline) from a throughput.json
that tools/gpu/e2e_harness.py wrote; a PNG for results/gpu/. Needs matplotlib (on the GPU machine's image).

    python3 tools/gpu/plot_step_times.py THROUGHPUT_JSON OUT_PNG
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

res = json.load(open(sys.argv[1]))["results"]["decode_step_times_ctx512"]
batches = sorted(int(k.split("_")[1]) for k in res if k.startswith("batch_"))
series = [("eager_ms", "eager step (forward + sample, host-synchronised)", "o-"),
          ("graph_ms", "CUDA-graph step (forward + sample)", "s-"),
          ("graph_replay_gpu_ms", "graph body, GPU time only", "^--"),
          ("roofline_ms", "roofline: (weights + KV) bytes / 3.0 TB/s", "k:")]
fig, ax = plt.subplots(figsize=(7, 4.5))
for key, label, style in series:
    ys = [res[f"batch_{b}"].get(key) for b in batches]
    if all(y is not None for y in ys):
        ax.plot(batches, ys, style, label=label)
ax.set_xscale("log", base=2)
ax.set_xticks(batches, [str(b) for b in batches])
ax.set_xlabel("decode batch (context 512 tokens per row)")
ax.set_ylabel("ms per step")
ax.set_title("fdlite decode step, Qwen3-0.6B shapes, bf16, H100 (Paddle 2.6.2 host, fdlite kernels)", fontsize=9)
ax.grid(True, alpha=0.3)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=120)
print("wrote", sys.argv[2])
