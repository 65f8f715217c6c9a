"""Build of dblast_ext._C with torch.utils.cpp_extension.

Install torch first, then `pip install --no-build-isolation .`. CUDA kernels are compiled
when FORCE_CUDA=1 or a GPU is visible, for the architectures cuda_arch_list() picks:
TORCH_CUDA_ARCH_LIST when set, else the visible GPUs' own, else DEFAULT_CUDA_ARCHS.
MAX_JOBS bounds ninja's parallelism. The sources and the compile/link flags come from
csrc/build.json, which CMakeLists.txt reads too (docs/development.md).
"""
import json
import os
from typing import List, Mapping, Sequence, Tuple

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
BUILD_JSON = os.path.join("csrc", "build.json")


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
        return True
    return torch.version.cuda is not None and CUDA_HOME is not None and torch.cuda.is_available()


def cuda_arch_list(environ: Mapping[str, str], visible: Sequence[Tuple[int, int]]) -> str:
    """The architectures to compile for: TORCH_CUDA_ARCH_LIST when set (other than torch's
    "native"), else those of the `visible` GPUs' compute capabilities, else DEFAULT_CUDA_ARCHS."""
    listed = environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if listed and listed != "native":
        return listed
    if visible:
        return ";".join(f"{major}.{minor}" for major, minor in sorted(set(visible)))
    return DEFAULT_CUDA_ARCHS


def visible_capabilities() -> List[Tuple[int, int]]:
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]


def build_description() -> dict:
    """csrc/build.json: the sources and flags this build shares with CMakeLists.txt."""
    with open(os.path.join(ROOT, BUILD_JSON)) as f:
        return json.load(f)


# What a CUDA build compiles for when neither TORCH_CUDA_ARCH_LIST nor a visible GPU says (8.0 to
# 12.0 and 12.0's PTX; csrc/build.json's cuda_archs, which CMakeLists.txt reads too)
DEFAULT_CUDA_ARCHS = ";".join(build_description()["cuda_archs"])


def extension_arguments(with_cuda: bool) -> dict:
    """The Extension's sources, include directories and compile/link flags, all from csrc/build.json."""
    build = build_description()
    sources = build["sources"]["library"] + build["sources"]["python"]  # python: this extension's PyInit
    compile_args = {"cxx": list(build["flags"]["cxx"])}
    if with_cuda:
        sources += build["sources"]["cuda"]
        compile_args["nvcc"] = list(build["flags"]["nvcc"])
    return {
        "sources": sources,  # relative to the repository root, as setuptools wants them
        "include_dirs": [os.path.join(ROOT, d) for d in build["include_dirs"]],
        "extra_compile_args": compile_args,
        "extra_link_args": list(build["flags"]["link"]),
    }


def extension():
    with_cuda = want_cuda()
    archs = cuda_arch_list(os.environ, visible_capabilities()) if with_cuda else ""
    if with_cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs  # torch's nvcc flags, and build_info(), name these
    macros = [
        ("DBLAST_TORCH_VERSION", f'"{torch.__version__}"'),
        ("DBLAST_CUDA_ARCHS", f'"{archs}"'),
    ]  # Py_LIMITED_API comes from torch's BuildExtension (py_limited_api=True)
    if with_cuda:
        macros.append(("DBLAST_WITH_CUDA", "1"))
    kind = CUDAExtension if with_cuda else CppExtension
    return kind("dblast_ext._C", define_macros=macros, py_limited_api=True, **extension_arguments(with_cuda))


if __name__ == "__main__":  # also under pip: setuptools runs this file as __main__; tests import it
    setup(
        packages=find_packages(include=["dblast_ext", "dblast_ext.*"]),
        ext_modules=[extension()],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )
