"""Input builders and comparison helpers shared by the verifier tests and benchmarks."""
from dataclasses import dataclass

import torch

from dblast_ext import reference


@dataclass
class FilterSettings:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def kwargs(self):
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


def _sample_tokens(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def make_branch_case(rows: int, num_branches: int, num_draft: int, vocab: int, settings: FilterSettings,
                     generator: torch.Generator, dtype=torch.float32, scale: float = 2.0,
                     zero_prior: bool = True, identical: bool = True):
    """Random target logits and K greedy branches that look like a drafter's: branch 0 is
    drawn from the (softened) target so that drafts are often accepted; every other branch
    copies a random-length prefix of an earlier branch (shared prefixes), one branch may be
    an exact copy (identical branches), and one may get zero prior mass."""
    logits = (torch.randn(rows, num_draft + 1, vocab, generator=generator) * scale).to(dtype)
    soft = reference.filter_target_probs(logits[:, :num_draft], max(settings.temperature, 0.5), 0, 1.0)
    tokens = torch.empty(rows, num_branches, num_draft, dtype=torch.int64)
    for z in range(num_branches):
        tokens[:, z] = _sample_tokens(soft, generator)
        if z > 0:
            parent = torch.randint(0, z, (rows,), generator=generator)
            shared = torch.randint(0, num_draft + 1, (rows,), generator=generator)
            if identical and z == num_branches - 1:
                shared[: rows // 4] = num_draft  # exact duplicates of an earlier branch
            copy = torch.arange(num_draft)[None, :] < shared[:, None]
            tokens[:, z] = torch.where(copy, tokens[torch.arange(rows), parent], tokens[:, z])
    prior = torch.rand(rows, num_branches, generator=generator) + 0.05
    if zero_prior and num_branches > 2:
        prior[: rows // 2, -1] = 0.0
    prior = prior / prior.sum(-1, keepdim=True)
    branch = torch.multinomial(prior, 1, generator=generator).squeeze(-1)
    uniforms = torch.rand(rows, num_draft + 1, generator=generator, dtype=torch.float64)
    return dict(target_logits=logits, branch_tokens=tokens, branch_prior=prior, branch=branch, uniforms=uniforms)


def make_mixture_case(rows: int, num_branches: int, num_draft: int, vocab: int, settings: FilterSettings,
                      generator: torch.Generator, dtype=torch.float32, scale: float = 2.0,
                      draft_temperature: float = 1.0):
    """Random target logits and K branch logit tables correlated with the target (so that
    drafts are often accepted), with a draft sampled from the mixture."""
    logits = torch.randn(rows, num_draft + 1, vocab, generator=generator) * scale
    noise = torch.randn(rows, num_branches, num_draft, vocab, generator=generator) * scale
    draft_logits = (0.7 * logits[:, None, :num_draft] + 0.7 * noise).to(dtype)
    prior = torch.rand(rows, num_branches, generator=generator) + 0.05
    prior = prior / prior.sum(-1, keepdim=True)
    draft_tokens, _ = reference.sample_mixture_draft(draft_logits, prior, draft_temperature=draft_temperature,
                                                     generator=generator)
    uniforms = torch.rand(rows, num_draft + 1, generator=generator, dtype=torch.float64)
    return dict(target_logits=logits.to(dtype), draft_logits=draft_logits, branch_prior=prior,
                draft_tokens=draft_tokens, uniforms=uniforms)


def to_device(case: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def decision_margins(p: torch.Tensor, draft: torch.Tensor, proposals, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, how far the reference's decisions are from flipping: the smallest
    |u_i - A_i| over the positions the decision looked at, and the distance of the final
    uniform from the nearest step of the final token's CDF."""
    rows, num_draft = draft.shape
    u = uniforms.double()
    accept = reference.acceptance_probs(p, draft, proposals)
    margins = torch.full((rows,), float("inf"), dtype=torch.float64)
    for n in range(rows):
        k = num_draft
        for i in range(num_draft):
            margins[n] = min(margins[n], abs(u[n, i] - accept[n, i]))
            if not u[n, i] < accept[n, i]:
                k = i
                break
        q = proposals[k][n] if k < num_draft else None
        weights = reference.final_token_weights(p[n, k], q)
        cdf = weights.cumsum(-1) / weights.sum()
        steps = cdf[weights > 0]
        margins[n] = min(margins[n], (steps - u[n, num_draft]).abs().min())
    return margins


def assert_verify_close(result, expected, margins: torch.Tensor, tol: float = 1e-5, boundary: float = 1e-8,
                        max_ambiguous: float = 0.05):
    """Op result equals the reference: accept_probs within `tol`; decisions and tokens
    exactly, except in rows whose reference decision lies within `boundary` of a flip
    (there float rounding may legitimately decide otherwise). Kernels accumulate
    probabilities in float64, so the boundary band is far narrower than the 1e-5 the
    spec allows; rows inside it must be rare."""
    torch.testing.assert_close(result.accept_probs.cpu(), expected.accept_probs, atol=tol, rtol=0)
    clear = margins > boundary
    assert clear.double().mean() >= 1 - max_ambiguous, f"{int((~clear).sum())} rows near a decision boundary"
    torch.testing.assert_close(result.num_accepted.cpu()[clear], expected.num_accepted[clear], atol=0, rtol=0)
    torch.testing.assert_close(result.output_tokens.cpu()[clear], expected.output_tokens[clear], atol=0, rtol=0)


def make_sparse_case(rows: int, num_draft: int, vocab: int, candidates: int, settings: FilterSettings,
                     generator: torch.Generator, dtype=torch.float32, scale: float = 2.0):
    """Random target logits and a chain drafted the way DFlash2's selector drafts: at every
    position the top `candidates` ids of a noisy copy of the target's logits, q the softmax of
    their noisy scores, the draft sampled from q (rounded through float32, as the decode loop
    passes it)."""
    logits = torch.randn(rows, num_draft + 1, vocab, generator=generator) * scale
    noisy = 0.8 * logits[:, :num_draft] + torch.randn(rows, num_draft, vocab, generator=generator) * scale * 0.6
    scores, tokens = noisy.topk(min(candidates, vocab), dim=-1)
    probs = (scores.double() / max(settings.temperature, 0.5)).softmax(-1).float()
    picked = _sample_tokens(probs.double(), generator)
    draft = tokens.gather(-1, picked[..., None]).squeeze(-1)
    uniforms = torch.rand(rows, num_draft + 1, generator=generator, dtype=torch.float64)
    return dict(target_logits=logits.to(dtype), draft_tokens=draft, proposal_tokens=tokens, proposal_probs=probs,
                uniforms=uniforms)
