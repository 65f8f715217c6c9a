"""The training loss of DFlash2's candidate selector (dblast_ext.drafting.dflash2).

At every draft position the selector chooses among the top-k tokens of the draft logits, scored
by unary logit + < A[previous] * (P h), B[candidate] >. It is trained teacher-forced: the
previous token is the data's (the anchor at the first position), the candidates are the top-k of
the drafter's logits with the data's token put in the last slot when it is not among them (so
every position has a right answer), and the loss is the cross-entropy of the k-way softmax of the
scores against that token. The unary logits are constants here: the LM-head's own loss trains
the backbone that makes them.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..drafting.dflash2 import CandidateSelector
from .losses import auto_chunk_rows

__all__ = ["selector_candidates", "selector_scores", "selector_loss"]


@torch.no_grad()
def selector_candidates(hidden: torch.Tensor, lm_head_weight: torch.Tensor, vocab_size: int, top_k: int,
                        labels: torch.Tensor, chunk_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [R, H] (normed draft positions), labels [R]: the candidates [R, k] (top-k of the
    logits, likeliest first, the label in the last slot where it is missing), their logits [R, k]
    and the label's slot [R]."""
    weight = lm_head_weight[:vocab_size]
    k = min(top_k, vocab_size)
    chunk_size = chunk_size or auto_chunk_rows(hidden.device, 1, vocab_size)
    unary, candidates = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        logits = hidden[start:start + chunk_size].to(weight.dtype) @ weight.T
        values, ids = logits.float().topk(k, dim=-1)
        missing = ~(ids == labels[start:start + chunk_size, None]).any(-1)
        gold = labels[start:start + chunk_size]
        ids[missing, -1] = gold[missing]
        values[missing, -1] = logits.float().gather(1, gold[:, None])[missing, 0]
        unary.append(values)
        candidates.append(ids)
    candidates, unary = torch.cat(candidates), torch.cat(unary)
    slot = (candidates == labels[:, None]).int().argmax(-1)
    return candidates, unary, slot


def selector_scores(selector: CandidateSelector, hidden: torch.Tensor, previous: torch.Tensor,
                    candidates: torch.Tensor, unary: torch.Tensor) -> torch.Tensor:
    """The selector's scores [R, k] of candidates [R, k] after the tokens `previous` [R], at
    states hidden [R, H] (differentiable in the selector's parameters and in hidden)."""
    projected = selector.hidden_projection(hidden.to(selector.hidden_projection.weight.dtype)).float()  # [R, r]
    query = selector.predecessor_codebook[previous].float() * projected                             # [R, r]
    pair = (selector.successor_codebook[candidates].float() @ query[:, :, None])[..., 0]            # [R, k]
    return unary + pair


def selector_loss(selector: CandidateSelector, hidden: torch.Tensor, previous: torch.Tensor, labels: torch.Tensor,
                  mask: torch.Tensor, lm_head_weight: torch.Tensor, vocab_size: int,
                  position_weights: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None) -> torch.Tensor:
    """The weighted mean cross-entropy of the selector over the masked draft positions: hidden
    [B, b, H], previous / labels / mask [B, b], position_weights [b] (None: uniform)."""
    rows, num_draft = labels.shape
    flat_hidden = hidden.reshape(rows * num_draft, -1)
    candidates, unary, slot = selector_candidates(flat_hidden.detach(), lm_head_weight, vocab_size,
                                                  selector.top_k, labels.reshape(-1), chunk_size)
    scores = selector_scores(selector, flat_hidden, previous.reshape(-1), candidates, unary)
    per_position = F.cross_entropy(scores, slot.long(), reduction="none").view(rows, num_draft)
    weights = mask.float()
    if position_weights is not None:
        weights = weights * position_weights.to(weights.device)[None, :]
    return (per_position * weights).sum() / weights.sum().clamp(min=1e-9)
