"""branch_argmax vs the eager reference (expander matmul, LM-head matmul, argmax, logsumexp)
at real LM-head shapes, N = 15 drafted positions; time and peak extra host memory."""
import functools

import pytest
import torch

from dblast_ext import ops, reference
from peak_memory import peak_extra_bytes

SHAPES = {"SmolLM2-135M": (576, 49152), "Qwen3-4B": (2560, 151936), "Qwen3-8B": (4096, 151936)}
IMPLS = {"op": ops, "reference": reference}
ROWS = 15


@functools.lru_cache(maxsize=1)
def weights(model, device):
    width, vocab = SHAPES[model]
    g = torch.Generator().manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # each device's serving dtype
    head = (torch.randn(vocab, width, generator=g) * width**-0.5).to(device, dtype)
    expander = (torch.randn(8 * width, width, generator=g) * 0.1 * width**-0.5).to(device, dtype)
    bias = torch.zeros(8 * width, dtype=dtype, device=device)
    hidden = torch.randn(ROWS, width, generator=g).to(device, dtype)
    return hidden, head, expander, bias


@pytest.mark.parametrize("impl", ["op", "reference"])
@pytest.mark.parametrize("branches", [1, 4, 8])
@pytest.mark.parametrize("model", list(SHAPES))
def test_branch_argmax(timed, benchmark, device, model, branches, impl):
    width, vocab = SHAPES[model]
    hidden, head, expander, bias = weights(model, device)
    kwargs = dict(hidden=hidden, lm_head_weight=head)
    if branches > 1:
        kwargs.update(expander_weight=expander[: branches * width], expander_bias=bias[: branches * width])
    benchmark.group = f"branch_argmax {device} {model} K={branches} N={ROWS} {str(hidden.dtype)[6:]}"
    weight_bytes = head.numel() * head.element_size()
    if branches > 1:
        weight_bytes += branches * width * width * expander.element_size()
    benchmark.extra_info["bytes"] = weight_bytes  # the HBM roofline numerator: weights read once
    benchmark.extra_info["full_logits_bytes"] = ROWS * branches * vocab * 4
    fn = IMPLS[impl].branch_argmax
    if device == "cpu":
        benchmark.extra_info["peak_extra_bytes"] = peak_extra_bytes(lambda: fn(**kwargs))
    timed(fn, **kwargs)
