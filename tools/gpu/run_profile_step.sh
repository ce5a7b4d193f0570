#!/usr/bin/env bash
# Device side, after Paddle is staged: the kernels of one mixed step and one large decode step of the churn job
# (e2e_harness.py's `profile` section) under Nsight Compute, duration only, clocks left alone (METHOD.md), then a
# table per step: each kernel's time, grouped by name, and their sum beside the step's wall time.
# Results per kind (KINDS, default "mixed decode"; "prefill" too): $OUT/ncu_<kind>.csv, profile_<kind>.json, profile_<kind>.txt.
#
#   bash $KIT/device-setup.sh setup && bash tools/gpu/run_profile_step.sh
#   KINDS=prefill FDLITE_PROFILE_MODEL=qwen3_30b_a3b bash tools/gpu/run_profile_step.sh   (one 8k-token prefill step
#   of the prefill-heavy job on a full-size shape, random weights: e2e_harness.py's MOE_BENCH_SHAPES)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-${TMPDIR:-/tmp}/fdl_profile_out}
source tools/gpu/device_env.sh
export GLOG_minloglevel=2
LOG=$OUT/profile_log.txt
start_log "$LOG" || exit 1
NCU=${NCU:-ncu}  # Nsight Compute (on the lent machines' PATH; NCU= names another)
for kind in ${KINDS:-mixed decode}; do
  FDLITE_PROFILE_KIND=$kind timeout -k 5 "${LIMIT_S:-200}" "$NCU" --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
  --csv --log-file "$OUT/ncu_$kind.csv" python3 tools/gpu/e2e_harness.py profile --out "$OUT" 2>&1 | filter | tail -20 | tee -a "$LOG"
  mv "$OUT/profile.json" "$OUT/profile_$kind.json"
  python3 tools/gpu/profile_report.py "$OUT/ncu_$kind.csv" "$OUT/profile_$kind.json" | tee "$OUT/profile_$kind.txt"
done
