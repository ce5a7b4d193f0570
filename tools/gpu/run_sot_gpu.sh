#!/usr/bin/env bash
# Device side: graph_opt_level 1 (SOT) on the GPU under Python 3.11 + Paddle 2.6.2 (issue 27). After the cp312 kit
# (device-setup.sh setup) and tools/gpu/py311_setup.sh setup: builds fdlite's GPU ops with the 3.11 interpreter
# (its own cache: the library links the libpaddle.so it is built against, and the cp311 one is another file),
# then runs tools/gpu/sot_gpu_smoke.py. Results: $OUT/sot_smoke.json and $OUT/sot_log.txt.
#
#   bash $KIT/device-setup.sh setup && bash tools/gpu/py311_setup.sh setup && bash tools/gpu/run_sot_gpu.sh
# Env: KIT (as tools/gpu/device_env.sh), LIMIT (seconds for the smoke, default 400), SMOKE_ARGS.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
T=/tmp  # tools/gpu/py311_setup.sh's prefix
OUT=${OUT:-${TMPDIR:-/tmp}/fdl_sot_out}
source tools/gpu/device_env.sh
eval "$(bash tools/gpu/py311_setup.sh env)"
export GLOG_minloglevel=2 FDLITE_OPS_CACHE=${TMPDIR:-/tmp}/fdlite_ops_cache311
LOG=$OUT/sot_log.txt
command -v py311 >/dev/null || { echo "no py311: run tools/gpu/py311_setup.sh setup first" | tee -a "$LOG"; exit 1; }
machine_header 2>&1 | filter | tee -a "$LOG"
py311 -c "import sys, paddle; print('python', sys.version.split()[0], 'paddle', paddle.__version__)" 2>&1 | filter | tee -a "$LOG"
t0=$SECONDS
# nvsite: a site-packages holding only the device's nvidia/ libraries, where build.py looks for libcudart and cuBLAS.
lib=$(PY311_PATH=${PY311_PREFIX:-$T/py311}/nvsite/site-packages py311 fdlite/kernels/build.py 2>>"$LOG") \
  || { echo "ops build with Python 3.11 failed" | tee -a "$LOG"; tail -30 "$LOG"; exit 1; }
export FDLITE_GPU_OPS_LIB=$lib
echo "ops library $lib built or cached in $((SECONDS - t0)) s" | tee -a "$LOG"
timeout -k 5 "${LIMIT:-400}" py311 tools/gpu/sot_gpu_smoke.py --out "$OUT" ${SMOKE_ARGS:-} 2>&1 | filter | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "sot smoke rc=$rc" | tee -a "$LOG"
exit "$rc"
