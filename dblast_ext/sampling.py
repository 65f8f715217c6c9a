"""The target's sampling filter and the one draw rule every path shares: a token from the
filtered distribution by inverse CDF on a uniform (the verifier's rule for its final token,
the target-only baseline's and the training data's)."""
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import reference


@dataclass
class SamplingParams:
    """The target's filter: T (0 = greedy), top-k (<= 0 off), top-p (>= 1 off)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        # checked here, not at the first kernel call: target-only sampling (the baseline, the
        # oracle, early determinism) never reaches a kernel, and NaN passes every comparison
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (math.isfinite(self.top_p) and self.top_p > 0):
            raise ValueError(f"top_p must be a finite number > 0 (>= 1: off), got {self.top_p}")

    def kwargs(self) -> dict:
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


def sample_from_logits(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator,
                       on_probs: Optional[Callable[[torch.Tensor, int], None]] = None) -> int:
    """One token from the filtered target distribution of a [V] logit row (inverse CDF on a
    uniform from `generator`); `on_probs(probs, token)` sees the float64 distribution the
    token was drawn from."""
    probs = reference.filter_target_probs(logits.float().cpu(), **sampling.kwargs())
    u = torch.rand(1, generator=generator, dtype=torch.float64)
    token = int(reference.inverse_cdf_sample(probs[None], u)[0])
    if on_probs:
        on_probs(probs, token)
    return token
