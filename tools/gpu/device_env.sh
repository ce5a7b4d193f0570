# Sourced by the device-side scripts (run_ops_tests.sh, run_e2e.sh) from the project root, after they set
# OUT: Paddle's staged environment from the Paddle 2.6.2 staging kit (KIT, default shared/gpu-paddle; the kit is not
# in this repository: docs/design.md, "The GPU host framework"), the ops build cache, and
# `machine_header`, the lines that open every log (GPU, clocks, nvcc, Python and Paddle versions).
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
