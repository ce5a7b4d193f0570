#!/usr/bin/env bash
# Compiles every GPU op source (fdlite/kernels/csrc/ops_*.cu) for sm_90 with PADDLE_WITH_CUDA, once
# against each Paddle include directory given, without a GPU, without importing Paddle, without
# linking: the local check before any device time is spent.
#   tools/gpu/compile_check.sh [PADDLE_INCLUDE ...]
# Default include dirs: Paddle 2.6.2's (where the GPU-host staging kit unpacks the GPU wheel:
# $TMPDIR/pdl/w/paddle/include, TMPDIR defaulting to /tmp; docs/design.md, "The GPU host framework")
# and the installed paddle's (paddle.sysconfig.get_include()), whichever exist.
# Env: NVCC / CUDA_HOME (the compiler), FDLITE_CUBLAS_INCLUDE (dir of cublasLt.h, e.g. from the
# nvidia-cublas wheel), PYTHON (default python3), FDLITE_CUDA_ARCHS (default 90).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
incs=("$@")
if (( ${#incs[@]} == 0 )); then
  p26=${TMPDIR:-/tmp}/pdl/w/paddle/include
  [[ -d $p26 ]] && incs+=("$p26")
  inst=$("$PY" -c "import paddle; print(paddle.sysconfig.get_include())" 2>/dev/null || true)
  [[ -n "$inst" && -d "$inst" ]] && incs+=("$inst")
fi
if (( ${#incs[@]} == 0 )); then
  echo "no Paddle include directory found: pass one (Paddle 2.6.2 GPU wheel's paddle/include, or an installed paddle's)" >&2
  exit 2
fi
rc=0
for inc in "${incs[@]}"; do
  echo "== $inc"
  # build.py is run as a script: no import of the fdlite package (and so of Paddle) is needed.
  "$PY" fdlite/kernels/build.py --compile-only "$inc" || rc=1
done
exit $rc
