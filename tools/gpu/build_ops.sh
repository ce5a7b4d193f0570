#!/usr/bin/env bash
# Builds libfdlite_allreduce.so (the C ABI of fdlite/kernels/csrc) with the local nvcc, then, when
# a CUDA build of Paddle imports, libfdlite_gpu_ops.so (the forward's ops, fdlite/kernels/csrc/ops_*.cu) through
# fdlite/kernels/build.py into the same directory (FDLITE_GPU_OPS_LIB=<dir>/libfdlite_gpu_ops.so
# then skips fdlite's own build cache).
# Works on a machine without a GPU too (compile check); the GPU run uses the same script.
#   tools/gpu/build_ops.sh [OUT_DIR]      (default: fdlite/kernels/lib)
# GPU_OPS=0 skips the forward's ops, GPU_OPS=1 requires them (default: build them if a CUDA Paddle imports).
# Env: NVCC (default nvcc), FDAR_ARCH (default 90: -gencode arch=compute_90,code=sm_90),
#      FDAR_DEBUG=1 adds a 20 s spin timeout that traps instead of hanging on a lost peer.
set -euo pipefail
cd "$(dirname "$0")/../.."
SRC=fdlite/kernels/csrc
OUT=${1:-fdlite/kernels/lib}
NVCC=${NVCC:-nvcc}
ARCH=${FDAR_ARCH:-90}
mkdir -p "$OUT"
FLAGS=(-O3 -std=c++17 -Xcompiler -fPIC,-fvisibility=hidden -shared
       -gencode=arch=compute_${ARCH},code=sm_${ARCH}
       -Xptxas -warn-spills --resource-usage)
if [[ "${FDAR_DEBUG:-0}" == 1 ]]; then FLAGS+=(-DFDAR_SPIN_TIMEOUT_NS=20000000000ull); fi
# Everything hidden but the C ABI (FDAR_API in the header); the version script also keeps
# the statically linked CUDA runtime out of the dynamic symbol table.
cat > "$OUT/fdar.map" <<'MAP'
{ global: fdar_*; local: *; };
MAP
set -x
"$NVCC" "${FLAGS[@]}" -Xlinker --version-script="$OUT/fdar.map" \
  "$SRC/custom_all_reduce.cu" "$SRC/custom_all_reduce_capi.cu" \
  -o "$OUT/libfdlite_allreduce.so"
set +x
GPU_OPS=${GPU_OPS:-auto}
if [[ "$GPU_OPS" != 0 ]]; then
  if python3 -c "import paddle, sys; sys.exit(not paddle.is_compiled_with_cuda())" >/dev/null 2>&1; then
    python3 fdlite/kernels/build.py --out "$OUT" --force --verbose
  elif [[ "$GPU_OPS" == 1 ]]; then
    echo "GPU_OPS=1 but no CUDA build of Paddle imports: cannot build libfdlite_gpu_ops.so" >&2; exit 1
  else
    echo "no CUDA build of Paddle here: skipped libfdlite_gpu_ops.so (tools/gpu/compile_check.sh compiles it without one)"
  fi
fi
