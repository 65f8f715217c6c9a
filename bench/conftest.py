"""Latency benchmarks: every op next to its eager reference, same inputs, same run.

    pytest bench                                  # full timing run
    pytest bench --benchmark-json=out.json        # then: python bench/summarize.py out.json
pytest-benchmark prints each group (one op, one shape, one device) with the op and the
reference side by side; summarize.py turns the JSON into the ratio table of RESULTS.md.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python_tests"))

import dblast_ext  # noqa: E402,F401  (loads the op library)

# On a GPU each benchmark runs with the verified CUDA kernels ("cuda") and the staged ones
# ("cuda-staged", docs/ops.md), side by side in one run.
DEVICES = ["cpu"] + (["cuda", "cuda-staged"] if torch.cuda.is_available() else [])
KERNELS = {"cuda": "verified", "cuda-staged": "staged"}


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES, indirect=True)


@pytest.fixture
def device(request):
    """The torch device name of a `device`-parametrised benchmark, its CUDA kernels set for it."""
    if request.param == "cpu":
        yield "cpu"
        return
    with dblast_ext.ops.using_cuda_kernels(KERNELS[request.param]):
        yield "cuda"


@pytest.fixture
def timed(benchmark, device):
    """benchmark(fn, **kwargs) that waits for the GPU inside the timed region."""
    def run(fn, **kwargs):
        if device == "cuda":
            def synced():
                out = fn(**kwargs)
                torch.cuda.synchronize()
                return out
            return benchmark(synced)
        return benchmark(lambda: fn(**kwargs))
    return run


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["torch"] = torch.__version__
    machine_info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
