"""The training loss's label log-probabilities, forward and backward, at SmolLM2's vocabulary
(V = 49,152) for one chunk of 256 rows, K = 1 and K = 4 branches, the label and the target's
top-32 per row (distillation): the fused gradient (`_PickedLogSoftmax`, "op") next to autograd's
gather + logsumexp, which it replaced ("reference"), as bench/summarize.py pairs them."""
import functools

import pytest
import torch

from dblast_ext.training.losses import _PickedLogSoftmax


def autograd_picked(logits, ids):
    return logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)


IMPLS = {"op": _PickedLogSoftmax.apply, "reference": autograd_picked}


@functools.lru_cache(maxsize=2)
def case(branches):
    g = torch.Generator().manual_seed(branches)
    logits = torch.randn(256, branches, 49152, generator=g) * 3
    ids = torch.randint(0, 49152, (256, branches, 33), generator=g)
    return logits, ids, torch.randn(256, branches, 33, generator=g)


@pytest.mark.parametrize("impl", ["op", "reference"])
@pytest.mark.parametrize("branches", [1, 4])
def test_label_logprobs_forward_backward(benchmark, device, branches, impl):
    if device != "cpu":
        pytest.skip("a CPU training-step measurement")
    benchmark.group = f"label log-probs fwd+bwd cpu rows=256 K={branches} J=33 V=49152 fp32"
    logits, ids, weights = case(branches)

    def step():
        x = logits.detach().requires_grad_()
        (IMPLS[impl](x, ids) * weights).sum().backward()
        return x.grad

    benchmark(step)
