"""Result types returned by the ops (and by their references)."""
from typing import NamedTuple, Optional

import torch


class VerifyResult(NamedTuple):
    """Outcome of one verification step for N rows.

    num_accepted: int32 [N], accepted drafts n in 0..b.
    output_tokens: int64 [N, b+1], the n accepted drafts, then the correction or bonus
        token, then -1 padding.
    accept_probs: float32 [N, b], acceptance probability A_i of every drafted position,
        computed on the drafted prefix (also past a rejection), so that the expected
        accepted length sum_i prod_{j<=i} A_j is available per cycle.
    """

    num_accepted: torch.Tensor
    output_tokens: torch.Tensor
    accept_probs: torch.Tensor


class BranchArgmax(NamedTuple):
    """Greedy token of every (row, branch) through the LM head, all [N, K].

    tokens: int64, argmax_v (E h_z)_v, lowest token id on ties.
    max_logits: float32, that logit.
    logsumexp: float32, log sum_v exp((E h_z)_v), so q_i(token | z) = exp(max_logits - logsumexp).
    """

    tokens: torch.Tensor
    max_logits: torch.Tensor
    logsumexp: torch.Tensor


class SampledTokens(NamedTuple):
    """Tokens drawn from the target's filtered distribution, one per row of logits [R, V].

    tokens: int64 [R], drawn by inverse CDF on the row's uniform (the argmax at T = 0).
    query_probs: float32 [R, C], the filtered probability of each of the row's query tokens
        (0 for a -1 entry).
    """

    tokens: torch.Tensor
    query_probs: torch.Tensor


def draw_uniforms(target_logits: torch.Tensor, uniforms: Optional[torch.Tensor],
                  generator: Optional[torch.Generator]) -> torch.Tensor:
    """The caller's uniforms, or fresh ones [N, b+1] on the logits' device."""
    if uniforms is not None:
        return uniforms
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [N, b+1, V], got shape {tuple(target_logits.shape)}")
    rows, positions = target_logits.shape[:2]
    return torch.rand(rows, positions, device=target_logits.device, dtype=torch.float64, generator=generator)
