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
library; its source lists, like every other native build's, come from fdlite/kernels/native.py.
Env (fdlite/envs.py): FDLITE_CUDA_ARCHS (default "90"), a ';'-separated list of compute
capabilities; FDLITE_CUBLAS_INCLUDE / FDLITE_CUBLAS_LIB. Needs a CUDA build of Paddle: with the CPU wheel, Paddle's headers leave out
Tensor::stream() and the binding compiles only in its refuse-to-run form (see
fdlite/kernels/csrc/README.md).
"""
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.realpath(__file__))
# Run from this folder, sys.path[0] is this folder, whose platform.py would shadow the standard library's
# `platform` (which Paddle imports): drop it.
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]

from paddle.utils.cpp_extension import CUDAExtension, setup  # noqa: E402

# The source lists (native.py) and the toolchain (build.py: cuBLASLt's location, the archs), loaded by path:
# no import of the fdlite package, hence of the engine, at build time.
_spec = importlib.util.spec_from_file_location("fdlite_gpu_build", os.path.join(HERE, "build.py"))
_build = sys.modules["fdlite_gpu_build"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)
native = _build.native
CSRC = str(native.CSRC)
_tc = _build.find_toolchain(link=False)
GENCODE = _build.arch_flags(_tc.archs)
LINK = []
if _tc.cublas_lib:
    LINK = [f"-L{_tc.cublas_lib}", "-l:" + _build._so_name(_tc.cublas_lib, "libcublasLt"),
            "-l:" + _build._so_name(_tc.cublas_lib, "libcublas"), f"-Wl,-rpath,{_tc.cublas_lib}"]

setup(
    name="fdlite_ops",
    ext_modules=CUDAExtension(
        sources=[os.path.join(CSRC, s) for s in
                 [*native.ALLREDUCE_SOURCES, native.ALLREDUCE_BINDING, *native.GPU_OPS_SOURCES]],
        include_dirs=[CSRC, _tc.cublas_include],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"],
                            "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", *GENCODE]},
        extra_link_args=LINK,
    ),
)
