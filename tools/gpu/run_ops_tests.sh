#!/usr/bin/env bash
# Device side, one call after Paddle is staged: builds fdlite's GPU ops with the machine's nvcc for
# sm_90 and runs tools/gpu/ops_harness.py (every op vs a float64 reference, eager and in CUDA
# graphs, on NaN-seeded memory; then micro-benchmarks). Results: $OUT/ops_results.json and
# $OUT/ops_log.txt (OUT default $TMPDIR/fdl_ops_out, TMPDIR defaulting to /tmp).
#
# From the copied project root on the GPU machine, with the Paddle 2.6.2 staging kit copied to KIT
# (docs/design.md, "The GPU host framework"):
#   bash $KIT/device-setup.sh setup && bash tools/gpu/run_ops_tests.sh
# (see docs/benchmarks.md, "GPU: how the runs were made", for the exact staging calls).
# Env: KIT (the kit's folder, holding device-setup.sh; default: shared/gpu-paddle beside tools/), HARNESS_ARGS
# (e.g. "--quick --no-bench"), LIMIT_S (default 480: the harness is killed after this).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-${TMPDIR:-/tmp}/fdl_ops_out}
source tools/gpu/device_env.sh
machine_header 2>&1 | grep -v -E "compute capability|Please NOTE: device|has been registered" | tee "$OUT/ops_log.txt"
t0=$SECONDS
timeout -k 10 "${LIMIT_S:-480}" python3 tools/gpu/ops_harness.py --out "$OUT" ${HARNESS_ARGS:-} 2>&1 \
  | grep -v -E "compute capability|Please NOTE: device|has been registered" | tee -a "$OUT/ops_log.txt"
rc=${PIPESTATUS[0]}
echo "harness rc=$rc after $((SECONDS - t0)) s" | tee -a "$OUT/ops_log.txt"
# the ptxas resource report of the build (registers, spills) comes back too
cp "$FDLITE_OPS_CACHE"/*/ptxas_report.txt "$OUT/" 2>/dev/null || true
exit $rc
