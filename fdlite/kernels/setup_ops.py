"""Build fdlite's GPU ops as a Paddle extension, on a GPU machine at install time.

Hand-written the way FastDeploy builds its custom_ops: paddle.utils.cpp_extension
compiles the CUDA sources with nvcc and the op binding with the host compiler against
the installed paddlepaddle-gpu. The extension holds the custom op `custom_all_reduce`
(and exports the plain C ABI fdar_*, so the ctypes loader can use the very same library:
FDLITE_OPS_LIB=<the built .so>) and the forward's ops (fdlite/kernels/csrc/ops_*.cu, cuBLASLt
linked; FDLITE_GPU_OPS_LIB=<the built .so> makes fdlite.kernels.gpu load it instead of its own
cached build).

    cd fdlite/kernels && python setup_ops.py install

The usual path for the forward's ops is fdlite.kernels.build (compiled on first use, cached
on disk; its docstring says why); this script is for installs that want one prebuilt
library. Env: FDLITE_CUDA_ARCHS (default "90"), a ';'-separated list of compute
capabilities. Needs a CUDA build of Paddle: with the CPU wheel, Paddle's headers leave out
Tensor::stream() and the binding compiles only in its refuse-to-run form (see
fdlite/kernels/csrc/README.md).
"""
import importlib.util
import os

from paddle.utils.cpp_extension import CUDAExtension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")
ARCHS = [a.strip() for a in os.environ.get("FDLITE_CUDA_ARCHS", "90").split(";") if a.strip()]
GENCODE = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]

# The ops' source list and cuBLASLt's location come from the hand builder (loaded by path: no
# import of the fdlite package, hence of the engine, at build time).
_spec = importlib.util.spec_from_file_location("fdlite_gpu_build", os.path.join(HERE, "gpu", "build.py"))
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)
_tc = _build.find_toolchain(link=False)
LINK = []
if _tc.cublas_lib:
    LINK = [f"-L{_tc.cublas_lib}", "-l:" + _build._so_name(_tc.cublas_lib, "libcublasLt"),
            "-l:" + _build._so_name(_tc.cublas_lib, "libcublas"), f"-Wl,-rpath,{_tc.cublas_lib}"]

setup(
    name="fdlite_ops",
    ext_modules=CUDAExtension(
        sources=[
            os.path.join(CSRC, "custom_all_reduce.cu"),
            os.path.join(CSRC, "custom_all_reduce_capi.cu"),
            os.path.join(CSRC, "paddle_binding.cc"),
            *[os.path.join(CSRC, s) for s in _build.SOURCES],
        ],
        include_dirs=[CSRC, _tc.cublas_include],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"],
                            "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", *GENCODE]},
        extra_link_args=LINK,
    ),
)
