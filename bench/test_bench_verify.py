"""branch_verify, mixture_verify and sample_tokens vs their references (DBLast's decode shape:
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


@functools.lru_cache(maxsize=2)
def sample_case(rows, device):
    g = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, 49152, generator=g) * 3).to(torch.bfloat16)
    children = torch.randint(-1, 49152, (rows, 4), generator=g)
    uniforms = torch.rand(rows, generator=g, dtype=torch.float64)
    return to_device(dict(logits=logits, uniforms=uniforms, query_tokens=children), device)


@pytest.mark.parametrize("impl", ["op", "reference"])
@pytest.mark.parametrize("rows", [61])
def test_sample_tokens(timed, benchmark, device, rows, impl):
    """Trie verification's per-cycle draw: every node of a K = 4, b = 15 trie (SmolLM2's V)."""
    benchmark.group = f"sample_tokens {device} R={rows} C=4 V=49152 bf16"
    case = sample_case(rows, device)
    benchmark.extra_info["bytes"] = tensor_bytes(case["logits"])
    timed(IMPLS[impl].sample_tokens, **case, **SETTINGS.kwargs())
