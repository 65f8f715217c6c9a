import pytest
import torch

import dblast_ext  # noqa: F401  (loads the op library)

from kernel_devices import device, parametrize_devices  # noqa: F401  (the `device` fixture)


def pytest_generate_tests(metafunc):
    parametrize_devices(metafunc)  # cpu, and cuda / cuda-staged where a GPU exists


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(1234)
