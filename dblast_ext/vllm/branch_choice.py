"""Which of a DBLast drafter's K branches drafts each request's block inside vLLM.

vLLM verifies one chain of draft tokens per request, treating each draft as a point mass, so
the K-branch head must turn its K greedy chains into one. Any rule that does not look at the
target's distribution of the tokens being verified keeps the output exact; two are offered:

- category temperature 0 (the default): the branch the prior ranks first, what DBLast's own
  loop does at Z_T = 0;
- category temperature Z_T > 0: a branch drawn from softmax(l / Z_T) with a uniform that is a
  hash of (seed, the anchor's position, the anchor token). vLLM hands a draft model no request
  identity or generator, so the stream is keyed by what the model sees; a request's anchor
  position grows every cycle, so its draws never repeat, and the same request with the same
  seed draws the same branches on every run, at any batch composition.

Pure torch, no vLLM: the plugin's model calls these, and the tests check them directly.
"""
import os

import torch

# what `dblast serve` sets and the plugin's model reads in vLLM's processes
CATEGORY_TEMPERATURE_ENV = "DBLAST_CATEGORY_TEMPERATURE"
BRANCH_SEED_ENV = "DBLAST_BRANCH_SEED"
_MASK32 = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # below 2**27, so a 32-bit value times it fits an int64 without overflow


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An invertible 32-bit integer hash (xorshift-multiply rounds) on int64 values < 2**32."""
    x = (((x >> 16) ^ x) * _MULTIPLIER) & _MASK32
    x = (((x >> 16) ^ x) * _MULTIPLIER) & _MASK32
    return (x >> 16) ^ x


def anchor_uniforms(seed: int, positions: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """One float64 uniform in (0, 1) per row, a hash of (seed, position, anchor token)."""
    key = _mix32(torch.full_like(positions, seed & _MASK32, dtype=torch.int64))
    x = _mix32(key ^ (positions.to(torch.int64) & _MASK32))
    x = _mix32(x ^ (anchors.to(torch.int64) & _MASK32))
    return (x.to(torch.float64) + 0.5) / 2.0**32


def choose_branches(prior_logits: torch.Tensor, category_temperature: float,
                    uniforms: torch.Tensor) -> torch.Tensor:
    """Branch per row [N] (int64) from category logits [N, K]: the argmax (lowest index on ties)
    at temperature 0, else the inverse-CDF draw from softmax(logits / temperature)."""
    if category_temperature == 0:
        return prior_logits.argmax(dim=-1)
    probs = torch.softmax(prior_logits.to(torch.float64) / category_temperature, dim=-1)
    below = (probs.cumsum(dim=-1) < uniforms[:, None]).sum(dim=-1)
    return below.clamp_(max=prior_logits.shape[-1] - 1)


def chosen_branch_states(hidden: torch.Tensor, branch: torch.Tensor, expander_weight: torch.Tensor,
                         expander_bias: torch.Tensor) -> torch.Tensor:
    """DBLast Eq 13 for one branch per row: h + W_z h + b_z [N, H], with the K offsets computed
    together (one matmul) and the chosen one gathered."""
    rows, width = hidden.shape
    offsets = torch.nn.functional.linear(hidden, expander_weight, expander_bias).view(rows, -1, width)
    picked = offsets.gather(1, branch.view(rows, 1, 1).expand(rows, 1, width)).squeeze(1)
    return hidden + picked


def settings_from_env(environ=None) -> tuple:
    """(category temperature, seed) from DBLAST_CATEGORY_TEMPERATURE (default 0: the prior's
    argmax) and DBLAST_BRANCH_SEED (default 0), with errors naming the variable."""
    environ = os.environ if environ is None else environ
    raw = environ.get(CATEGORY_TEMPERATURE_ENV) or "0"
    try:
        temperature = float(raw)
    except ValueError:
        temperature = float("nan")
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"{CATEGORY_TEMPERATURE_ENV}={raw!r}: expected a finite number >= 0")
    raw = environ.get(BRANCH_SEED_ENV) or "0"
    try:
        seed = int(raw)
    except ValueError:
        raise ValueError(f"{BRANCH_SEED_ENV}={raw!r}: expected an integer") from None
    return temperature, seed
