"""Executable specification of every dblast op, in plain PyTorch (float64 math).

Each function has the signature of its op in dblast_ext.ops and is written for
readability, not speed: it materialises full distributions and loops over block
positions. Op tests compare the kernels against these functions.
"""
from typing import Optional, Tuple

import torch

from .results import BranchArgmax, SampledTokens, VerifyResult, draw_uniforms

__all__ = ["filter_target_probs", "branch_verify", "mixture_verify", "sample_mixture_draft",
           "greedy_branch_proposal", "mixture_proposal", "sparse_proposal", "sparse_verify", "acceptance_probs", "final_token_weights",
           "inverse_cdf_sample", "sample_tokens", "branch_states", "branch_argmax", "key_visible", "drafter_attention"]


def filter_target_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                        top_p: float = 1.0) -> torch.Tensor:
    """The target's filtered sampling distribution over the last dimension, float64.

    logits / T, then top-k (keep every token whose logit is >= the k-th largest),
    renormalise, then top-p (keep {v : p(v) >= theta} for the largest theta whose kept
    mass is >= top_p), renormalise. T = 0 is greedy: a one-hot at the argmax (lowest
    token id on ties). top_k <= 0 (or >= V) and top_p >= 1 disable their filter.
    """
    x = logits.double()
    vocab = x.shape[-1]
    if temperature == 0:
        greedy = torch.zeros_like(x)
        return greedy.scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
    x = x / temperature
    if 0 < top_k < vocab:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(dim=-1)
    if top_p < 1:
        ordered = probs.sort(dim=-1, descending=True).values
        cumulative = ordered.cumsum(dim=-1)
        # first sorted position whose cumulative mass reaches top_p (rounding may leave
        # every position short: then all tokens stay)
        boundary = (cumulative < top_p).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
        theta = ordered.gather(-1, boundary)
        probs = probs.masked_fill(probs < theta, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def inverse_cdf_sample(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of nonnegative weights [N, V]: the first token id (increasing order) with
    positive weight whose cumulative weight exceeds u * total; the last positive token
    if rounding leaves the target unreached."""
    cumulative = weights.cumsum(dim=-1)
    target = uniform.double().unsqueeze(-1) * cumulative[..., -1:]
    crossed = (cumulative > target) & (weights > 0)
    vocab = weights.shape[-1]
    ids = torch.arange(vocab, device=weights.device)
    first = torch.where(crossed, ids, vocab).min(dim=-1).values
    last_positive = torch.where(weights > 0, ids, -1).max(dim=-1).values
    return torch.where(first < vocab, first, last_positive)


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, query_tokens: Optional[torch.Tensor] = None) -> SampledTokens:
    """One token per row of logits [R, V] from the filtered target distribution, by inverse
    CDF on the row's uniform [R]; and the filtered probability of each query token [R, C]
    (-1 entries: 0). See dblast_ext.ops.sample_tokens."""
    probs = filter_target_probs(logits, temperature, top_k, top_p)
    tokens = inverse_cdf_sample(probs, uniforms)
    if query_tokens is None:
        query_tokens = torch.empty(logits.shape[0], 0, dtype=torch.int64, device=logits.device)
    known = query_tokens >= 0
    query_probs = probs.gather(-1, query_tokens.clamp(min=0)).where(known, 0.0)
    return SampledTokens(tokens, query_probs.float())


def final_token_weights(p: torch.Tensor, q: Optional[torch.Tensor]) -> torch.Tensor:
    """Unnormalised distribution of the final token: [p - q]+ after a rejection (p itself
    when that mass is zero), or p at the bonus position (q is None)."""
    if q is None:
        return p
    residual = (p - q).clamp(min=0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, p, residual)


def acceptance_probs(p: torch.Tensor, draft: torch.Tensor, proposals) -> torch.Tensor:
    """A_i = min(1, p_i(x_i) / q(x_i | x_<i)) for every draft position (Eq 2, 21), float64 [N, b].
    q = 0 (a draft the proposal cannot produce) is defined as "accept iff p > 0"."""
    columns = []
    for i in range(draft.shape[1]):
        x = draft[:, i : i + 1]
        p_x = p[:, i].gather(-1, x).squeeze(-1)
        q_x = proposals[i].gather(-1, x).squeeze(-1)
        columns.append(torch.where(q_x > 0, (p_x / q_x.clamp(min=1e-300)).clamp(max=1.0), (p_x > 0).double()))
    return torch.stack(columns, dim=-1)


def _verify_from_proposals(p: torch.Tensor, draft: torch.Tensor, proposals, uniforms: torch.Tensor) -> VerifyResult:
    """Shared acceptance / residual logic. p: [N, b+1, V] filtered target; draft: [N, b];
    proposals[i]: [N, V] proposal conditional q(. | x_<i) at draft position i."""
    rows, num_draft = draft.shape
    u = uniforms.double()
    accept = acceptance_probs(p, draft, proposals)
    rejected = ~(u[:, :num_draft] < accept)
    # first rejected position, or b when every draft passes
    positions = torch.arange(num_draft, device=p.device)
    num_accepted = torch.where(rejected, positions, num_draft).min(dim=-1).values

    output = torch.full((rows, num_draft + 1), -1, dtype=torch.int64, device=p.device)
    for n in range(rows):
        k = int(num_accepted[n])
        output[n, :k] = draft[n, :k]
        q = proposals[k][n] if k < num_draft else None
        weights = final_token_weights(p[n, k], q)
        output[n, k] = inverse_cdf_sample(weights.unsqueeze(0), u[n, num_draft : num_draft + 1])[0]
    return VerifyResult(num_accepted.to(torch.int32), output, accept.float())


def greedy_branch_proposal(branch_tokens: torch.Tensor, branch_prior: torch.Tensor, branch: torch.Tensor,
                           vocab_size: int) -> list:
    """q(. | x_<i) of the greedy-branch mixture (Eq 19-20) for every draft position i:
    the prior renormalised over branches whose first i tokens equal the draft's, each
    putting its mass on its own token at position i. Returns b tensors [N, V] (float64)."""
    rows, _, num_draft = branch_tokens.shape
    draft = branch_tokens[torch.arange(rows), branch]
    proposals = []
    for i in range(num_draft):
        consistent = (branch_tokens[:, :, :i] == draft[:, None, :i]).all(dim=-1)
        weights = branch_prior.double() * consistent
        weights = weights / weights.sum(dim=-1, keepdim=True)
        q = torch.zeros(rows, vocab_size, dtype=torch.float64, device=branch_tokens.device)
        proposals.append(q.scatter_add_(-1, branch_tokens[:, :, i], weights))
    return proposals


def branch_verify(target_logits: torch.Tensor, branch_tokens: torch.Tensor, branch_prior: torch.Tensor,
                  branch: torch.Tensor, uniforms: Optional[torch.Tensor] = None, *, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, generator: Optional[torch.Generator] = None,
                  validate: bool = True) -> VerifyResult:
    """Greedy-branch verification (DBLast Eq 18-21). See dblast_ext.ops.branch_verify."""
    uniforms = draw_uniforms(target_logits, uniforms, generator)
    p = filter_target_probs(target_logits, temperature, top_k, top_p)
    draft = branch_tokens[torch.arange(branch_tokens.shape[0]), branch]
    proposals = greedy_branch_proposal(branch_tokens, branch_prior, branch, target_logits.shape[-1])
    return _verify_from_proposals(p, draft, proposals, uniforms)


def sparse_proposal(proposal_tokens: torch.Tensor, proposal_probs: torch.Tensor, vocab_size: int) -> list:
    """q(. | x_<i) given as C (token, probability) entries per position (DFlash2's candidate
    selector): scattered onto the vocabulary, repeated ids summed. Returns b tensors [N, V]
    (float64)."""
    rows, num_draft, _ = proposal_tokens.shape
    proposals = []
    for i in range(num_draft):
        q = torch.zeros(rows, vocab_size, dtype=torch.float64, device=proposal_tokens.device)
        proposals.append(q.scatter_add_(-1, proposal_tokens[:, i], proposal_probs[:, i].double()))
    return proposals


def sparse_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, proposal_tokens: torch.Tensor,
                  proposal_probs: torch.Tensor, uniforms: Optional[torch.Tensor] = None, *,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  generator: Optional[torch.Generator] = None, validate: bool = True) -> VerifyResult:
    """Verification of a sampled chain with a sparse proposal. See dblast_ext.ops.sparse_verify."""
    uniforms = draw_uniforms(target_logits, uniforms, generator)
    p = filter_target_probs(target_logits, temperature, top_k, top_p)
    proposals = sparse_proposal(proposal_tokens, proposal_probs, target_logits.shape[-1])
    return _verify_from_proposals(p, draft_tokens, proposals, uniforms)


def mixture_proposal(draft_logits: torch.Tensor, branch_prior: torch.Tensor, draft_tokens: torch.Tensor,
                     draft_temperature: float = 1.0) -> list:
    """q(. | x_<i) of the soft mixture (Eq 11-12) for every draft position i: the branch
    conditionals weighted by the category posterior after the draft prefix.
    Returns b tensors [N, V] (float64)."""
    log_q = (draft_logits.double() / draft_temperature).log_softmax(dim=-1)  # [N, K, b, V]
    rows, num_branches, num_draft, _ = log_q.shape
    index = draft_tokens[:, None, :, None].expand(rows, num_branches, num_draft, 1)
    log_q_draft = log_q.gather(-1, index).squeeze(-1)  # [N, K, b]: log q_j(x_j | z)
    log_prior = branch_prior.double().log()
    proposals = []
    for i in range(num_draft):
        posterior = (log_prior + log_q_draft[:, :, :i].sum(dim=-1)).softmax(dim=-1)  # Eq 11
        proposals.append((posterior[:, :, None] * log_q[:, :, i].exp()).sum(dim=1))  # Eq 12
    return proposals


def mixture_verify(target_logits: torch.Tensor, draft_logits: torch.Tensor, branch_prior: torch.Tensor,
                   draft_tokens: torch.Tensor, uniforms: Optional[torch.Tensor] = None, *,
                   temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   draft_temperature: float = 1.0, generator: Optional[torch.Generator] = None,
                   validate: bool = True) -> VerifyResult:
    """Soft-mixture verification (DBLast Eq 5, 10-12). See dblast_ext.ops.mixture_verify."""
    uniforms = draw_uniforms(target_logits, uniforms, generator)
    p = filter_target_probs(target_logits, temperature, top_k, top_p)
    proposals = mixture_proposal(draft_logits, branch_prior, draft_tokens, draft_temperature)
    return _verify_from_proposals(p, draft_tokens, proposals, uniforms)


def sample_mixture_draft(draft_logits: torch.Tensor, branch_prior: torch.Tensor, *, draft_temperature: float = 1.0,
                         generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Samples z ~ branch_prior, then each draft position from softmax(draft_logits[z] / T_d).
    Returns (draft_tokens [N, b] int64, branch [N] int64)."""
    rows, _, num_draft, vocab = draft_logits.shape
    branch = torch.multinomial(branch_prior.double(), 1, generator=generator).squeeze(-1)
    chosen = draft_logits[torch.arange(rows, device=draft_logits.device), branch]  # [N, b, V]
    probs = (chosen.double() / draft_temperature).softmax(dim=-1).reshape(rows * num_draft, vocab)
    tokens = torch.multinomial(probs, 1, generator=generator).reshape(rows, num_draft)
    return tokens, branch


def branch_states(hidden: torch.Tensor, expander_weight: Optional[torch.Tensor] = None,
                  expander_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """DBLast Eq 13 with a linear expander: h_z = h + W_z h + b_z, [N, K, H], computed in
    float32 or better (float64 inputs stay float64)."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    h = hidden.to(dtype)
    if expander_weight is None:
        return h[:, None, :]
    rows, width = h.shape
    offsets = h @ expander_weight.to(dtype).T + expander_bias.to(dtype)
    return h[:, None, :] + offsets.view(rows, -1, width)


def branch_argmax(hidden: torch.Tensor, lm_head_weight: torch.Tensor, expander_weight: Optional[torch.Tensor] = None,
                  expander_bias: Optional[torch.Tensor] = None, *, vocab_size: Optional[int] = None,
                  tile_bytes: int = 0) -> BranchArgmax:
    """Greedy token, its logit and the logsumexp of every branch (see dblast_ext.ops.branch_argmax).
    Materialises all [N, K, V] logits."""
    states = branch_states(hidden, expander_weight, expander_bias)
    vocab = lm_head_weight.shape[0] if vocab_size is None else vocab_size
    logits = states @ lm_head_weight[:vocab].to(states.dtype).T  # [N, K, V]
    return BranchArgmax(logits.argmax(dim=-1), logits.amax(dim=-1).float(), logits.logsumexp(dim=-1).float())


def key_visible(query_position: torch.Tensor, key_position: torch.Tensor, *, window: int = -1,
                causal: bool = False) -> torch.Tensor:
    """Which keys a drafter query sees, by absolute position (broadcasting), among the keys of its
    attention (its context and its own block): with `causal`, keys at or before the query; with a
    sliding `window` > 0, keys less than `window` positions away, counting the query itself
    (DFlash's sliding layers). Context keys lie before the block, so causality never hides them."""
    visible = torch.ones(torch.broadcast_shapes(query_position.shape, key_position.shape), dtype=torch.bool,
                         device=query_position.device)
    if causal:
        visible &= key_position <= query_position
    if window > 0:
        visible &= (query_position - key_position).abs() < window
    return visible


def drafter_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_block: torch.Tensor,
                      v_block: torch.Tensor, context_lens: torch.Tensor, *, scale: Optional[float] = None,
                      window: int = -1, causal: bool = False) -> torch.Tensor:
    """Block attention of the drafter (see dblast_ext.ops.drafter_attention): concatenate the
    cached context and the block's keys/values, mask the cache slots a row does not use and the
    keys `key_visible` hides, then scaled dot-product attention (float32 or better; output in
    q's dtype)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    rows, heads, block, dim = q.shape
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    keys = torch.cat([k_cache, k_block], dim=2).to(dtype)
    values = torch.cat([v_cache, v_block], dim=2).to(dtype)
    lens = context_lens.to(torch.int64)[:, None, None]
    slot = torch.arange(max_len + block, device=q.device)
    in_block = slot >= max_len
    key_position = torch.where(in_block, lens + slot - max_len, slot)            # [N, 1, L_max + B]
    query_position = lens + torch.arange(block, device=q.device)[:, None]       # [N, B, 1]
    used = in_block | (slot < lens)
    visible = used & key_visible(query_position, key_position, window=window, causal=causal)  # [N, B, L_max + B]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.to(dtype), keys, values, attn_mask=visible[:, None], scale=scale if scale is not None else dim**-0.5,
        enable_gqa=heads != kv_heads)
    return out.to(q.dtype)
