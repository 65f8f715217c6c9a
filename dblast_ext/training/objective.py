"""One training batch to one loss: anchors, the target's context features (and, for
distillation, its top-k next-token log-probabilities), the drafter's many-block pass, the
label log-probs of every branch, and the selected objective."""
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from ..target.adapter import TargetAdapter
from ..drafting.drafter import DBlastDrafter
from .block_forward import block_inputs, drafter_block_hidden
from .feature_cache import TOP_K, target_pass
from .selector_loss import selector_loss
from .losses import accepted_length_per_block, accepted_length_surrogate, distillation_loss, gather_branch_logprobs, \
    nll_independent, nll_mixture, valid_positions


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


def at_draft_positions(t: torch.Tensor, anchors: torch.Tensor, block_size: int, shift: int) -> torch.Tensor:
    """t [N, T, ...] at positions a + shift .. a + shift + b - 1 of every block anchored at a
    (anchors [N, M]): [N, M, b, ...], positions past the end clamped to the last one."""
    index = anchors[:, :, None] + torch.arange(shift, shift + block_size - 1, device=anchors.device)   # [N, M, b]
    flat = index.clamp(max=t.shape[1] - 1).view(index.shape[0], -1)
    rest = t.shape[2:]
    picked = t.gather(1, flat.view(*flat.shape, *[1] * len(rest)).expand(*flat.shape, *rest))
    return picked.view(*index.shape, *rest)


def block_labels(batch: Batch, anchors: torch.Tensor, valid: torch.Tensor, block_size: int):
    """Labels, their target log-probs and the loss mask of every draft position: [N, M, b]
    (position k of the block at a predicts x_{a+k})."""
    inside = anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device) < batch.input_ids.shape[1]
    take = lambda t: at_draft_positions(t, anchors, block_size, shift=1)  # noqa: E731
    mask = take(batch.loss_mask).bool() & inside & valid[:, :, None]
    return take(batch.input_ids), take(batch.target_logprobs), mask


def block_teacher(teacher: Tuple[torch.Tensor, torch.Tensor], anchors: torch.Tensor, block_size: int):
    """The target's top-k (ids, log-probs) [N, M, b, k] for every draft position: position k
    of the block at a predicts x_{a+k}, the distribution the target gave at a+k-1."""
    ids, logprobs = teacher
    return (at_draft_positions(ids, anchors, block_size, shift=0),
            at_draft_positions(logprobs, anchors, block_size, shift=0))


def top1_agreement_counts(draft_tokens: torch.Tensor, target_top1: torch.Tensor, mask: torch.Tensor):
    """Per block position: how often the drafted token is the target's most likely one, over
    the masked positions. draft_tokens, target_top1, mask [..., b] -> (hits [b], positions [b])."""
    hits = ((draft_tokens == target_top1) & mask).reshape(-1, mask.shape[-1]).sum(0)
    return hits, mask.reshape(-1, mask.shape[-1]).sum(0)


def greedy_chain_accepted(draft_tokens: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per block, how many leading draft tokens equal the data's own continuation: [..., b] -> [...]
    (`valid`: the block's leading valid positions). The decode loop drafts a block's greedy chain
    and the target's sampling accepts a fixed draft token x with probability p(x). Where the data
    were sampled from the target itself at the user's settings, y_l ~ p(. | y_<l), so the event
    d_1..d_l = y_1..y_l has probability prod_{j<=l} p(d_j | d_<j): the run length is unbiased for
    the chain's expected accepted length at those settings (the bonus token aside)."""
    match = (draft_tokens == labels) & valid.bool()
    return torch.cumprod(match.to(torch.int64), dim=-1).sum(-1).to(torch.float32)


def greedy_drafts(drafter: DBlastDrafter, target: TargetAdapter, hidden: torch.Tensor,
                  prior_logits: torch.Tensor) -> torch.Tensor:
    """The tokens the drafter would draft at Z_T = 0 (its likeliest branch, each position's
    argmax; `ops.branch_argmax` as in decoding): hidden [..., b, H] (normed, the draft
    positions), prior_logits [..., K] -> [..., b]."""
    from .. import ops

    weight = target.lm_head_weight.detach()
    expander = ((drafter.branch_expander.weight.detach().to(weight.dtype),
                 drafter.branch_expander.bias.detach().to(weight.dtype)) if drafter.num_branches > 1 else (None, None))
    flat = hidden.detach().reshape(-1, hidden.shape[-1]).to(weight.dtype)
    with torch.autocast(hidden.device.type, enabled=False):  # the op computes in its inputs' dtype
        tokens = ops.branch_argmax(flat, weight, *expander, vocab_size=target.vocab_size).tokens   # [.. * b, K]
    tokens = tokens.view(*hidden.shape[:-1], drafter.num_branches)                           # [..., b, K]
    branch = prior_logits.argmax(-1)[..., None, None].expand(*hidden.shape[:-1], 1)
    return tokens.gather(-1, branch).squeeze(-1)


@torch.no_grad()
def selector_drafts(drafter: DBlastDrafter, target: TargetAdapter, hidden: torch.Tensor,
                    anchors: torch.Tensor) -> torch.Tensor:
    """A DFlash2 drafter's greedy chain, as decoding drafts it: hidden [B, b, H] (normed draft
    positions), anchors [B] -> [B, b] (the selector's walk over the LM head's logits)."""
    weight = target.lm_head_weight.detach()[: target.vocab_size]
    logits = hidden.detach().to(weight.dtype) @ weight.T
    return drafter.candidate_selector.walk(anchors, hidden.detach(), logits).tokens


def target_features(target: TargetAdapter, batch: Batch) -> torch.Tensor:
    """Context features [N, T, L*H] of every position (one inference-mode forward)."""
    return target_pass(target, batch.input_ids, batch.attention_mask).features


def batch_loss(drafter: DBlastDrafter, target: TargetAdapter, batch: Batch, *, objective: str, num_anchors: int,
               generator: torch.Generator, tau: float = 0.1, al_variant: str = "all_prefixes",
               position_weights: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None,
               features: Optional[torch.Tensor] = None, recompute_logits: bool = True, distill_weight: float = 0.0,
               teacher: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
               agreement: bool = False, selector_weight: float = 1.0, per_block: bool = False) \
        -> Dict[str, torch.Tensor]:
    """{"loss", "accepted_proxy", "blocks"} of one batch. `features` (the target's context
    features) and `teacher` (its top-k ids and log-probs [N, T, k], `FeatureCache.batch_topk`)
    may be passed in when computed already. With `distill_weight` w > 0 (objective nll only)
    the loss is (1 - w) * the NLL + w * `distillation_loss`. With `agreement`, also
    "agreement_hits" and "agreement_positions" [b]: per block position, how often the greedy
    draft (`greedy_drafts`) is the target's most likely token (teacher-forced on the data), and
    "greedy_accepted": the mean over blocks of `greedy_chain_accepted`, the accepted length of the
    greedy chain that the decode loop drafts (with `per_block`, each block's as "block_greedy"). A
    DFlash2 drafter's loss adds `selector_weight` times its selector's cross-entropy
    (training/selector_loss.py), reported on its own as "selector_loss". With `per_block`, also
    each block's own acceptance estimate, in the order of the batch's rows and their sorted
    anchors: "block_rows" and "block_anchors" (which sequence, which anchor position) and
    "block_proxy" (`accepted_length_per_block`), so that two drafters measured on the same
    anchors can be compared block by block."""
    if distill_weight and objective != "nll":
        raise ValueError(f"distill_weight applies to the nll objective only, got objective {objective!r}")
    need_teacher = (distill_weight > 0 or agreement) and teacher is None
    if features is None or need_teacher:
        out = target_pass(target, batch.input_ids, batch.attention_mask, top_k=TOP_K if need_teacher else 0)
        features = out.features if features is None else features
        teacher = (out.topk_ids, out.topk_logprobs) if need_teacher else teacher
    anchors, valid = sample_anchors(batch.loss_mask, num_anchors, generator)
    inputs = block_inputs(drafter, target.embed, batch.input_ids, anchors)
    hidden = drafter_block_hidden(drafter, inputs["embeddings"], inputs["positions"], features, anchors)
    rows, blocks, block = anchors.shape[0], anchors.shape[1], drafter.config.block_size
    hidden = hidden.view(rows, blocks, block, -1)
    labels, target_lp, mask = block_labels(batch, anchors, valid, block)
    expander = ((drafter.branch_expander.weight, drafter.branch_expander.bias) if drafter.num_branches > 1
                else (None, None))
    ids = labels.unsqueeze(-1)
    if distill_weight > 0:  # the label and the target's top-k in one LM-head pass per chunk
        teacher_ids, teacher_lp = block_teacher(teacher, anchors, block)
        ids = torch.cat([ids, teacher_ids], dim=-1)
    logprobs = gather_branch_logprobs(hidden[:, :, 1:], target.lm_head_weight.detach(), ids, *expander,
                                      chunk_size=chunk_size, vocab_size=target.vocab_size,
                                      recompute=recompute_logits)   # [N, M, b, K, 1 + k]
    branch_lp = logprobs[..., 0].transpose(-1, -2)                                           # [N, M, K, b]
    if drafter.num_branches > 1:
        prior_logits = drafter.prior_head(hidden[:, :, 0]).float()
    else:
        prior_logits = torch.zeros(rows, blocks, 1, device=hidden.device)
    # blocks without a valid anchor carry no loss; average over real blocks only
    keep = valid
    if not bool(keep.any()):  # no response long enough for a block in this batch: a zero loss, still a graph
        zero = hidden.sum() * 0.0
        none = torch.zeros(block - 1, dtype=torch.long)
        empty = torch.zeros(0, dtype=torch.long)
        return {"loss": zero, "accepted_proxy": torch.tensor(0.0), "blocks": torch.tensor(0),
                **({"agreement_hits": none, "agreement_positions": none, "greedy_accepted": torch.tensor(0.0)}
                   if agreement else {}),
                **({"block_rows": empty, "block_anchors": empty, "block_proxy": torch.zeros(0)} if per_block else {}),
                **({"block_greedy": torch.zeros(0)} if per_block and agreement else {})}
    counts = {}
    selector = getattr(drafter, "candidate_selector", None)
    previous = at_draft_positions(batch.input_ids, anchors, block, shift=0)[keep]   # the token before each
    if agreement:
        drafts = (selector_drafts(drafter, target, hidden[:, :, 1:][keep], previous[:, 0]) if selector is not None
                  else greedy_drafts(drafter, target, hidden[:, :, 1:][keep], prior_logits[keep]))
        top1 = block_teacher(teacher, anchors, block)[0][..., 0][keep]
        hits, positions = top1_agreement_counts(drafts, top1, mask[keep])
        chain = greedy_chain_accepted(drafts, labels[keep], valid_positions(mask[keep]))
        counts = {"agreement_hits": hits.cpu(), "agreement_positions": positions.cpu(),
                  "greedy_accepted": chain.mean().cpu()}
        if per_block:
            counts["block_greedy"] = chain.cpu()
    branch_lp, prior_logits, target_lp, mask = branch_lp[keep], prior_logits[keep], target_lp[keep], mask[keep]
    if objective == "nll":
        loss = (nll_independent(branch_lp[:, 0], mask, position_weights) if drafter.num_branches == 1
                else nll_mixture(prior_logits, branch_lp, mask, position_weights))
        if distill_weight > 0:
            soft = distillation_loss(prior_logits, branch_lp, logprobs[..., 1:].transpose(-2, -3)[keep],
                                     teacher_lp[keep], mask, position_weights)
            loss = (1 - distill_weight) * loss + distill_weight * soft
    elif objective == "al":
        loss = accepted_length_surrogate(prior_logits, branch_lp, target_lp, mask, tau=tau, variant=al_variant,
                                         position_weights=position_weights)
    else:
        raise ValueError(f"objective must be 'nll' or 'al', got {objective!r}")
    if selector is not None:
        chosen = selector_loss(selector, hidden[:, :, 1:][keep], previous, labels[keep], mask,
                               target.lm_head_weight.detach(), target.vocab_size, position_weights, chunk_size)
        counts["selector_loss"] = chosen.detach()
        loss = loss + selector_weight * chosen
    blocks_proxy = accepted_length_per_block(prior_logits, branch_lp, target_lp, mask)
    if per_block:
        rows_of = torch.arange(rows, device=anchors.device)[:, None].expand(rows, blocks)
        counts.update(block_rows=rows_of[keep].cpu(), block_anchors=anchors[keep].cpu(),
                      block_proxy=blocks_proxy.detach().float().cpu())
    return {"loss": loss, "accepted_proxy": blocks_proxy.mean(), "blocks": torch.tensor(int(keep.sum())), **counts}
