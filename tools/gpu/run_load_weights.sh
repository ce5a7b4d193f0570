#!/usr/bin/env bash
# Device side, after Paddle is staged (docs/design.md, "The GPU host framework"): builds fdlite's GPU ops, then
# times `LLM(path)` on the GPU with benchmarks/load_weights.py (startup phases, model build, load_weights MB/s
# from the page cache) for each shape in SHAPES. Results: $OUT/load_<shape>.json and $OUT/load_log.txt.
#
#   bash $KIT/device-setup.sh setup && bash tools/gpu/run_load_weights.sh
#   SHAPES="qwen3-0.6b llama-8b" bash tools/gpu/run_load_weights.sh     (llama-8b writes about 16 GB)
# Env: KIT (see device_env.sh), SHAPES (default qwen3-0.6b), MODELS (where the random checkpoints are written,
# default $TMPDIR/fdl_models), BENCH_ARGS (more benchmarks/load_weights.py options), BASELINE (a folder holding
# another fdlite package to time the same way first, with BASELINE_ARGS, e.g. "--max-model-len 4096").
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-${TMPDIR:-/tmp}/fdl_load_out}
source tools/gpu/device_env.sh
export GLOG_minloglevel=2
LOG=$OUT/load_log.txt
MODELS=${MODELS:-${TMPDIR:-/tmp}/fdl_models}
start_log "$LOG" || exit 1
rc=0
for s in ${SHAPES:-qwen3-0.6b}; do
  if [[ -n "${BASELINE:-}" ]]; then
    PYTHONPATH=$BASELINE:${PYTHONPATH:-} python3 benchmarks/load_weights.py --shape "$s" --device gpu --dir "$MODELS" \
      --json "$OUT/load_${s}_baseline.json" ${BASELINE_ARGS:-} 2>&1 | filter | tee -a "$LOG"
  fi
  PYTHONPATH=$(pwd):${PYTHONPATH:-} python3 benchmarks/load_weights.py --shape "$s" --device gpu --dir "$MODELS" \
    --json "$OUT/load_$s.json" ${BENCH_ARGS:-} 2>&1 | filter | tee -a "$LOG"
  r=${PIPESTATUS[0]}
  (( r != 0 )) && rc=$r
done
exit $rc
