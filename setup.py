"""Build of dblast_ext._C with torch.utils.cpp_extension.

Install torch first, then `pip install --no-build-isolation .`. CUDA kernels are compiled
when FORCE_CUDA=1 or a GPU is visible, for TORCH_CUDA_ARCH_LIST (default "9.0" when
forced). MAX_JOBS bounds ninja's parallelism.
"""
import glob
import os

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError as exc:  # torch is deliberately not a build requirement
    raise SystemExit(
        "dblast_ext builds against the torch already installed: install torch (>=2.11,<2.15) first, "
        "then run `pip install --no-build-isolation .`"
    ) from exc

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    forced = os.environ.get("FORCE_CUDA", "0") == "1"
    if forced:
        if torch.version.cuda is None:
            raise SystemExit(
                f"FORCE_CUDA=1 but the installed torch {torch.__version__} is a CPU-only build; "
                "install a CUDA build of torch (e.g. torch==2.14.1) or unset FORCE_CUDA"
            )
        if CUDA_HOME is None:
            raise SystemExit("FORCE_CUDA=1 but no CUDA toolkit was found: set CUDA_HOME (e.g. /usr/local/cuda-13.0)")
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        return True
    return torch.version.cuda is not None and CUDA_HOME is not None and torch.cuda.is_available()


def extension():
    with_cuda = want_cuda()
    # csrc/checks: the argument checks, compiled by the C++ compiler only (also for the CUDA bindings)
    sources = ["csrc/ops.cpp", "csrc/python_module.cpp"] + sorted(glob.glob("csrc/checks/*.cpp"))
    sources += sorted(glob.glob("csrc/cpu/*.cpp"))
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if with_cuda else ""
    macros = [
        ("DBLAST_TORCH_VERSION", f'"{torch.__version__}"'),
        ("DBLAST_CUDA_ARCHS", f'"{archs}"'),
    ]  # Py_LIMITED_API comes from torch's BuildExtension (py_limited_api=True)
    # -fopenmp: at::parallel_for is a header template; without it the loops run serially.
    # -fno-trapping-math: lets gcc vectorise loops with float->int conversions (the fast exp);
    # nothing here relies on floating-point exceptions.
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-fno-trapping-math", "-fdiagnostics-color=always"]
    link = ["-fopenmp"]
    include_dirs = [os.path.join(ROOT, "csrc", "include")]
    if not with_cuda:
        return CppExtension(
            "dblast_ext._C", sources, include_dirs=include_dirs, define_macros=macros,
            extra_compile_args={"cxx": cxx}, extra_link_args=link, py_limited_api=True,
        )
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    macros.append(("DBLAST_WITH_CUDA", "1"))
    nvcc = ["-O3", "-std=c++20", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
    return CUDAExtension(
        "dblast_ext._C", sources, include_dirs=include_dirs, define_macros=macros,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc}, extra_link_args=link, py_limited_api=True,
    )


setup(
    packages=find_packages(include=["dblast_ext", "dblast_ext.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
