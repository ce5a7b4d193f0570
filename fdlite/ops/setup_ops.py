"""Build fdlite's GPU ops as a Paddle extension, on a GPU machine at install time.

Hand-written the way FastDeploy builds its custom_ops: paddle.utils.cpp_extension
compiles the CUDA sources with nvcc and the op binding with the host compiler against
the installed paddlepaddle-gpu. The extension holds the custom op `custom_all_reduce`
and also exports the plain C ABI (fdar_*), so the ctypes loader can use the very same
library:  FDLITE_OPS_LIB=<the built .so>.

    cd fdlite/ops && python setup_ops.py install

Env: FDLITE_CUDA_ARCHS (default "90"), a ';'-separated list of compute capabilities.
Needs a CUDA build of Paddle: with the CPU wheel, Paddle's headers leave out
Tensor::stream() and the binding compiles only in its refuse-to-run form (see
fdlite/ops/csrc/README.md).
"""
import os

from paddle.utils.cpp_extension import CUDAExtension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")
ARCHS = [a.strip() for a in os.environ.get("FDLITE_CUDA_ARCHS", "90").split(";") if a.strip()]
GENCODE = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]

setup(
    name="fdlite_ops",
    ext_modules=CUDAExtension(
        sources=[
            os.path.join(CSRC, "custom_all_reduce.cu"),
            os.path.join(CSRC, "custom_all_reduce_capi.cu"),
            os.path.join(CSRC, "paddle_binding.cc"),
        ],
        include_dirs=[CSRC],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": ["-O3", "-std=c++17", *GENCODE]},
    ),
)
