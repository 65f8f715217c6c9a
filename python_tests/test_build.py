"""The build: build_info, the torch-version guard, and the CMake library."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import dblast_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every op the library registers (build_info is a plain query with no fake)
OPS = sorted(name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
             if name.startswith("dblast::") and name != "dblast::build_info")


def test_build_info_describes_the_build():
    info = dblast_ext.build_info()
    assert info["torch_version"] == torch.__version__
    assert isinstance(info["cuda_compiled"], bool)
    assert isinstance(info["cuda_archs"], str)
    assert info["cuda_compiled"] == bool(info["cuda_archs"])


def test_the_four_kernels_are_registered():
    assert OPS == ["branch_argmax", "branch_verify", "drafter_attention", "mixture_verify"]


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_cpu_and_fake_kernels(op):
    name = f"dblast::{op}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta")
    if dblast_ext.build_info()["cuda_compiled"]:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")


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


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_cmake_library_loads_and_matches_the_package(tmp_path):
    build = tmp_path / "build"
    # CPU kernels only: the CUDA build is checked by .ci/run and bench/device_check.sh
    configure = ["cmake", "-S", ROOT, "-B", str(build), f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                 f"-DPython3_EXECUTABLE={sys.executable}", "-DDBLAST_WITH_CUDA=OFF"]
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
