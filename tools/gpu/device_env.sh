# Sourced by the device-side scripts (run_*.sh) from the project root, after they set OUT: Paddle's staged
# environment from the Paddle 2.6.2 staging kit (KIT, default shared/gpu-paddle; the kit is not in this repository:
# docs/design.md, "The GPU host framework"), the ops build cache, `machine_header` (the lines that open every log:
# GPU, clocks, nvcc, Python and Paddle versions), `filter` (drops Paddle's start-up chatter) and `start_log`.
KIT=${KIT:-$(pwd)/shared/gpu-paddle}
export PYTHONUNBUFFERED=1
if [[ -f "$KIT/device-setup.sh" ]]; then
  eval "$(bash "$KIT/device-setup.sh" env)"
fi
export FDLITE_OPS_CACHE=${FDLITE_OPS_CACHE:-${TMPDIR:-/tmp}/fdlite_ops_cache}
mkdir -p "$OUT"

machine_header() {
  echo "== machine $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  nvcc --version | tail -1
  python3 -c "import sys, paddle; print('python', sys.version.split()[0], 'paddle', paddle.__version__)"
}

filter() { grep -v -E "compute capability|Please NOTE: device|has been registered|^W[0-9]{4} "; }

# start_log LOG: the machine header into LOG, then fdlite's GPU ops built (or taken from the cache) and exported as
# FDLITE_GPU_OPS_LIB; returns 1, with the build's tail, when the build fails.
start_log() {
  local log=$1 t0=$SECONDS lib
  machine_header 2>&1 | filter | tee -a "$log"
  lib=$(python3 fdlite/kernels/build.py 2>>"$log") || { echo "ops build failed" | tee -a "$log"; tail -30 "$log"; return 1; }
  export FDLITE_GPU_OPS_LIB=$lib
  echo "ops library $lib built or cached in $((SECONDS - t0)) s" | tee -a "$log"
}
