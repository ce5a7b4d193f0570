#!/usr/bin/env bash
# Compiles fdlite/kernels/csrc/paddle_binding.cc to an object with PADDLE_WITH_CUDA defined,
# the configuration of a paddlepaddle-gpu build, against Paddle's C++ headers.
# Paddle's headers with CUDA on include cuBLAS/cuBLASLt, cuDNN, cuFFT, cuRAND, cuSPARSE
# and cuSOLVER headers; the CUDA pip wheels that PyTorch installs carry them, so this
# runs on the GPU machine (no Paddle there: PADDLE_INCLUDE names a copied include dir).
#   PADDLE_INCLUDE=/path/to/paddle/include bash tools/gpu/check_paddle_binding.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=$(mktemp -d)
if [[ -z "${PADDLE_INCLUDE:-}" ]]; then
  if [[ -f .gpu_paddle_include.tgz ]]; then  # carried next to the tree by the GPU run
    mkdir -p "$WORK/paddle_inc" && tar xzf .gpu_paddle_include.tgz -C "$WORK/paddle_inc"
    PADDLE_INCLUDE=$WORK/paddle_inc/include
  else
    PADDLE_INCLUDE=$(python3 -c "import paddle; print(paddle.sysconfig.get_include())")
  fi
fi
P=$PADDLE_INCLUDE
PY_INC=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
CUDA_INC=
for d in "${CUDA_HOME:-}" /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; do
  if [[ -n "$d" && -f "$d/include/cuda_runtime.h" ]]; then CUDA_INC=$d/include; break; fi
done
INCS=(-I"$P" -I"$P/third_party" -I"$P/paddle/phi/api/include/compat"
      -I"$P/paddle/phi/api/include/compat/torch/csrc/api/include" -I"$PY_INC"
      -I"$CUDA_INC" -I"$CUDA_INC/cccl" -Ifdlite/kernels/csrc)
# Library headers from the nvidia-* wheels (cublas, cudnn, cufft, curand, cusparse, cusolver).
SITE=$(python3 -c "import site; print(site.getsitepackages()[0])")
while IFS= read -r d; do INCS+=(-I"$d"); done < <(find "$SITE/nvidia" -maxdepth 3 -type d -name include 2>/dev/null)
ls "$PY_INC/Python.h" >/dev/null
set -x
g++ -std=c++17 -O2 -fPIC -c -DPADDLE_WITH_CUDA -DPADDLE_WITH_CUSTOM_KERNEL \
  -DPADDLE_EXTENSION_NAME=fdlite_ops -D_GLIBCXX_USE_CXX11_ABI=1 -w "${INCS[@]}" \
  fdlite/kernels/csrc/paddle_binding.cc -o "$WORK/paddle_binding_cuda.o"
set +x
echo "paddle_binding.cc compiled with PADDLE_WITH_CUDA: $(stat -c %s "$WORK/paddle_binding_cuda.o") bytes"
echo "undefined Paddle symbols it expects from a GPU libpaddle.so:"
nm -C --undefined-only "$WORK/paddle_binding_cuda.o" | grep -E "paddle::|phi::" | sed 's/^ *U /  /' | head -20
