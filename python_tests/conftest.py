import pytest
import torch

import dblast_ext  # noqa: F401  (loads the op library)

from kernel_devices import device, parametrize_devices  # noqa: F401  (the `device` fixture)


def pytest_generate_tests(metafunc):
    parametrize_devices(metafunc)  # cpu, and cuda / cuda-staged where a GPU exists


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models: they gain nothing from more, and on a busy
    two-core machine the OpenMP barrier waits can make every matmul take milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
