import pytest
import torch

import dblast_ext  # noqa: F401  (loads the op library)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc):
    # Every test that takes `device` runs on the CPU and, where a GPU exists, on CUDA.
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(1234)
