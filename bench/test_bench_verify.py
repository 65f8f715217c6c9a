"""branch_verify and mixture_verify vs their references (DBLast's decode shape:
b = 15, K = 4, V = 151936 (Qwen3), T = 1.0, top-k = 20, top-p = 0.95)."""
import functools

import pytest
import torch

from dblast_ext import ops, reference
from verify_cases import FilterSettings, make_branch_case, make_mixture_case, to_device

SETTINGS = FilterSettings(1.0, 20, 0.95)
IMPLS = {"op": ops, "reference": reference}


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes an op must read at least once (the HBM roofline numerator)."""
    return t.numel() * t.element_size()


@functools.lru_cache(maxsize=4)
def branch_case(rows, device):
    case = make_branch_case(rows, 4, 15, 151936, SETTINGS, torch.Generator().manual_seed(rows), torch.bfloat16)
    return to_device(case, device)


@functools.lru_cache(maxsize=2)
def mixture_case(rows, device):
    case = make_mixture_case(rows, 4, 15, 151936, SETTINGS, torch.Generator().manual_seed(rows), torch.bfloat16)
    return to_device(case, device)


@pytest.mark.parametrize("impl", ["op", "reference"])
@pytest.mark.parametrize("rows", [1, 32])
def test_branch_verify(timed, benchmark, device, rows, impl):
    benchmark.group = f"branch_verify {device} N={rows} b=15 K=4 V=151936 bf16"
    case = branch_case(rows, device)
    benchmark.extra_info["bytes"] = tensor_bytes(case["target_logits"])
    timed(IMPLS[impl].branch_verify, **case, **SETTINGS.kwargs())


@pytest.mark.parametrize("impl", ["op", "reference"])
@pytest.mark.parametrize("rows", [1, 8])
def test_mixture_verify(timed, benchmark, device, rows, impl):
    benchmark.group = f"mixture_verify {device} N={rows} b=15 K=4 V=151936 bf16"
    case = mixture_case(rows, device)
    benchmark.extra_info["bytes"] = tensor_bytes(case["target_logits"]) + tensor_bytes(case["draft_logits"])
    timed(IMPLS[impl].mixture_verify, **case, **SETTINGS.kwargs())
