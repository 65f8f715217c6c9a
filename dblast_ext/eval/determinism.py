"""Target-block early determinism (DBLast Appendix C, Eq 22-24) and accepted length binned
by it (DBLast Figure 1).

D_b(y) = E_{x ~ p(.|y)} [ (1/b) sum_j prod_{i<=j} p(x_i | y, x_<i) ] averages the collision
probabilities of the first 1..b target-prefix distributions: near 1 when the continuation is
nearly forced, near 0 when many continuations are plausible. It is estimated from M blocks
sampled from the target's filtered distribution (Eq 24)."""
from typing import Dict, List, Sequence

import numpy as np
import torch

from .. import reference
from ..decoding import SamplingParams, TargetAdapter

BIN_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@torch.inference_mode()
def early_determinism(target: TargetAdapter, prefix_ids: Sequence[int], sampling: SamplingParams,
                      num_draft: int, samples: int, generator: torch.Generator) -> float:
    """Eq 24: (1 / (M b)) sum_m sum_j prod_{i<=j} p(x_i^(m) | y, x_<i^(m)), the M blocks of
    b tokens sampled from the filtered target, all M continued together in one batch."""
    if num_draft < 1 or samples < 1:
        raise ValueError(f"num_draft and samples must be >= 1, got {num_draft} and {samples}")
    device = target.device
    ids = torch.tensor([list(prefix_ids)] * samples, device=device)
    cache = target.new_cache()
    logits, _ = target.forward(ids, cache, hidden_states=False, last_logits_only=True)
    running = torch.ones(samples, dtype=torch.float64)
    total = torch.zeros(samples, dtype=torch.float64)
    for _ in range(num_draft):
        probs = reference.filter_target_probs(logits[:, -1].float().cpu(), **sampling.kwargs()).double()
        tokens = torch.multinomial(probs, 1, generator=generator)
        running = running * probs.gather(1, tokens).view(-1)
        total += running
        logits, _ = target.forward(tokens.to(device), cache, hidden_states=False)
    return float(total.sum() / (samples * num_draft))


def bin_by_determinism(determinism: Sequence[float], values: Sequence[float],
                       edges: Sequence[float] = BIN_EDGES) -> List[Dict]:
    """Per bin (lo, hi] (the first also holds 0): count, mean value and its standard error."""
    d, v = np.asarray(determinism, dtype=float), np.asarray(values, dtype=float)
    rows = []
    for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        inside = (d > lo) & (d <= hi) if k else (d >= lo) & (d <= hi)
        n = int(inside.sum())
        mean = float(v[inside].mean()) if n else None
        sem = float(v[inside].std(ddof=1) / np.sqrt(n)) if n > 1 else None
        rows.append({"bin": [lo, hi], "count": n, "mean": mean, "sem": sem})
    return rows
