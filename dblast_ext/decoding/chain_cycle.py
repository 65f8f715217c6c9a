"""The device-side steps of a cycle that verifies one branch (DBLast Algorithm 1, steps 1-4),
between the draw of the cycle's uniforms and its one host read, for every row of a batch at once:
1. propose a block after each row's anchor (`draft`), 2. choose a branch z ~ prior (`choose`),
3. one target forward on [anchor, draft] (`score`), 4. `branch_verify` (`verify`); a cycle of
depth 0 is one plain target step (`plain_step`).

`ChainCycle` is the contract between the eager loop (`batch_loop`) and the CUDA-graph replay
(`cuda_graphs.CycleGraphs`, which captures `draft`, `score`, `verify` and `plain_step` and
replays them): both run these steps and nothing else of the decoder. With the static target
cache and validate=False the steps trace as one graph (torch.compile fullgraph: no graph break,
no host sync; tested).
"""
from typing import Optional

import torch

from .. import ops, reference
from ..drafting.proposer import DrafterProposer, Proposal, Proposer, SparseProposal, samples_its_chain
from ..results import VerifyResult
from ..sampling import SamplingParams
from ..target.adapter import TargetAdapter

__all__ = ["ChainCycle", "choose_branch", "SELECTOR_TREE_PATHS"]

# a DFlash2 drafter's trie: its greedy chain and the selector's 3 likeliest paths (beam search), four
# paths like dblast-k4's four branches, merged where they share prefixes
SELECTOR_TREE_PATHS = 3


def choose_branch(prior: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Step 2: z ~ prior for each row ([N, K] prior, [N] uniforms -> [N] int64), by inverse
    CDF on the device. A branch of prior 0 is never chosen, rounding included."""
    cdf = prior.double().cumsum(-1)
    below = (cdf <= uniforms.to(cdf.dtype)[:, None]).sum(-1)
    branches = torch.arange(prior.shape[-1], device=prior.device)
    last_possible = torch.where(prior > 0, branches, 0).amax(-1)
    return torch.minimum(below, last_possible)


class ChainCycle:
    """A target and a proposer, and the steps of one cycle over them. `use_kernels`: the dblast
    ops (False: their pure-PyTorch reference, same results); the decoder keeps it in step with
    its own setting."""

    def __init__(self, target: TargetAdapter, proposer: Proposer, use_kernels: bool = True):
        self.target = target
        self.proposer = proposer
        self.use_kernels = use_kernels

    def start_selector(self, sampling: SamplingParams, tree: bool = False) -> int:
        """A DFlash2 drafter samples its chain at T > 0 (verified by sparse_verify) when one branch
        is verified, and walks it greedily otherwise; for a trie it proposes its greedy chain and
        its SELECTOR_TREE_PATHS best paths. Returns the uniforms per row a cycle adds for the
        sampled chain (b, else 0): columns block + 1 onwards, drawn with the cycle's others from
        the row's generator."""
        if not samples_its_chain(self.proposer):
            return 0
        sampled = sampling.temperature > 0 and not tree
        self.proposer.selector_temperature = sampling.temperature if sampled else 0.0
        self.proposer.selector_paths = SELECTOR_TREE_PATHS if tree else 0
        return self.proposer.block_size - 1 if sampled else 0

    def draft(self, anchors, context, context_lens, proposer_cache, uniforms):
        """1. propose a block after each row's anchor, 2. choose a branch (`choose`):
        (proposal, branch [N], draft [N, b - 1])."""
        if samples_its_chain(self.proposer):  # the sampled chain's draws, or none for the greedy walk
            block = self.proposer.block_size
            self.proposer.selector_uniforms = uniforms[:, block + 1:] if uniforms.shape[1] > block + 1 else None
        proposal = self.proposer.propose(anchors, context, proposer_cache, context_lens)
        return (proposal, *self.choose(proposal, uniforms))

    @staticmethod
    def choose(proposal: Proposal, uniforms: torch.Tensor):
        """2. a branch z ~ prior with uniforms[:, 0], and its drafts: (branch [N], draft [N, b - 1])."""
        branch = choose_branch(proposal.prior, uniforms[:, 0])
        drafts = proposal.branch_tokens.shape[-1]
        return branch, proposal.branch_tokens.gather(1, branch[:, None, None].expand(-1, 1, drafts))[:, 0]

    def score(self, anchors, draft, layout, target_cache):
        """3. one target forward on [anchor, draft] per row, appended to the target cache as
        `layout` says: (logits [N, b + 1, V], features)."""
        mask, positions = layout.block_inputs(draft.shape[1] + 1, anchors.device)
        return self.target.forward(torch.cat([anchors[:, None], draft], dim=1), target_cache, attention_mask=mask,
                                   position_ids=positions)

    def verify(self, logits: torch.Tensor, proposal: Proposal, branch: torch.Tensor, uniforms: torch.Tensor,
               sampling: SamplingParams, validate: bool) -> VerifyResult:
        """4. branch_verify (sparse_verify for a sampled chain). Its value checks (finite logits,
        ids below the vocabulary, a prior summing to 1, uniforms in [0, 1): reductions over
        [b + 1, V] and a device sync) run on the first cycle of a response and then only for
        proposers other than DrafterProposer: the loop draws the uniforms itself, SamplingParams
        is checked when made, and a DrafterProposer's ids come from an argmax over the vocabulary
        and its prior from a softmax."""
        validate = validate or not isinstance(self.proposer, DrafterProposer)
        if isinstance(proposal, SparseProposal):  # a sampled chain and the candidates it was drawn from
            verify = ops.sparse_verify if self.use_kernels else reference.sparse_verify
            return verify(logits, proposal.branch_tokens[:, 0], proposal.proposal_tokens, proposal.proposal_probs,
                          uniforms, validate=validate, **sampling.kwargs())
        if self.use_kernels:
            return ops.branch_verify(logits, proposal.branch_tokens, proposal.prior, branch, uniforms,
                                     validate=validate, **sampling.kwargs())
        return reference.branch_verify(logits, proposal.branch_tokens, proposal.prior, branch, uniforms,
                                       **sampling.kwargs())

    def score_and_verify(self, anchors, draft, proposal, branch, uniforms, layout, target_cache, sampling,
                         validate: bool):
        """3-4 with uniforms[:, 1:] for the verifier: (verification result, the block's features)."""
        logits, features = self.score(anchors, draft, layout, target_cache)
        return self.verify(logits, proposal, branch, uniforms[:, 1:], sampling, validate=validate), features

    def plain_step(self, anchors, uniforms, layout, target_cache, sampling):
        """A cycle of depth 0: one target forward on each row's anchor, its next token drawn with
        uniforms[:, 1] (`sample_tokens`, the target's filter): (a verification result of no
        drafts, the anchor's features)."""
        mask, positions = layout.block_inputs(1, anchors.device)
        logits, features = self.target.forward(anchors[:, None], target_cache, attention_mask=mask,
                                               position_ids=positions)
        tokens = self.sample(logits[:, 0], uniforms[:, 1], None, sampling, validate=False).tokens
        rows = anchors.shape[0]
        return VerifyResult(torch.zeros(rows, dtype=torch.int32, device=anchors.device), tokens[:, None],
                            torch.zeros(rows, 0, device=anchors.device)), features

    def sample(self, logits: torch.Tensor, uniforms: torch.Tensor, query_tokens: Optional[torch.Tensor],
               sampling: SamplingParams, validate: bool):
        """sample_tokens: a token per row of `logits` from the target's filtered distribution
        (the first token after a prompt, a plain step, the trie's nodes)."""
        if self.use_kernels:
            return ops.sample_tokens(logits, uniforms, query_tokens=query_tokens, validate=validate,
                                     **sampling.kwargs())
        return reference.sample_tokens(logits, uniforms, query_tokens=query_tokens, **sampling.kwargs())
