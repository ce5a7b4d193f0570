#!/usr/bin/env bash
# Device side, after Paddle is staged (docs/design.md, "The GPU host framework"): builds fdlite's GPU ops, then runs
# benchmarks/host_overhead.py on the GPU (it takes Paddle's current device): the engine's time per decode step around
# a forward that costs next to nothing (a Qwen2-shaped model of hidden size 128, one layer: --gpu-shapes), at vocabulary 500 and
# Qwen3's 151,936, greedy and sampled, CUDA graphs and async scheduling as the defaults leave them. Issue 24 asks for
# at most 1 ms a step at any batch. Results: $OUT/host_overhead.json and $OUT/host_log.txt.
#
#   bash $KIT/device-setup.sh setup && bash tools/gpu/run_host_overhead.sh
# Env: KIT (see device_env.sh), BENCH_ARGS (default: batches 1 64 256 at both vocabularies, greedy and sampled).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-${TMPDIR:-/tmp}/fdl_host_out}
source tools/gpu/device_env.sh
export GLOG_minloglevel=2
LOG=$OUT/host_log.txt
start_log "$LOG" || exit 1
PYTHONPATH=$(pwd):${PYTHONPATH:-} python3 benchmarks/host_overhead.py --gpu-shapes --json "$OUT/host_overhead.json" \
  ${BENCH_ARGS:---batches 1 64 256 --large-vocab-batches 1 64 256 --large-vocab-modes greedy sampled --repeats 3} \
  2>&1 | filter | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
