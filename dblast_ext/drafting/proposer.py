"""The proposer seam: what the decode loop asks of a drafter, once per cycle.

Given the anchor (the last committed token) of each row, the target features of the committed
tokens the proposer has not seen yet (padded across rows: `context_lens` says how many are each
row's) and its own cache, a proposer returns a `Proposal`: the greedy token
of each of its K branches at each of the b draft positions, and the category prior over the
branches (DBLast Eq 18-19); optionally each branch's m likeliest tokens at each position and
their probabilities (a `RankedProposal`), from which trie verification adds extra leaves
(dblast_ext.decoding.trie.add_alternative_leaves). The decode loop chooses a branch, has the target score it and
verifies exactly, so any proposer whose proposals meet `branch_verify`'s contract (int64 ids
below the vocabulary, a finite prior summing to 1 per row: docs/ops.md) keeps the output
distribution the target's; only the acceptance depends on it.

`DrafterProposer` is the one this package ships (a `DBlastDrafter` drafting over an optional
draft vocabulary); tests and other drafters implement the `Proposer` protocol directly.
"""
from typing import NamedTuple, Optional, Protocol, Sequence

import torch

from .dflash2 import SelectedChain, draft_logits
from .draft_vocabulary import DraftVocab, draft_vocabulary, end_of_sequence_ids
from .drafter import DBlastDrafter, DrafterCache
from ..target.adapter import TargetAdapter


class Proposal(NamedTuple):
    branch_tokens: torch.Tensor  # [N, K, b] int64: branch z's greedy token at draft position i
    prior: torch.Tensor          # [N, K] float32: the tempered category distribution (rows sum to 1)


class RankedProposal(NamedTuple):
    """A Proposal that also ranks tokens, for trie verification's extra leaves (a type of its
    own, so that a two-field Proposal still unpacks as `tokens, prior = proposal`)."""
    branch_tokens: torch.Tensor  # [N, K, b] int64, as Proposal's
    prior: torch.Tensor          # [N, K] float32, as Proposal's
    top_tokens: torch.Tensor     # [N, K, b, m] int64: branch z's m likeliest tokens at position i, likeliest first
    top_probs: torch.Tensor      # [N, K, b, m] float32: the branch's probabilities of them


class SparseProposal(NamedTuple):
    """A sampled chain (K = 1) with the sparse proposal it was drawn from at every position
    (DFlash2's selector at T > 0): verified by ops.sparse_verify, which needs q of each draft."""
    branch_tokens: torch.Tensor    # [N, 1, b] int64: the chain
    prior: torch.Tensor            # [N, 1] float32: ones
    proposal_tokens: torch.Tensor  # [N, b, C] int64: the candidates at each position
    proposal_probs: torch.Tensor   # [N, b, C] float32: q over them


class ProposerCache(Protocol):
    """A proposer's own context state; `propose` appends the new context it is given. For
    batches of prompts it also needs `select_rows(rows)` (int64 indices): the rows that go on
    when others finish."""


class Proposer(Protocol):
    """What SpeculativeDecoder needs of a drafter (see the module docstring)."""

    block_size: int               # B: the anchor plus b = B - 1 draft positions
    num_branches: int             # K
    target_layer_ids: Sequence[int]  # the target layers whose hidden states form the context features

    def new_cache(self, rows: int, capacity: int, device: torch.device) -> ProposerCache: ...

    def propose(self, anchors: torch.Tensor, context: torch.Tensor, cache: ProposerCache,
                context_lens: Optional[torch.Tensor] = None) -> Proposal:
        """anchors [N] int64; context [N, T, F]: features of the committed tokens `cache` lacks
        (it appends them), the first context_lens[r] of row r ([N] int64 on the anchors'
        device; None: all T); returns the block after the anchors."""
        ...


class DrafterProposer:
    """A DBlastDrafter as a proposer: one drafter pass on [anchor, mask x b], the K-branch
    expansion and LM-head argmax over the draft vocabulary, and the prior at category
    temperature Z_T (0: all mass on the prior's argmax branch). With `top_tokens` = m > 0 it
    also ranks each branch's m likeliest tokens at every position (trie verification's extra
    leaves; the decode loop sets it): the LM head's logits are then computed whole, in the
    head's dtype, and the branch tokens are their argmax (the fused op returns the argmax only)."""

    def __init__(self, drafter: DBlastDrafter, target: TargetAdapter, *, category_temperature: float = 1.0,
                 draft_vocab: DraftVocab = None, use_kernels: bool = True):
        """`draft_vocab`: the token ids the drafter may propose (dblast_ext.drafting.draft_vocabulary:
        an int N for the first N ids, or a list of ids; None for all of them)."""
        self.drafter = drafter
        self.target = target
        self.category_temperature = category_temperature
        self.use_kernels = use_kernels
        self.draft_ids = draft_vocabulary(draft_vocab, target.vocab_size, end_of_sequence_ids(target.model))
        self._draft_head = None  # (the LM head it was gathered from, ids there, the rows for the kernel, as is)
        self.top_tokens = 0      # m: rank each branch's m likeliest tokens per position (0: only the argmax)
        # DFlash2's selector: 0 walks the best-scoring candidates; above 0 it samples the chain at
        # this temperature with `selector_generator` (the decode loop sets both to its own)
        self.selector_temperature = 0.0
        self.selector_generator: Optional[torch.Generator] = None
        self.selector_uniforms: Optional[torch.Tensor] = None  # [N, b]: the draws of the next pass
        # above 0 (trie verification): propose the greedy chain and the selector's this many best
        # paths, as branches whose prior is their probability (the trie loop sets it)
        self.selector_paths = 0

    @property
    def category_temperature(self) -> float:
        """Z_T of the prior (0: all mass on its argmax branch)."""
        return self._category_temperature

    @category_temperature.setter
    def category_temperature(self, value: float) -> None:
        if not value >= 0:  # NaN too
            raise ValueError(f"category_temperature must be >= 0, got {value}")
        self._category_temperature = value

    @property
    def block_size(self) -> int:
        return self.drafter.config.block_size

    @property
    def num_branches(self) -> int:
        return self.drafter.num_branches

    @property
    def target_layer_ids(self) -> Sequence[int]:
        return self.drafter.config.target_layer_ids

    def new_cache(self, rows: int, capacity: int, device) -> DrafterCache:
        return DrafterCache(self.drafter.config, rows, capacity, device, self.drafter.fc.weight.dtype)

    def propose(self, anchors: torch.Tensor, context: torch.Tensor, cache: DrafterCache,
                context_lens: Optional[torch.Tensor] = None) -> Proposal:
        config = self.drafter.config
        block_ids = torch.full((anchors.shape[0], config.block_size), config.mask_token_id, dtype=torch.int64,
                               device=anchors.device)
        block_ids[:, 0] = anchors
        hidden = self.drafter(self.target.embed(block_ids), context, cache, use_kernels=self.use_kernels,
                              context_lens=context_lens)
        prior = self.drafter.branch_prior(hidden[:, 0], self.category_temperature).float()
        if hasattr(self.drafter, "candidate_selector") and self.selector_paths:  # DFlash2, for a trie
            return Proposal(*self.selector_paths_of(anchors, hidden))
        if hasattr(self.drafter, "candidate_selector"):  # DFlash2: one chain, the selector's
            chain = self.selected_chain(anchors, hidden)
            if chain.probs is None:
                return Proposal(chain.tokens[:, None], prior)
            return SparseProposal(chain.tokens[:, None], prior, chain.candidates, chain.probs)
        if self.top_tokens > 0:
            top_tokens, top_probs = self.ranked_tokens(hidden, self.top_tokens)
            return RankedProposal(top_tokens[..., 0].contiguous(), prior, top_tokens, top_probs)
        return Proposal(self.draft_tokens(hidden), prior)

    def ranked_tokens(self, block_hidden: torch.Tensor, m: int):
        """Every branch's m likeliest tokens at every draft position over the draft vocabulary,
        likeliest first, and the drafter's probabilities of them (softmax over that vocabulary):
        ([N, K, b, m] int64, [N, K, b, m] float32)."""
        if self.draft_ids is None:
            return self.drafter.ranked_branch_tokens(block_hidden, self.target.lm_head_weight,
                                                     self.target.vocab_size, m)
        ids, rows = self._draft_vocab_head(native_dtype=True)
        local, probs = self.drafter.ranked_branch_tokens(block_hidden, rows, len(ids), m)
        return ids[local], probs

    def selected_chain(self, anchors: torch.Tensor, block_hidden: torch.Tensor) -> SelectedChain:
        """A DFlash2 drafter's chain over the draft vocabulary: the LM head's logits at every
        draft position (times the output multiplier, soft-capped), then the candidate selector's
        walk from each anchor at `selector_temperature` (dblast_ext.drafting.dflash2)."""
        ids, hidden, logits = self._selector_inputs(block_hidden)
        return self.drafter.candidate_selector.walk(anchors, hidden, logits, ids, self.selector_temperature,
                                                    self.selector_generator, self.selector_uniforms)

    def selector_paths_of(self, anchors: torch.Tensor, block_hidden: torch.Tensor):
        """A DFlash2 drafter's greedy chain and `selector_paths` best paths (the selector's beam),
        with their probabilities: ([N, P, b] ids, [N, P] prior)."""
        ids, hidden, logits = self._selector_inputs(block_hidden)
        return self.drafter.candidate_selector.best_paths(anchors, hidden, logits, ids, self.selector_paths)

    def _selector_inputs(self, block_hidden: torch.Tensor):
        """(the draft vocabulary's ids or None, the drafted positions' states, their draft logits)."""
        config = self.drafter.config
        if self.draft_ids is None:
            ids, rows = None, self.target.lm_head_weight[: self.target.vocab_size]
        else:
            ids, rows = self._draft_vocab_head(native_dtype=True)
        hidden = block_hidden[:, 1:]
        logits = draft_logits(hidden.to(rows.dtype) @ rows.T, config.output_multiplier,
                              config.final_logit_softcapping)
        return ids, hidden, logits

    def draft_tokens(self, block_hidden: torch.Tensor) -> torch.Tensor:
        """Every branch's greedy token at every draft position, [N, K, b], over the draft
        vocabulary: the LM head rows of its ids only, the argmax mapped back to token ids."""
        if self.draft_ids is None:
            return self.drafter.branch_tokens(block_hidden, self.target.lm_head_weight, self.target.vocab_size,
                                              use_kernels=self.use_kernels)
        ids, rows = self._draft_vocab_head()
        local = self.drafter.branch_tokens(block_hidden, rows, len(ids), use_kernels=self.use_kernels)
        return ids[local]

    def _draft_vocab_head(self, native_dtype: bool = False):
        """(ids, LM head rows of those ids): gathered once, again if the model moved. On a CPU the
        rows for the argmax kernel are upcast to float32 (the kernel computes in float32 and would
        upcast 16-bit rows every call; upcasting is exact, so the argmax is the same), while the
        ranking (`native_dtype`) multiplies in the head's own dtype, where bfloat16 matmuls are
        about 3x faster than float32 ones on a CPU with native bf16 (its drafts may then differ
        from the kernel's in near ties; verification is exact either way)."""
        head = self.target.lm_head_weight
        key = (head.data_ptr(), head.device, head.dtype)
        if self._draft_head is None or self._draft_head[0] != key:
            ids = self.draft_ids.to(head.device)
            rows = head.detach().index_select(0, ids).contiguous()
            upcast = rows.float() if rows.device.type == "cpu" else rows
            self._draft_head = (key, ids, upcast, rows)
        _, ids, upcast, rows = self._draft_head
        return ids, (rows if native_dtype else upcast)


def samples_its_chain(proposer) -> bool:
    """Whether `proposer` is a DFlash2 drafter's, whose selector can sample the chain (T > 0)."""
    return isinstance(proposer, DrafterProposer) and hasattr(proposer.drafter, "candidate_selector")


def first_drafts(proposal, depth: int):
    """The proposal cut to its first `depth` drafts (the adaptive controller's depth)."""
    if isinstance(proposal, SparseProposal):
        return SparseProposal(proposal.branch_tokens[:, :, :depth], proposal.prior,
                              proposal.proposal_tokens[:, :depth], proposal.proposal_probs[:, :depth])
    return Proposal(proposal.branch_tokens[:, :, :depth], proposal.prior)


def check_proposer(proposer: Proposer, num_target_layers: int) -> None:
    """A clear error for an object that cannot serve as a proposer, before any model runs
    (`num_target_layers`: the target's, which `target_layer_ids` index)."""
    missing = [name for name in ("block_size", "num_branches", "target_layer_ids", "new_cache", "propose")
               if not hasattr(proposer, name)]
    if missing:
        raise TypeError(f"proposer {type(proposer).__name__} lacks {', '.join(missing)} (see dblast_ext.drafting.proposer)")
    if int(proposer.block_size) < 2:
        raise ValueError(f"proposer.block_size must be >= 2 (an anchor and at least one draft), "
                         f"got {proposer.block_size}")
    bad = [i for i in proposer.target_layer_ids if not 0 <= int(i) < num_target_layers]
    if bad:
        raise ValueError(f"proposer.target_layer_ids {list(proposer.target_layer_ids)}: {bad} outside the target's "
                         f"{num_target_layers} layers")


def check_proposal(proposal, vocab_size: int) -> None:
    """The verifiers' value checks of a proposal, for a loop that feeds it to the target before
    any verifier sees it (trie verification): ids within the vocabulary, a prior summing to 1,
    and ranked tokens (when given) shaped [N, K, b, m] with probabilities in [0, 1]."""
    tokens, prior = proposal.branch_tokens, proposal.prior
    top, probs = getattr(proposal, "top_tokens", None), getattr(proposal, "top_probs", None)
    if (top is None) != (probs is None):
        raise ValueError("proposal top_tokens and top_probs are given together or not at all")
    if top is not None:
        if top.dim() != 4 or top.shape[:3] != tokens.shape or probs.shape != top.shape:
            raise ValueError(f"proposal top_tokens and top_probs must be [N, K, b, m] with [N, K, b] = "
                             f"{list(tokens.shape)}; got {list(top.shape)} and {list(probs.shape)}")
        if not ((top >= 0) & (top < vocab_size)).all():
            raise ValueError(f"proposal top_tokens has entries outside [0, {vocab_size})")
        if not (torch.isfinite(probs) & (probs >= 0) & (probs <= 1)).all():
            raise ValueError("proposal top_probs must be finite and in [0, 1]")
    ok = torch.stack([((tokens >= 0) & (tokens < vocab_size)).all(),
                      (torch.isfinite(prior) & (prior >= 0)).all(),
                      ((prior.sum(-1) - 1).abs() <= 1e-4).all()]).tolist()
    if not ok[0]:
        raise ValueError(f"proposal branch_tokens has entries outside [0, {vocab_size})")
    if not ok[1]:
        raise ValueError("proposal prior must have finite entries >= 0")
    if not ok[2]:
        raise ValueError("proposal prior rows must sum to 1 (within 1e-4)")


__all__ = ["Proposal", "RankedProposal", "Proposer", "ProposerCache", "DrafterProposer", "check_proposer", "check_proposal"]
