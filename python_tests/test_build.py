"""The build: build_info, the torch-version guard, one build description for setup.py and
CMake (csrc/build.json), and the CMake library."""
import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import dblast_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_JSON = os.path.join(ROOT, "csrc", "build.json")
# every op the library registers (build_info and cuda_kernels are plain queries with no fake)
OPS = sorted(name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
             if name.startswith("dblast::") and name not in ("dblast::build_info", "dblast::cuda_kernels"))


def test_build_info_describes_the_build():
    info = dblast_ext.build_info()
    assert info["torch_version"] == torch.__version__
    assert isinstance(info["cuda_compiled"], bool)
    assert isinstance(info["cuda_archs"], str)
    assert info["cuda_compiled"] == bool(info["cuda_archs"])


def test_the_six_ops_are_registered():
    assert OPS == ["branch_argmax", "branch_verify", "drafter_attention", "mixture_verify", "sample_tokens",
                   "sparse_verify"]


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_cpu_and_fake_kernels(op):
    name = f"dblast::{op}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta")
    if dblast_ext.build_info()["cuda_compiled"] and op not in dblast_ext.ops.CPU_ONLY_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_the_library_uses_the_processs_libstdcxx():
    """No part of libstdc++ is linked into the op library: toolchains whose libstdc++ is newer
    than the system's (a devtoolset-style gcc) link its newer pieces statically, and an error
    message that formats a number then runs another copy of the stream and locale code than
    torch's and crashes the process (seen on a lent GPU machine, bench/device_runs/2026-12-04-run1)."""
    from dblast_ext import _C
    symbols = subprocess.run(["nm", "-C", "--defined-only", _C.__file__], capture_output=True, text=True,
                             check=True).stdout
    # libstdc++ instantiates these in its shared library alone (extern templates): a definition
    # here means a static copy of the library's stream and locale code
    linked = [line for line in symbols.splitlines() if re.search(r"std::codecvt<|::_M_insert<|std::locale::", line)]
    assert not linked, f"{len(linked)} libstdc++ symbols defined in {os.path.basename(_C.__file__)}, e.g. " \
                       f"{linked[:3]}; build with the system compiler (CC/CXX)"


def test_import_against_another_torch_says_how_to_rebuild():
    script = textwrap.dedent("""
        import torch
        torch.__version__ = "0.0.0-other"
        try:
            import dblast_ext
        except ImportError as exc:
            print(exc)
        else:
            print("imported")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd="/", check=True).stdout
    assert "built against torch" in out and "pip install --no-build-isolation" in out


def build_description():
    with open(BUILD_JSON) as f:
        return json.load(f)


def all_flags(build):
    return [flag for flags in build["flags"].values() for flag in flags]


def load_setup_py():
    """setup.py as a module: its setup() call only runs as __main__."""
    spec = importlib.util.spec_from_file_location("dblast_setup_py", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_build_json_lists_every_source_once():
    build = build_description()
    listed = [path for group in build["sources"].values() for path in group]
    assert len(listed) == len(set(listed)), "a source is listed twice"
    on_disk = sorted(
        os.path.relpath(os.path.join(folder, name), ROOT).replace(os.sep, "/")
        for folder, _, names in os.walk(os.path.join(ROOT, "csrc"))
        for name in names if name.endswith((".cpp", ".cu"))
    )
    assert sorted(listed) == on_disk, "csrc/build.json's sources differ from csrc/**/*.cpp|*.cu: list new files there"
    assert all(path.endswith(".cu") for path in build["sources"]["cuda"])
    assert not any(path.endswith(".cu") for path in build["sources"]["library"] + build["sources"]["python"])
    for path in build["include_dirs"]:
        assert os.path.isdir(os.path.join(ROOT, path)), path
    # sources.python is exactly the Python module's entry point, which the CMake library leaves out
    def text(path):
        with open(os.path.join(ROOT, path)) as f:
            return f.read()
    with_pyinit = [path for path in listed if "PyInit_" in text(path)]
    assert with_pyinit == build["sources"]["python"]


def test_setup_py_takes_sources_and_flags_from_build_json(monkeypatch):
    monkeypatch.delenv("FORCE_CUDA", raising=False)  # extension() below builds what this machine would
    build = build_description()
    setup_py = load_setup_py()
    cpu = setup_py.extension_arguments(with_cuda=False)
    assert cpu["sources"] == build["sources"]["library"] + build["sources"]["python"]
    assert cpu["extra_compile_args"] == {"cxx": build["flags"]["cxx"]}
    assert cpu["extra_link_args"] == build["flags"]["link"]
    assert cpu["include_dirs"] == [os.path.join(ROOT, d) for d in build["include_dirs"]]
    cuda = setup_py.extension_arguments(with_cuda=True)
    assert cuda["sources"] == cpu["sources"] + build["sources"]["cuda"]
    assert cuda["extra_compile_args"] == {"cxx": build["flags"]["cxx"], "nvcc": build["flags"]["nvcc"]}
    # the Extension setup() gets is made from them (here: whichever kind this machine builds)
    ext = setup_py.extension()
    expected = setup_py.extension_arguments(with_cuda=dict(ext.define_macros).get("DBLAST_WITH_CUDA") == "1")
    assert ext.sources == expected["sources"]
    assert ext.extra_link_args == expected["extra_link_args"]
    for flag in expected["extra_compile_args"]["cxx"]:
        assert flag in ext.extra_compile_args["cxx"]
    # and setup.py spells out no source or flag of its own
    with open(os.path.join(ROOT, "setup.py")) as f:
        literals = {node.value for node in ast.walk(ast.parse(f.read()))
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not literals & set(all_flags(build))
    assert not [s for s in literals if re.search(r"\.(cpp|cu)\b", s)]


def test_cmake_takes_sources_and_flags_from_build_json():
    build = build_description()
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        code = re.sub(r"#.*", "", f.read())  # without its comments
    assert "csrc/build.json" in code and "string(JSON" in code
    assert "GLOB" not in code and not re.search(r"\.(cpp|cu)\b", code), "CMakeLists.txt names sources itself"
    assert not [flag for flag in all_flags(build) if flag in code], "CMakeLists.txt spells out flags itself"
    assert "CMAKE_CXX_STANDARD" not in code and "CMAKE_CUDA_STANDARD" not in code, "the -std flag is build.json's"
    for global_flags in ("add_compile_options", "add_link_options", "CMAKE_CXX_FLAGS", "CMAKE_CUDA_FLAGS"):
        assert global_flags not in code, f"CMakeLists.txt sets {global_flags}: flags belong in csrc/build.json"
    options = re.findall(r"target_(?:compile|link)_options\(([^)]*)\)", code)
    assert options, "CMakeLists.txt passes build.json's flags to no target"
    for args in options:  # only build.json's lists (in generator expressions), no flag of its own
        assert not re.search(r"(^|[\s\"])-", re.sub(r"\$\{DBLAST_\w+_FLAGS\}", "", args)), args
    if shutil.which("cmake") is None:
        pytest.skip("cmake not installed: what CMakeLists.txt reads from csrc/build.json is unchecked")
    # `cmake -P CMakeLists.txt` prints the lists it read (milliseconds: nothing is configured)
    out = subprocess.run(["cmake", "-P", os.path.join(ROOT, "CMakeLists.txt")], capture_output=True, text=True,
                         check=True, cwd="/").stdout
    read = dict(re.findall(r"^-- DBLAST_(\w+)=(.*)$", out, flags=re.M))

    def absolute(paths):
        return ";".join(os.path.join(ROOT, p) for p in paths)
    assert read == {
        "SOURCES": absolute(build["sources"]["library"]),  # without sources.python
        "CUDA_SOURCE_LIST": absolute(build["sources"]["cuda"]),
        "INCLUDE_DIRS": absolute(build["include_dirs"]),
        "CXX_FLAGS": ";".join(build["flags"]["cxx"]),
        "NVCC_FLAGS": ";".join(build["flags"]["nvcc"]),
        "LINK_FLAGS": ";".join(build["flags"]["link"]),
        # 8.6 -> 86-real (machine code), 12.0+PTX -> 120 (machine code and PTX)
        "DEFAULT_ARCHS": ";".join(a.replace(".", "").replace("+PTX", "") + ("" if a.endswith("+PTX") else "-real")
                                  for a in build["cuda_archs"]),
    }


@pytest.mark.slow  # compiles the whole op library again (minutes)
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_cmake_library_loads_and_matches_the_package(tmp_path):
    build = tmp_path / "build"
    # CPU kernels only: the CUDA build is checked by .ci/run and bench/device_check.sh
    configure = ["cmake", "-S", ROOT, "-B", str(build), f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                 f"-DPython3_EXECUTABLE={sys.executable}", "-DDBLAST_WITH_CUDA=OFF",
                 "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"]
    env = dict(os.environ)
    if torch.version.cuda is not None:  # torch's own CMake config then needs the toolkit, even for CPU code
        from torch.utils.cpp_extension import CUDA_HOME
        if CUDA_HOME:
            configure.append(f"-DCUDA_TOOLKIT_ROOT_DIR={CUDA_HOME}")
        env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # no GPU probing at configure time
    proc = subprocess.run(configure, capture_output=True, text=True, env=env)
    if proc.returncode != 0 and torch.version.cuda is not None:
        pytest.skip("torch's CMake config (a CUDA build) could not use this machine's CUDA toolkit: "
                    + " ".join((proc.stdout + proc.stderr).split()[-40:]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the compile commands: csrc/build.json's library sources, each with its C++ flags in order
    # and no other language standard
    build_json = build_description()
    with open(build / "compile_commands.json") as f:
        commands = {os.path.realpath(c["file"]): c["command"].split() for c in json.load(f)}
    assert sorted(commands) == sorted(os.path.realpath(os.path.join(ROOT, p)) for p in build_json["sources"]["library"])
    cxx = build_json["flags"]["cxx"]
    for command in commands.values():
        at = [i for i in range(len(command) - len(cxx) + 1) if command[i:i + len(cxx)] == cxx]
        assert at, (cxx, command)
        assert [a for a in command if a.startswith("-std=")] == [f for f in cxx if f.startswith("-std=")]
    subprocess.run(["cmake", "--build", str(build), "-j", os.environ.get("MAX_JOBS", "2")], check=True,
                   capture_output=True)
    library = build / "libdblast_ops.so"
    assert library.exists()

    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(4, 6, 50, generator=g), torch.randint(0, 50, (4, 3, 5), generator=g),
              torch.full((4, 3), 1 / 3), torch.tensor([0, 1, 2, 0]), torch.rand(4, 6, generator=g))
    torch.save(inputs, tmp_path / "inputs.pt")
    # A fresh interpreter: the library registers the same ops as dblast_ext._C.
    script = textwrap.dedent(f"""
        import torch
        torch.ops.load_library({str(library)!r})
        inputs = torch.load({str(tmp_path / 'inputs.pt')!r})
        torch.save(torch.ops.dblast.branch_verify(*inputs, 0.8, 0, 0.95, True), {str(tmp_path / 'out.pt')!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path)
    loaded = torch.load(tmp_path / "out.pt")
    expected = dblast_ext.ops.branch_verify(*inputs, temperature=0.8, top_p=0.95)
    for a, b in zip(loaded, expected):
        assert torch.equal(a, b)


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only torch")
def test_force_cuda_with_cpu_torch_fails_clearly():
    env = dict(os.environ, FORCE_CUDA="1")
    proc = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "CPU-only build" in proc.stdout + proc.stderr


def test_the_cuda_kernel_switch_sets_restores_and_names_a_bad_value():
    from dblast_ext import ops
    assert ops.cuda_kernels() == "verified"
    with ops.using_cuda_kernels("staged"):
        assert ops.cuda_kernels() == "staged"
    assert ops.cuda_kernels() == "verified"
    with pytest.raises(ValueError, match="variant must be one of .*'fast'"):
        ops.cuda_kernels("fast")
    with pytest.raises(ValueError, match='variant must be "verified" or "staged", got "fast"'):
        torch.ops.dblast.cuda_kernels("fast")  # the C++ check, for direct torch.ops calls
    assert ops.cuda_kernels() == "verified"


@pytest.mark.parametrize("value, expected", [("staged", "staged"), ("", "verified"), ("bogus", None)])
def test_the_cuda_kernel_switch_starts_from_the_environment(tmp_path, value, expected):
    code = "import dblast_ext; print(dblast_ext.ops.cuda_kernels())"
    # from another folder: the installed dblast_ext, not the source tree's (CI installs a wheel)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "DBLAST_CUDA_KERNELS": value})
    if expected is None:
        assert run.returncode != 0
        assert 'DBLAST_CUDA_KERNELS must be "verified" or "staged", got "bogus"' in run.stderr
    else:
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == expected
