#!/usr/bin/env bash
# Device side, after Paddle is staged: chosen launches of the ops harness's benchmarks under Nsight Compute with its
# full set of sections (clocks left alone, METHOD.md), to see where a kernel's time goes (warp stall reasons, pipe
# utilization, the SASS lines that stall most). Per case: $OUT/<name>.ncu-rep, <name>_details.txt (every section)
# and <name>_sass.csv.gz (per-instruction counters).
#
#   bash $KIT/device-setup.sh setup && CASES="attn_bn64|attention_prefill|attn_wgmma_kernelI13__nv_bfloat16Li128EEEv|62|1" \
#     bash tools/gpu/run_ncu_kernels.sh
# CASES: space-separated "name|benchmarks (the harness's --only)|regex over mangled kernel names|launches of matching
# kernels to skip|launches to profile". Env: NCU (default ncu), LIMIT_S (per case, default 240).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-${TMPDIR:-/tmp}/fdl_ncu_out}
source tools/gpu/device_env.sh
LOG=$OUT/ncu_log.txt
start_log "$LOG" || exit 1
NCU=${NCU:-ncu}
rc=0
for c in ${CASES:?CASES is required}; do
  IFS='|' read -r name only regex skip count <<< "$c"
  t1=$SECONDS
  timeout -k 5 "${LIMIT_S:-240}" "$NCU" --clock-control none --kernel-name-base mangled -k "regex:$regex" \
    --launch-skip "$skip" --launch-count "$count" --set full --import-source no -f -o "$OUT/$name" \
    python3 tools/gpu/ops_harness.py --out "$OUT/harness_$name" --lib "$FDLITE_GPU_OPS_LIB" --only "$only" 2>&1 \
    | filter | grep -E "==PROF==|==ERROR==|==WARNING==|prefill attn|moe layer" | tee -a "$LOG"
  r=${PIPESTATUS[0]}
  echo "case $name rc=$r in $((SECONDS - t1)) s" | tee -a "$LOG"
  (( r != 0 )) && rc=$r
  if [[ -f "$OUT/$name.ncu-rep" ]]; then
    "$NCU" -i "$OUT/$name.ncu-rep" --page details > "$OUT/${name}_details.txt" 2>&1
    "$NCU" -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass 2>/dev/null | gzip > "$OUT/${name}_sass.csv.gz"
  fi
done
exit $rc
