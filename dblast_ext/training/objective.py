"""One training batch to one loss: anchors, the target's context features, the drafter's
many-block pass, the label log-probs of every branch, and the selected objective."""
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from ..target import TargetAdapter, last_position_logits_arguments
from ..drafter import DBlastDrafter
from .block_forward import block_inputs, drafter_block_hidden
from .losses import accepted_length_proxy, accepted_length_surrogate, gather_branch_logprobs, nll_independent, \
    nll_mixture


@dataclass
class Batch:
    input_ids: torch.Tensor        # [N, T] (right-padded with 0)
    loss_mask: torch.Tensor        # [N, T] 1 at response tokens
    target_logprobs: torch.Tensor  # [N, T] log p(x_t | x_<t) under the data's sampling filter, 0 elsewhere
    attention_mask: torch.Tensor   # [N, T] 1 at real tokens


def collate(records: Sequence[dict], device) -> Batch:
    longest = max(len(r["input_ids"]) for r in records)

    def pad(key, dtype, fill=0):
        return torch.tensor([list(r[key]) + [fill] * (longest - len(r[key])) for r in records], dtype=dtype,
                            device=device)

    attention = torch.tensor([[1] * len(r["input_ids"]) + [0] * (longest - len(r["input_ids"])) for r in records],
                             device=device)
    return Batch(pad("input_ids", torch.long), pad("loss_mask", torch.long), pad("target_logprobs", torch.float32),
                 attention)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator):
    """Up to `num_anchors` block starts per sequence among response positions a with a
    response token after them, without replacement; (anchors [N, M], valid [N, M])."""
    rows, length = loss_mask.shape
    mask = loss_mask.cpu().bool()
    eligible = mask[:, :-1] & mask[:, 1:]
    anchors = torch.zeros(rows, num_anchors, dtype=torch.long)
    valid = torch.zeros(rows, num_anchors, dtype=torch.bool)
    for n in range(rows):
        candidates = eligible[n].nonzero().view(-1)
        if len(candidates) == 0:
            continue
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:num_anchors]]
        anchors[n, : len(chosen)] = chosen.sort().values
        valid[n, : len(chosen)] = True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def block_labels(batch: Batch, anchors: torch.Tensor, valid: torch.Tensor, block_size: int):
    """Labels, their target log-probs and the loss mask of every draft position: [N, M, b]
    (position k of the block at a predicts x_{a+k})."""
    offsets = torch.arange(1, block_size, device=anchors.device)
    index = anchors[:, :, None] + offsets                              # [N, M, b]
    inside = index < batch.input_ids.shape[1]
    index = index.clamp(max=batch.input_ids.shape[1] - 1)
    take = lambda t: t.gather(1, index.view(index.shape[0], -1)).view(index.shape)  # noqa: E731
    mask = take(batch.loss_mask).bool() & inside & valid[:, :, None]
    return take(batch.input_ids), take(batch.target_logprobs), mask


@torch.no_grad()
def target_features(target: TargetAdapter, batch: Batch) -> torch.Tensor:
    """Context features [N, T, L*H] of every position (one inference-mode forward)."""
    out = target.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True,
                       **last_position_logits_arguments(target.model))
    return target.features(out.hidden_states)


def batch_loss(drafter: DBlastDrafter, target: TargetAdapter, batch: Batch, *, objective: str, num_anchors: int,
               generator: torch.Generator, tau: float = 0.1, al_variant: str = "all_prefixes",
               position_weights: Optional[torch.Tensor] = None, chunk_size: int = 1024,
               features: Optional[torch.Tensor] = None, recompute_logits: bool = True) -> Dict[str, torch.Tensor]:
    """{"loss", "accepted_proxy", "blocks"} of one batch. `features` (the target's context
    features) may be passed in when computed already."""
    if features is None:
        features = target_features(target, batch)
    anchors, valid = sample_anchors(batch.loss_mask, num_anchors, generator)
    inputs = block_inputs(drafter, target.embed, batch.input_ids, anchors)
    hidden = drafter_block_hidden(drafter, inputs["embeddings"], inputs["positions"], features, anchors)
    rows, blocks, block = anchors.shape[0], anchors.shape[1], drafter.config.block_size
    hidden = hidden.view(rows, blocks, block, -1)
    labels, target_lp, mask = block_labels(batch, anchors, valid, block)
    expander = ((drafter.branch_expander.weight, drafter.branch_expander.bias) if drafter.num_branches > 1
                else (None, None))
    logprobs = gather_branch_logprobs(hidden[:, :, 1:], target.lm_head_weight.detach(), labels, *expander,
                                      chunk_size=chunk_size, vocab_size=target.vocab_size,
                                      recompute=recompute_logits)   # [N, M, b, K]
    branch_lp = logprobs.transpose(-1, -2)                                                   # [N, M, K, b]
    if drafter.num_branches > 1:
        prior_logits = drafter.prior_head(hidden[:, :, 0]).float()
    else:
        prior_logits = torch.zeros(rows, blocks, 1, device=hidden.device)
    # blocks without a valid anchor carry no loss; average over real blocks only
    keep = valid
    if not bool(keep.any()):  # no response long enough for a block in this batch: a zero loss, still a graph
        zero = hidden.sum() * 0.0
        return {"loss": zero, "accepted_proxy": torch.tensor(0.0), "blocks": torch.tensor(0)}
    branch_lp, prior_logits, target_lp, mask = branch_lp[keep], prior_logits[keep], target_lp[keep], mask[keep]
    if objective == "nll":
        loss = (nll_independent(branch_lp[:, 0], mask, position_weights) if drafter.num_branches == 1
                else nll_mixture(prior_logits, branch_lp, mask, position_weights))
    elif objective == "al":
        loss = accepted_length_surrogate(prior_logits, branch_lp, target_lp, mask, tau=tau, variant=al_variant,
                                         position_weights=position_weights)
    else:
        raise ValueError(f"objective must be 'nll' or 'al', got {objective!r}")
    proxy = accepted_length_proxy(prior_logits, branch_lp, target_lp, mask)
    return {"loss": loss, "accepted_proxy": proxy, "blocks": torch.tensor(int(keep.sum()))}
