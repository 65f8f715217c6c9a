import os

import pytest
import torch

import dblast_ext  # noqa: F401  (loads the op library)

from kernel_devices import device, parametrize_devices  # noqa: F401  (the `device` fixture)


def pytest_generate_tests(metafunc):
    parametrize_devices(metafunc)  # cpu, and cuda / cuda-staged where a GPU exists


@pytest.fixture(scope="session", autouse=True)
def own_cost_cache(tmp_path_factory):
    """The adaptive controller's cost cache (DBLAST_COST_CACHE) in a folder of this test session,
    for commands the tests run in subprocesses too: tests neither read the costs an earlier run
    learned on this machine nor leave theirs in the user's cache, so every session starts as a
    fresh machine does. A test that compares two generations' tokens at T > 0 pins the depths
    (controller off, or a cost table): learned costs move with the timings."""
    before = os.environ.get("DBLAST_COST_CACHE")
    os.environ["DBLAST_COST_CACHE"] = str(tmp_path_factory.mktemp("costs"))
    yield
    if before is None:
        os.environ.pop("DBLAST_COST_CACHE", None)
    else:
        os.environ["DBLAST_COST_CACHE"] = before


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
