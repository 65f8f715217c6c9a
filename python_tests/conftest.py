import pytest
import torch

import dblast_ext  # noqa: F401  (loads the op library)

# Where a GPU exists, a test that takes `device` runs on CUDA twice: with the verified kernels
# ("cuda") and with the staged ones ("cuda-staged", docs/ops.md), so every CUDA test covers both
# and `-k staged` picks the staged kernels' runs (bench/device_check.sh).
DEVICES = ["cpu"] + (["cuda", "cuda-staged"] if torch.cuda.is_available() else [])
KERNELS = {"cuda": "verified", "cuda-staged": "staged"}


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES, indirect=True)


@pytest.fixture
def device(request):
    """The torch device name of a `device`-parametrised test, its CUDA kernels set for the test."""
    if request.param == "cpu":
        yield "cpu"
        return
    with dblast_ext.ops.using_cuda_kernels(KERNELS[request.param]):
        yield "cuda"


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(1234)
