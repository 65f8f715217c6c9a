"""The target's sampling filter and the one draw rule every path shares: a token from the
filtered distribution by inverse CDF on a uniform (the verifier's rule for its final token,
the target-only baseline's and the training data's)."""
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import reference


# One rule per sampling setting, used by every entry point (SamplingParams, the CLI, dblast eval,
# the vLLM plugin's settings, the ops' wrappers and the C++ host checks, which repeat it for direct
# torch.ops calls), so that a typo in a filter is an error rather than a silently different
# distribution. `name` is how the caller spells the argument ("top_k", "--top-k", ...).


def check_temperature(value, name: str = "temperature") -> float:
    """A finite number >= 0 (0 = greedy)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0 (0 = greedy), got {value!r}")
    return float(value)


def check_top_k(value, name: str = "top_k") -> int:
    """An integer >= 0 (0 = off; k >= the vocabulary keeps every token)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0 = off), got {value!r}")
    return int(value)


def check_top_p(value, name: str = "top_p") -> float:
    """A number in (0, 1] (1 = off)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:  # NaN fails too
        raise ValueError(f"{name} must be a number in (0, 1] (1 = off), got {value!r}")
    return float(value)


@dataclass
class SamplingParams:
    """The target's filter: T (0 = greedy), top-k (0 = off), top-p (1 = off); each checked by
    the rule above when it is made."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        # checked here, not at the first kernel call: target-only sampling (the baseline, the
        # oracle, early determinism) never reaches a kernel
        self.temperature = check_temperature(self.temperature)
        self.top_k = check_top_k(self.top_k)
        self.top_p = check_top_p(self.top_p)

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
