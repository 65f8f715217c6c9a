"""Training objectives of the drafter (DBLast §2, §3.2: Eq 7, 8, 10-12, 14-16).

Every loss takes per-branch log-probabilities of the label tokens, so none needs the full
vocabulary at once (`gather_branch_logprobs` produces them in chunks). Shapes: `...` is any
number of leading (block) dimensions, b the draft positions of a block, K the branches.

Masks: a block's valid positions are its leading unmasked ones (a block that runs past the
end of a response is cut there); masked positions contribute nothing.

Reduction, the same for all: the mean over blocks (every leading dimension) of the
per-block value, where the per-block value is the paper's expression (Eq 7 and 8 sum over
the block's positions, Eq 15 over the retained prefixes). Optional `position_weights` [b]
scale each position's term (Eq 7, 8, the distillation term) or each prefix term l (Eq 15):
DFlash's exponential decay (`decay_weights`), DBloom's flat step (`flat_step_weights`), or
their product.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

AL_VARIANTS = ("all_prefixes", "one_prefix", "whole_block")


def valid_positions(mask: torch.Tensor) -> torch.Tensor:
    """The leading unmasked positions of each block, as a float mask of the same shape."""
    return torch.cumprod(mask.to(torch.float64) > 0, dim=-1).to(torch.float32)


def _weights(position_weights: Optional[torch.Tensor], b: int, like: torch.Tensor) -> torch.Tensor:
    if position_weights is None:
        return torch.ones(b, dtype=like.dtype, device=like.device)
    if position_weights.shape != (b,):
        raise ValueError(f"position_weights must have shape ({b},), got {tuple(position_weights.shape)}")
    return position_weights.to(like.dtype).to(like.device)


def _check_mask(mask: torch.Tensor, shape, name: str) -> None:
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask must have shape {tuple(shape)} (the blocks' positions), got {tuple(mask.shape)}"
                         f" for {name}")


def nll_independent(token_logprobs: torch.Tensor, mask: torch.Tensor,
                    position_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Eq 7: -sum_i log q_i(x*_i | y) per block (token_logprobs [..., b]), mean over blocks."""
    _check_mask(mask, token_logprobs.shape, "token_logprobs")
    w = _weights(position_weights, token_logprobs.shape[-1], token_logprobs)
    per_block = -(token_logprobs * valid_positions(mask).to(token_logprobs.dtype) * w).sum(-1)
    return per_block.mean()


def nll_mixture(prior_logits: torch.Tensor, branch_token_logprobs: torch.Tensor, mask: torch.Tensor,
                position_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Eq 8: -log sum_z pi_z prod_i q_i(x*_i | y, z) per block (prior_logits [..., K],
    branch_token_logprobs [..., K, b]), mean over blocks. K = 1 is Eq 7."""
    if branch_token_logprobs.shape[:-1] != prior_logits.shape:
        raise ValueError(f"branch_token_logprobs {tuple(branch_token_logprobs.shape)} must be [..., K, b] with "
                         f"[..., K] = prior_logits' shape {tuple(prior_logits.shape)}")
    _check_mask(mask, branch_token_logprobs.shape[:-2] + branch_token_logprobs.shape[-1:], "branch_token_logprobs")
    w = _weights(position_weights, branch_token_logprobs.shape[-1], branch_token_logprobs)
    valid = valid_positions(mask).to(branch_token_logprobs.dtype).unsqueeze(-2)
    per_branch = (branch_token_logprobs * valid * w).sum(-1)                 # [..., K]
    per_block = -torch.logsumexp(F.log_softmax(prior_logits.to(per_branch.dtype), -1) + per_branch, dim=-1)
    return per_block.mean()


def mixture_prefix_logprobs(prior_logits: torch.Tensor, branch_token_logprobs: torch.Tensor) -> torch.Tensor:
    """log q(x_1:l | y) = log sum_z pi_z prod_{j<=l} q_j(x_j | y, z) for l = 1..b: [..., b].
    Differences of consecutive entries are the soft-mixture conditionals of Eq 10-12 (the
    posterior-updated mixture)."""
    log_prior = F.log_softmax(prior_logits.to(branch_token_logprobs.dtype), -1).unsqueeze(-1)
    return torch.logsumexp(log_prior + torch.cumsum(branch_token_logprobs, -1), dim=-2)


def _mixture_logprobs(prior_logits: torch.Tensor, branch_token_logprobs: torch.Tensor):
    """(log q(x_1:l), log q(x_l | x_<l)) for l = 1..b, in float32 or wider."""
    dtype = torch.promote_types(branch_token_logprobs.dtype, torch.float32)
    prefix = mixture_prefix_logprobs(prior_logits.to(dtype), branch_token_logprobs.to(dtype))
    return prefix, torch.cat([prefix[..., :1], prefix[..., 1:] - prefix[..., :-1]], dim=-1)


def accepted_length_surrogate(prior_logits: torch.Tensor, branch_token_logprobs: torch.Tensor,
                              target_logprobs: torch.Tensor, mask: torch.Tensor, *, tau: float = 0.1,
                              variant: str = "all_prefixes",
                              position_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The negative of Eq 15 (the loss of Eq 16), mean over blocks.

    On a target-sampled block x_1:b with target log-probs log p(x_j | y, x_<j)
    (target_logprobs [..., b], under the same filter that sampled it): q_j is the
    soft-mixture conditional, A_j = min(1, p_j / q_j), r_l = q(x_1:l) / p(x_1:l),
    S_l = sum_{i<=l} prod_{j<=i} A_j. l_tau is the first l with r_l < tau (else the last
    valid position); membership carries no gradient. Per block:
      all_prefixes: sum_{l <= l_tau} (log r_l + log S_l)
      one_prefix:   log r_{l_tau} + log S_{l_tau}
      whole_block:  log r_b + log S_b   (b = the last valid position)
    Computed in log space throughout, so finite for any finite input."""
    if variant not in AL_VARIANTS:
        raise ValueError(f"variant must be one of {AL_VARIANTS}, got {variant!r}")
    if not tau >= 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    if branch_token_logprobs.shape[:-1] != prior_logits.shape:
        raise ValueError(f"branch_token_logprobs {tuple(branch_token_logprobs.shape)} must be [..., K, b] with "
                         f"[..., K] = prior_logits' shape {tuple(prior_logits.shape)}")
    block_shape = branch_token_logprobs.shape[:-2] + branch_token_logprobs.shape[-1:]
    if tuple(target_logprobs.shape) != tuple(block_shape):
        raise ValueError(f"target_logprobs must have shape {tuple(block_shape)}, got {tuple(target_logprobs.shape)}")
    _check_mask(mask, block_shape, "target_logprobs")
    lq_prefix, lq_cond = _mixture_logprobs(prior_logits, branch_token_logprobs)  # [..., b] each
    lp = target_logprobs.to(lq_prefix.dtype)
    log_accept = torch.clamp(lp - lq_cond, max=0.0)                  # log A_j
    log_r = lq_prefix - torch.cumsum(lp, -1)                          # log r_l
    log_s = torch.logcumsumexp(torch.cumsum(log_accept, -1), dim=-1)  # log S_l
    terms = log_r + log_s

    valid = valid_positions(mask).to(torch.bool)
    n_valid = valid.sum(-1)                                           # [...]
    positions = torch.arange(1, terms.shape[-1] + 1, device=terms.device)
    with torch.no_grad():  # the retained set is a selection rule, not differentiated
        below = (log_r < math.log(tau)) & valid if tau > 0 else torch.zeros_like(valid)
        first_below = torch.where(below, positions, terms.shape[-1] + 1).amin(-1)
        l_tau = torch.minimum(first_below, n_valid)                   # 0 for a block with no valid position
        if variant == "all_prefixes":
            keep = positions <= l_tau.unsqueeze(-1)
        elif variant == "one_prefix":
            keep = positions == l_tau.unsqueeze(-1)
        else:
            keep = positions == n_valid.unsqueeze(-1)
    w = _weights(position_weights, terms.shape[-1], terms)
    per_block = (torch.where(keep, terms, torch.zeros_like(terms)) * w).sum(-1)
    return -per_block.mean()


def flat_step_weights(num_draft: int, boundary: int, weight: float) -> torch.Tensor:
    """DBloom's flat step: 1 at draft positions (block offsets) 1..boundary-1, `weight` at
    boundary..num_draft (the positions a block expansion adds), no decay."""
    if boundary < 1:
        raise ValueError(f"boundary must be >= 1, got {boundary}")
    offsets = torch.arange(1, num_draft + 1)
    return torch.where(offsets >= boundary, torch.tensor(float(weight)), torch.tensor(1.0))


def decay_weights(num_draft: int, gamma: float) -> torch.Tensor:
    """DFlash's position weights exp(-(k-1)/gamma) at draft position k = 1..num_draft: the
    front of the block, where acceptance is decided, weighs most (gamma 7 for B = 16)."""
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    return torch.exp(-torch.arange(num_draft, dtype=torch.float32) / gamma)


def distillation_loss(prior_logits: torch.Tensor, branch_token_logprobs: torch.Tensor,
                      branch_topk_logprobs: torch.Tensor, teacher_topk_logprobs: torch.Tensor, mask: torch.Tensor,
                      position_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Soft cross-entropy from the target's top-k distribution to the drafter's, mean over blocks.

    Inputs: prior_logits [..., K]; branch_token_logprobs [..., K, b], log q_i(x_i | z) of the
    block's labels; branch_topk_logprobs [..., K, b, k], log q_i(v | z) at the target's k ids
    S_i; teacher_topk_logprobs [..., b, k], the target's log p_i(v) at those ids. The target's
    distribution is renormalised over its ids, p~_i(v) = p_i(v) / sum_{u in S_i} p_i(u), and per
    block

        sum_i w_i * -sum_{v in S_i} p~_i(v) log q(v | y, x_<i),
        q(v | y, x_<i) = sum_z pi(z | x_<i) q_i(v | z),   pi(z | x_<i) ~ pi_z prod_{j<i} q_j(x_j | z),

    over the valid positions i: the posterior-updated soft mixture of Eq 10-12, whose
    conditionals at the labels multiply to Eq 8's likelihood, so with a one-hot p~ the term is
    Eq 8 (unweighted) and with K = 1 it is the usual distillation cross-entropy."""
    if branch_token_logprobs.shape[:-1] != prior_logits.shape:
        raise ValueError(f"branch_token_logprobs {tuple(branch_token_logprobs.shape)} must be [..., K, b] with "
                         f"[..., K] = prior_logits' shape {tuple(prior_logits.shape)}")
    if branch_topk_logprobs.shape[:-1] != branch_token_logprobs.shape:
        raise ValueError(f"branch_topk_logprobs {tuple(branch_topk_logprobs.shape)} must be [..., K, b, k] with "
                         f"[..., K, b] = branch_token_logprobs' shape {tuple(branch_token_logprobs.shape)}")
    block_shape = branch_token_logprobs.shape[:-2] + branch_token_logprobs.shape[-1:]
    expected = tuple(block_shape) + tuple(branch_topk_logprobs.shape[-1:])
    if tuple(teacher_topk_logprobs.shape) != expected:
        raise ValueError(f"teacher_topk_logprobs must have shape {expected}, got {tuple(teacher_topk_logprobs.shape)}")
    _check_mask(mask, block_shape, "branch_token_logprobs")
    dtype = torch.promote_types(branch_topk_logprobs.dtype, torch.float32)
    token_lp = branch_token_logprobs.to(dtype)
    # log pi(z | x_<i): the prior times the labels' likelihood strictly before i, normalised over z
    before = torch.cumsum(token_lp, -1) - token_lp
    log_post = F.log_softmax(F.log_softmax(prior_logits.to(dtype), -1).unsqueeze(-1) + before, dim=-2)
    log_q = torch.logsumexp(log_post.unsqueeze(-1) + branch_topk_logprobs.to(dtype), dim=-3)   # [..., b, k]
    teacher = torch.softmax(teacher_topk_logprobs.to(dtype), -1)                               # p~ over S_i
    per_position = -(teacher * log_q).sum(-1)
    w = _weights(position_weights, per_position.shape[-1], per_position)
    return (per_position * valid_positions(mask).to(dtype) * w).sum(-1).mean()


def _chunk_label_logprobs(hidden, labels, lm_head_weight, expander_weight, expander_bias):
    """[rows, K, J] log-probabilities of labels [rows, J] for one chunk of rows."""
    rows, width = hidden.shape
    if expander_weight is not None:
        branches = expander_weight.shape[0] // width
        states = hidden.unsqueeze(1) + F.linear(hidden, expander_weight, expander_bias).view(rows, branches, width)
    else:
        states = hidden.unsqueeze(1)
    logits = F.linear(states.to(lm_head_weight.dtype), lm_head_weight)  # [rows, K, V] for this chunk only
    return _PickedLogSoftmax.apply(logits, labels.unsqueeze(1).expand(rows, states.shape[1], labels.shape[-1]))


def _work_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)   # float64 stays float64 (gradcheck)


class _PickedLogSoftmax(torch.autograd.Function):
    """log_softmax(logits)[..., ids] in float32 (float64 for float64): logits [..., V]
    (bfloat16 under autocast, or float32), ids [..., J] -> [..., J]. Forward and backward each
    work in one float32 [..., V] buffer, in place (the softmax of the backward, softmax *
    -(sum of the output gradients) plus those gradients at the ids, included), and the
    gradient comes back in the logits' dtype: autograd's gather + logsumexp backward and the
    cast around them make a new [..., V] tensor at every step of the way, which at SmolLM2's
    49,152-token vocabulary cost more than the LM-head matmuls on a CPU."""

    @staticmethod
    def forward(ctx, logits, ids):
        work = torch.empty_like(logits, dtype=_work_dtype(logits)).copy_(logits)
        top = work.amax(-1, keepdim=True)
        lse = work.sub_(top).exp_().sum(-1, keepdim=True).log_().add_(top)
        ctx.save_for_backward(logits, lse, ids)
        return logits.gather(-1, ids).to(lse.dtype) - lse

    @staticmethod
    @torch.autograd.function.once_differentiable   # its in-place softmax is not differentiable again
    def backward(ctx, grad):
        logits, lse, ids = ctx.saved_tensors
        grad_logits = torch.empty_like(logits, dtype=_work_dtype(logits)).copy_(logits)
        grad_logits.sub_(lse).exp_().mul_(-grad.sum(-1, keepdim=True))   # the softmax, scaled
        grad_logits.scatter_add_(-1, ids, grad.to(grad_logits.dtype))     # repeated ids add up, like gather's
        return grad_logits.to(logits.dtype), None


# The logits a CPU chunk holds at once (rows x K x V): 4M float32 values, 16 MB, stay under
# glibc's 32 MB mmap ceiling, so every chunk's buffers come back from the heap instead of
# being mapped and zero-filled anew, and stay closer to the caches. Measured on SmolLM2's
# 49,152-token head (448 rows, one thread): 1,024-row chunks took 1.6x as long as 96-row ones.
CPU_CHUNK_LOGITS = 1 << 22
GPU_CHUNK_ROWS = 1024


def auto_chunk_rows(device: torch.device, branches: int, vocab: int) -> int:
    """The rows of one chunk of `gather_branch_logprobs` when the caller leaves it to the device."""
    if device.type == "cpu":
        return max(1, CPU_CHUNK_LOGITS // max(1, branches * vocab))
    return GPU_CHUNK_ROWS


_cast_cache = {}


def autocast_lm_head(weight: torch.Tensor) -> torch.Tensor:
    """The frozen LM head in the dtype autocast would give its matmul, cast once: autocast casts
    a frozen weight again at every call (its cache keeps only leaves that require grad), which
    at 49,152 x 576 took 35 ms a chunk on one CPU thread. Unchanged outside autocast, for a
    weight that trains, or one already in that dtype; the values are autocast's own cast."""
    device_type = weight.device.type
    if weight.requires_grad or not torch.is_autocast_enabled(device_type):
        return weight
    dtype = torch.get_autocast_dtype(device_type)
    if weight.dtype == dtype or not weight.is_floating_point():
        return weight
    key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype, dtype)
    if key not in _cast_cache:
        _cast_cache.clear()   # one head at a time: a run's target
        _cast_cache[key] = weight.to(dtype)
    return _cast_cache[key]


def gather_branch_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                           expander_weight: Optional[torch.Tensor] = None,
                           expander_bias: Optional[torch.Tensor] = None, *, chunk_size: Optional[int] = None,
                           vocab_size: Optional[int] = None, recompute: bool = True) -> torch.Tensor:
    """log softmax(W h_z)[label] for every row and branch: hidden [..., H], labels [...] (one id
    per row) or [..., J] (J ids per row: the label and the target's top-k share one LM-head
    matmul), lm_head_weight [V, H], expander Linear(H -> K*H) giving h_z = h + W_z h + b_z.
    Returns [..., K] for one id per row, [..., K, J] for J (K = 1 without an expander),
    float32. Runs `chunk_size` rows at a time (None: `auto_chunk_rows` for hidden's device)
    under activation checkpointing, so forward and backward hold one chunk's [chunk, K, V]
    logits, never the whole [rows, K, V]; differentiable in hidden and the expander (and the
    LM head if it requires grad). `vocab_size` drops padded LM-head rows. `recompute=False`
    keeps every chunk's logits for the backward instead (one matmul fewer per chunk, the
    memory of all of them: for when they fit). Chunks split rows only, so the values do not
    depend on the chunk size."""
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    width = hidden.shape[-1]
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != width:
        raise ValueError(f"lm_head_weight must be [V, {width}], got {tuple(lm_head_weight.shape)}")
    single = labels.shape == hidden.shape[:-1]
    if not single and not (labels.dim() == hidden.dim() and labels.shape[:-1] == hidden.shape[:-1]):
        raise ValueError(f"labels must have shape {tuple(hidden.shape[:-1])} or {tuple(hidden.shape[:-1])} + (J,), "
                         f"got {tuple(labels.shape)}")
    if expander_weight is not None and (expander_weight.dim() != 2 or expander_weight.shape[1] != width
                                        or expander_weight.shape[0] % width):
        raise ValueError(f"expander_weight must be [K*{width}, {width}], got {tuple(expander_weight.shape)}")
    weight = autocast_lm_head(lm_head_weight)
    weight = weight[:vocab_size] if vocab_size is not None else weight
    if labels.numel() and (labels.min() < 0 or labels.max() >= weight.shape[0]):
        raise ValueError(f"labels must lie in [0, {weight.shape[0]}), got [{int(labels.min())}, {int(labels.max())}]")
    per_row = 1 if single else labels.shape[-1]
    branches = expander_weight.shape[0] // width if expander_weight is not None else 1
    if chunk_size is None:
        chunk_size = auto_chunk_rows(hidden.device, branches, weight.shape[0])
    flat_hidden, flat_labels = hidden.reshape(-1, width), labels.reshape(-1, per_row)
    pieces = []
    for start in range(0, flat_hidden.shape[0], chunk_size):
        args = (flat_hidden[start:start + chunk_size], flat_labels[start:start + chunk_size], weight,
                expander_weight, expander_bias)
        needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args)
        pieces.append(checkpoint(_chunk_label_logprobs, *args, use_reentrant=False) if needs_grad and recompute
                      else _chunk_label_logprobs(*args))
    out = torch.cat(pieces) if pieces else hidden.new_zeros(0, branches, per_row, dtype=torch.float32)
    return out.view(*hidden.shape[:-1], branches) if single else out.view(*hidden.shape[:-1], branches, per_row)


@torch.no_grad()
def accepted_length_per_block(prior_logits: torch.Tensor, branch_token_logprobs: torch.Tensor,
                              target_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eq 14's estimate of each block: sum_l r_l prod_{j<=l} A_j = sum_l prod_{j<=l} min(1, q_j / p_j)
    over its valid positions, [blocks] (what a paired comparison of two drafters on the same
    held-out anchors needs)."""
    _, lq_cond = _mixture_logprobs(prior_logits, branch_token_logprobs)
    log_overlap = torch.clamp(lq_cond - target_logprobs.to(lq_cond.dtype), max=0.0)  # log min(1, q_j / p_j)
    survive = torch.exp(torch.cumsum(log_overlap, -1)) * valid_positions(mask).to(lq_cond.dtype)
    return survive.sum(-1)


def accepted_length_proxy(prior_logits: torch.Tensor, branch_token_logprobs: torch.Tensor,
                          target_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A cheap acceptance estimate for progress bars, from target-sampled blocks: Eq 14's
    sum_l r_l prod_{j<=l} A_j = sum_l prod_{j<=l} min(1, q_j / p_j), which is unbiased for the
    expected accepted length of the soft-mixture proposal (drafts sampled from q) over the
    valid positions; mean over blocks (`accepted_length_per_block`)."""
    return accepted_length_per_block(prior_logits, branch_token_logprobs, target_logprobs, mask).mean()
