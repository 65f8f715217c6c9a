"""The `device` parameter shared by the tests (python_tests/conftest.py) and the benchmarks
(bench/conftest.py). Where a GPU exists, whatever takes `device` runs on CUDA twice: with the
verified kernels ("cuda") and with the staged ones ("cuda-staged", docs/ops.md), so every CUDA
test and benchmark covers both and `-k staged` picks the staged kernels' runs
(bench/device_check.sh)."""
import pytest
import torch

import dblast_ext

DEVICES = ["cpu"] + (["cuda", "cuda-staged"] if torch.cuda.is_available() else [])
KERNELS = {"cuda": "verified", "cuda-staged": "staged"}


def parametrize_devices(metafunc) -> None:
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES, indirect=True)


@pytest.fixture
def device(request):
    """The torch device name of a `device`-parametrised test, its CUDA kernels set for it."""
    if request.param == "cpu":
        yield "cpu"
        return
    with dblast_ext.ops.using_cuda_kernels(KERNELS[request.param]):
        yield "cuda"
