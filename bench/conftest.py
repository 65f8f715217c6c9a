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

from kernel_devices import device, parametrize_devices  # noqa: E402,F401  (the `device` fixture)


def pytest_generate_tests(metafunc):
    parametrize_devices(metafunc)  # cpu, and cuda / cuda-staged where a GPU exists: side by side


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
