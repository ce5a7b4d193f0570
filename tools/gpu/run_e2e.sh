#!/usr/bin/env bash
# Device side, after Paddle is staged (see docs/benchmarks.md, "GPU: how the runs were made"): builds fdlite's
# GPU ops with the machine's nvcc for sm_90, then runs tools/gpu/e2e_harness.py sections, one process each,
# each under its own time limit. Results: $OUT/<section>.json and $OUT/e2e_log.txt.
#
#   bash $KIT/device-setup.sh setup && SECTIONS="parity graphs" bash tools/gpu/run_e2e.sh
#   SECTIONS="hf_bench throughput" bash tools/gpu/run_e2e.sh      (a second call while the machine is warm)
# Env: KIT (the Paddle 2.6.2 staging kit's folder, holding device-setup.sh; default shared/gpu-paddle beside tools/;
# docs/design.md, "The GPU host framework"), SECTIONS, LIMITS
# ("parity=170 graphs=100 hf_bench=90 throughput=230": seconds per section), HARNESS_ARGS, FDAR_DEBUG (section tp).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-${TMPDIR:-/tmp}/fdl_e2e_out}
source tools/gpu/device_env.sh
export GLOG_minloglevel=2
LOG=$OUT/e2e_log.txt
start_log "$LOG" || exit 1
cp "$(dirname "$FDLITE_GPU_OPS_LIB")/ptxas_report.txt" "$OUT/" 2>/dev/null || true
declare -A LIMIT=([parity]=170 [graphs]=150 [hf_bench]=90 [throughput]=230 [latency]=240 [diag]=200 [sampling_checks]=200 [sampling]=330 [churn]=420
                  [memory]=150 [moe_bench]=560 [tp]=560)
for kv in ${LIMITS:-}; do LIMIT[${kv%%=*}]=${kv#*=}; done
if [[ " ${SECTIONS:-} " == *" tp "* ]]; then
  # The tensor-parallel section's collectives: the custom all-reduce library, with barriers that trap after 20 s
  # instead of hanging (FDAR_DEBUG=1) unless FDAR_DEBUG=0 is passed.
  FDAR_DEBUG=${FDAR_DEBUG:-1} GPU_OPS=0 bash tools/gpu/build_ops.sh fdlite/kernels/lib > "$OUT/allreduce_build.log" 2>&1 \
    && echo "custom all-reduce library built" | tee -a "$LOG" || { echo "custom all-reduce build failed" | tee -a "$LOG"; tail -20 "$OUT/allreduce_build.log"; }
fi
rc=0
for s in ${SECTIONS:-parity graphs hf_bench throughput}; do
  t1=$SECONDS
  timeout -k 5 "${LIMIT[$s]:-120}" python3 tools/gpu/e2e_harness.py "$s" --out "$OUT" ${HARNESS_ARGS:-} 2>&1 | filter | tee -a "$LOG"
  r=${PIPESTATUS[0]}
  echo "section $s rc=$r in $((SECONDS - t1)) s" | tee -a "$LOG"
  (( r != 0 )) && rc=$r
done
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text())
    for case, r in d.get("results", {}).items():
        keep = {k: v for k, v in r.items() if k not in ("startup", "errs_ours", "errs_hf_bf16", "errs_hf_e4m3_kv", "trace", "greedy_tokens")}
        print(f"{case}: {json.dumps(keep, default=str)[:600]}")
    for e in d.get("errors", []):
        print(f"ERROR {e['case']}: {e['error'][:400]}")
PY
if [[ -f "$OUT/throughput.json" ]]; then
  python3 tools/gpu/plot_step_times.py "$OUT/throughput.json" "$OUT/decode_step_times.png" 2>&1 | tee -a "$LOG"
fi
exit $rc
