"""The speculative decode loop: a Hugging Face causal LM as the target, a proposer (by default
a DBlastDrafter, `proposer.DrafterProposer`) drafting blocks, exact verification in between:
greedy-branch (`branch_verify`, one branch per cycle) or trie verification (`verify="tree"`,
every branch in one target pass; dblast_ext.trie).

One cycle (docs/design.md, "The decode cycle"; DBLast Algorithm 1):
1. propose: K greedy branches of b tokens after the anchor and the category prior;
2. choose a branch z ~ prior (Z_T = 0: the prior's argmax);
3. one target forward on [anchor, draft]: logits and hidden states together;
4. verify: accepted drafts n, then a correction or bonus token;
5. crop the target cache to the committed length (the proposer only ever caches committed
   context); the accepted tokens' features are the next cycle's new context.
With verify="tree", steps 2-4 become: merge the K branches into a trie, one target forward over
[anchor, trie nodes] under a tree mask, one `sample_tokens` draw per node, the walk; step 5 keeps
the committed path's cache entries.
"""
import time
from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional, Sequence

import torch

from . import ops, reference
from .drafter import DBlastDrafter
from .drafter_io import check_against_target
from .draft_vocabulary import DraftVocab
from .proposer import DrafterProposer, Proposal, Proposer, check_proposal, check_proposer
from .sampling import SamplingParams, sample_from_logits
from .target import TargetAdapter
from .trie import build_trie

__all__ = ["SpeculativeDecoder", "SamplingParams", "GenerationOutput", "CycleRecord", "sample_autoregressive",
           "choose_branch"]


@dataclass
class CycleRecord:
    num_accepted: int          # accepted drafts n, 0..b (committed length n + 1; a response's last
                               # cycle counts only the tokens kept before its stop token or limit)
    expected_accepted: float   # sum_i prod_{j<=i} A_j of the verified draft: the whole draft, also
                               # in a cycle cut at a stop token or the limit (a property of the
                               # proposal, not of what the response kept)
    branch: int
    prior: List[float]
    draft_time: float          # seconds in steps 1-2 of the cycle
    verify_time: float         # seconds in steps 3-5
    branches: List[int] = field(default_factory=list)  # the branches whose drafts begin with the
                               # accepted ones: [branch] for greedy-branch verification; for trie
                               # verification every branch through the deepest accepted node
    tree_nodes: int = 0        # trie verification: the draft nodes the target scored (0: branch mode)


@dataclass
class GenerationOutput:
    token_ids: List[int]
    stopped_by_eos: bool
    cycles: List[CycleRecord] = field(default_factory=list)


def prompt_tensor(input_ids, max_new_tokens: int, device) -> torch.Tensor:
    """One prompt as a [1, T] int64 tensor on `device`, checked before any model runs."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64, device=device)
    ids = ids.view(1, -1) if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one prompt ([T] or [1, T]), got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    return ids


def choose_branch(prior: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Step 2: z ~ prior for each row ([N, K] -> [N] int64 on the prior's device), from `generator`."""
    return torch.multinomial(prior.cpu().double(), 1, generator=generator).view(-1).to(prior.device)


VERIFY_MODES = ("branch", "tree")


class SpeculativeDecoder:
    def __init__(self, target, drafter: Optional[DBlastDrafter] = None, *, category_temperature: float = 1.0,
                 use_kernels: bool = True, draft_vocab: DraftVocab = None, proposer: Optional[Proposer] = None,
                 verify: str = "branch", max_tree_nodes: Optional[int] = None):
        """`target`: a Hugging Face causal LM. Either `drafter` (a DBlastDrafter, drafting over
        `draft_vocab`, see dblast_ext.draft_vocabulary, at category temperature Z_T) or
        `proposer` (anything implementing dblast_ext.proposer.Proposer; its own settings then
        replace `category_temperature` and `draft_vocab`). `use_kernels`: the dblast ops
        (False: their pure-PyTorch reference, same results).
        `verify`: "branch" verifies one branch drawn from the prior (DBLast Eq 18-21); "tree"
        merges all K branches into a trie and verifies it in one target pass (dblast_ext.trie;
        Z_T then only ranks nodes for `max_tree_nodes`, the most draft nodes scored per cycle,
        None for all). Both leave the output distribution the target's."""
        if (drafter is None) == (proposer is None):
            raise ValueError("give either drafter or proposer (exactly one)")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        if max_tree_nodes is not None and (verify != "tree" or int(max_tree_nodes) < 1):
            raise ValueError(f"max_tree_nodes must be None or >= 1, and only with verify='tree'; got "
                             f"{max_tree_nodes!r} with verify={verify!r}")
        self.verify = verify
        self.max_tree_nodes = max_tree_nodes
        self._use_kernels = use_kernels
        if drafter is not None:
            check_against_target(drafter.config, target.config)
            self.target = TargetAdapter(target, drafter.config.target_layer_ids)
            proposer = DrafterProposer(drafter, self.target, category_temperature=category_temperature,
                                       draft_vocab=draft_vocab, use_kernels=use_kernels)
        else:
            if category_temperature != 1.0 or draft_vocab is not None:
                raise ValueError("category_temperature and draft_vocab are a drafter's settings: with proposer=, "
                                 "set them on the proposer")
            check_proposer(proposer, target.config.num_hidden_layers)
            self.target = TargetAdapter(target, proposer.target_layer_ids)
        self.proposer = proposer

    @property
    def use_kernels(self) -> bool:
        """The dblast ops (False: their pure-PyTorch reference), for drafting and verifying alike."""
        return self._use_kernels

    @use_kernels.setter
    def use_kernels(self, value: bool) -> None:
        self._use_kernels = value
        if isinstance(self.proposer, DrafterProposer):
            self.proposer.use_kernels = value

    # the drafter-specific settings, for callers that built the decoder from a drafter
    @property
    def drafter(self) -> DBlastDrafter:
        return self.proposer.drafter

    @property
    def draft_ids(self) -> Optional[torch.Tensor]:
        return getattr(self.proposer, "draft_ids", None)

    @property
    def category_temperature(self) -> float:
        return self.proposer.category_temperature

    @category_temperature.setter
    def category_temperature(self, value: float) -> None:
        self.proposer.category_temperature = value

    @torch.inference_mode()
    def generate(self, input_ids, sampling: Optional[SamplingParams] = None, max_new_tokens: int = 256,
                 stop_token_ids: Optional[Sequence[int]] = None, seed: int = 0,
                 on_tokens: Optional[Callable[[List[int]], None]] = None) -> GenerationOutput:
        """Speculative sampling; `on_tokens(new_ids)` is called with the tokens each cycle
        commits (for streaming), in order, ending with the last token returned."""
        sampling = sampling or SamplingParams()
        ids = prompt_tensor(input_ids, max_new_tokens, self.target.device)
        stops = set(stop_token_ids or ())
        generator = torch.Generator().manual_seed(seed)

        target_cache = self.target.new_cache()
        logits, context = self.target.forward(ids, target_cache, last_logits_only=True)
        anchor = sample_from_logits(logits[0, -1], sampling, generator)
        generated = [anchor]
        if on_tokens:
            on_tokens([anchor])
        proposer_cache = self.proposer.new_cache(1, ids.shape[1] + max_new_tokens + self.proposer.block_size,
                                                 ids.device)
        cycles = []
        while len(generated) < max_new_tokens and anchor not in stops:
            record, emitted, context = self._cycle(anchor, context, target_cache, proposer_cache, sampling, generator,
                                                   validate=not cycles)
            cycles.append(record)
            before = len(generated)
            for token in emitted:
                generated.append(token)
                if token in stops or len(generated) >= max_new_tokens:
                    break
            kept = len(generated) - before
            if kept < len(emitted):  # cut at a stop token or the limit: the cycle committed `kept` tokens
                cycles[-1] = replace(record, num_accepted=kept - 1)
            if on_tokens:
                on_tokens(generated[before:])
            anchor = generated[-1]
        stopped = bool(stops) and generated[-1] in stops
        return GenerationOutput(generated[:max_new_tokens], stopped, cycles)

    def _cycle(self, anchor: int, context: torch.Tensor, target_cache, proposer_cache,
               sampling: SamplingParams, generator: torch.Generator, validate: bool):
        """One cycle after `anchor` (the last committed token; `context` holds the target
        features of the committed tokens the proposer has not cached yet). Returns the cycle's
        record, the emitted tokens (accepted drafts + the correction or bonus token) and the
        next context. `validate`: check the verifier's inputs' values (see _verify)."""
        if self.verify == "tree":
            return self._tree_cycle(anchor, context, target_cache, proposer_cache, sampling, generator, validate)
        device = context.device
        t0 = time.perf_counter()
        anchors = torch.tensor([anchor], dtype=torch.int64, device=device)
        proposal = self.proposer.propose(anchors, context, proposer_cache)            # 1. propose
        branch = choose_branch(proposal.prior, generator)                               # 2. choose a branch
        draft = proposal.branch_tokens[0, branch]
        t1 = time.perf_counter()

        verify_logits, features = self.target.forward(torch.cat([anchors[:, None], draft], dim=1),  # 3. score
                                                      target_cache)
        uniforms = torch.rand(1, self.proposer.block_size, generator=generator, dtype=torch.float64).to(device)
        result = self._verify(verify_logits, proposal, branch, uniforms, sampling, validate)  # 4. verify
        accepted = int(result.num_accepted[0])
        emitted = result.output_tokens[0, : accepted + 1].tolist()
        # 5. the target cache keeps the anchor and the accepted drafts; the final token is the next anchor
        self.target.crop(target_cache, proposer_cache.length + accepted + 1)
        survive = torch.cumprod(result.accept_probs[0].double(), 0)
        record = CycleRecord(accepted, float(survive.sum()), int(branch), proposal.prior[0].tolist(), t1 - t0,
                             time.perf_counter() - t1, [int(branch)])
        return record, emitted, features[:, : accepted + 1]

    def _tree_cycle(self, anchor: int, context: torch.Tensor, target_cache, proposer_cache,
                    sampling: SamplingParams, generator: torch.Generator, validate: bool):
        """_cycle with trie verification (dblast_ext.trie): every branch scored in one pass."""
        device = context.device
        t0 = time.perf_counter()
        anchors = torch.tensor([anchor], dtype=torch.int64, device=device)
        proposal = self.proposer.propose(anchors, context, proposer_cache)            # 1. propose
        if validate or not isinstance(self.proposer, DrafterProposer):
            check_proposal(proposal, self.target.vocab_size)
        prior = proposal.prior[0].tolist()
        trie = build_trie(proposal.branch_tokens[0].tolist(), prior, self.max_tree_nodes)  # 2. the trie
        trie.tokens[0] = anchor
        t1 = time.perf_counter()

        start = self.target.cache_length(target_cache)                                  # 3. score every node
        mask = trie.attention_mask(start, self.target.dtype, device)
        logits, features = self.target.forward_tree(torch.tensor([trie.tokens], device=device), target_cache,
                                                    trie.positions(start, device), mask)
        uniforms = torch.rand(self.proposer.block_size, generator=generator, dtype=torch.float64)
        drawn = self._sample(logits[0], uniforms[trie.depths].to(device), trie.child_tokens(device), sampling,
                             validate)                                                  # 4. draw and walk
        walk = trie.walk(drawn.tokens.tolist(), drawn.query_probs.tolist())
        rows = torch.tensor(walk.rows, dtype=torch.int64, device=device)
        self.target.keep_rows(target_cache, start, rows)                                # 5. keep the path
        accepted = len(walk.tokens) - 1
        record = CycleRecord(accepted, walk.expected_accepted, walk.branches[0], prior, t1 - t0,
                             time.perf_counter() - t1, walk.branches, trie.num_nodes)
        return record, walk.tokens, features[:, rows]

    def _sample(self, logits: torch.Tensor, uniforms: torch.Tensor, query_tokens: torch.Tensor,
                sampling: SamplingParams, validate: bool):
        """sample_tokens over the trie's rows (validated like _verify's inputs)."""
        if self.use_kernels:
            return ops.sample_tokens(logits, uniforms, query_tokens=query_tokens, validate=validate,
                                     **sampling.kwargs())
        return reference.sample_tokens(logits, uniforms, query_tokens=query_tokens, **sampling.kwargs())

    def _verify(self, logits: torch.Tensor, proposal: Proposal, branch: torch.Tensor, uniforms: torch.Tensor,
                sampling: SamplingParams, validate: bool):
        """branch_verify, its value checks (finite logits, ids below the vocabulary, a prior
        summing to 1, uniforms in [0, 1): reductions over [b + 1, V] and a device sync) run on
        the first cycle of a response and then only for proposers other than DrafterProposer:
        the loop draws the uniforms itself, SamplingParams is checked when made, and a
        DrafterProposer's ids come from an argmax over the vocabulary and its prior from a
        softmax."""
        validate = validate or not isinstance(self.proposer, DrafterProposer)
        if self.use_kernels:
            return ops.branch_verify(logits.float(), proposal.branch_tokens, proposal.prior, branch, uniforms,
                                     validate=validate, **sampling.kwargs())
        return reference.branch_verify(logits.float(), proposal.branch_tokens, proposal.prior, branch, uniforms,
                                       **sampling.kwargs())

    @torch.inference_mode()
    def first_cycle(self, prefix_ids, sampling: Optional[SamplingParams] = None, seed: int = 0) -> CycleRecord:
        """One drafting + verification cycle right after `prefix_ids`, whose last token is the
        anchor (as if the prefix had just been committed): acceptance at a chosen point of a
        response, for diagnostics."""
        sampling = sampling or SamplingParams()
        ids = prompt_tensor(prefix_ids, 1, self.target.device)
        if ids.shape[1] < 2:
            raise ValueError("prefix_ids needs at least two tokens: context and the anchor")
        target_cache = self.target.new_cache()
        _, context = self.target.forward(ids[:, :-1], target_cache, last_logits_only=True)
        proposer_cache = self.proposer.new_cache(1, ids.shape[1] + self.proposer.block_size, ids.device)
        generator = torch.Generator().manual_seed(seed)
        record, _, _ = self._cycle(int(ids[0, -1]), context, target_cache, proposer_cache, sampling, generator,
                                   validate=True)
        return record

    def warm_up(self, input_ids, sampling: Optional[SamplingParams] = None, *, target_only: bool = True,
                stop_token_ids: Optional[Sequence[int]] = None) -> None:
        """A few tokens of speculative sampling (and of the target alone, with `target_only`) so
        one-time costs (allocations, kernel selection) stay out of the timings that follow."""
        self.generate(input_ids, sampling, max_new_tokens=8, stop_token_ids=stop_token_ids)
        if target_only:
            self.generate_autoregressive(input_ids, sampling, max_new_tokens=8, stop_token_ids=stop_token_ids)

    def generate_autoregressive(self, input_ids, sampling: Optional[SamplingParams] = None,
                                max_new_tokens: int = 256, stop_token_ids: Optional[Sequence[int]] = None,
                                seed: int = 0, on_tokens: Optional[Callable[[List[int]], None]] = None
                                ) -> GenerationOutput:
        """The target alone, with the same filter (`sample_autoregressive`): the speed-up baseline."""
        return sample_autoregressive(self.target, input_ids, sampling, max_new_tokens, stop_token_ids, seed,
                                     on_tokens)


@torch.inference_mode()
def sample_autoregressive(target: TargetAdapter, input_ids, sampling: Optional[SamplingParams] = None,
                          max_new_tokens: int = 256, stop_token_ids: Optional[Sequence[int]] = None, seed: int = 0,
                          on_tokens: Optional[Callable[[List[int]], None]] = None,
                          on_probs: Optional[Callable[[torch.Tensor, int], None]] = None) -> GenerationOutput:
    """Sampling from the target alone, one token per pass, with the speculative path's filter and
    inverse-CDF rule; `on_probs(probs, token)` sees each token's filtered distribution."""
    sampling = sampling or SamplingParams()
    ids = prompt_tensor(input_ids, max_new_tokens, target.device)
    stops = set(stop_token_ids or ())
    generator = torch.Generator().manual_seed(seed)
    cache = target.new_cache()
    logits, _ = target.forward(ids, cache, hidden_states=False, last_logits_only=True)
    generated = []
    while True:
        token = sample_from_logits(logits[0, -1], sampling, generator, on_probs)
        generated.append(token)
        if on_tokens:
            on_tokens([token])
        if token in stops or len(generated) >= max_new_tokens:
            break
        logits, _ = target.forward(torch.tensor([[token]], device=ids.device), cache, hidden_states=False)
    stopped = bool(stops) and generated[-1] in stops
    return GenerationOutput(generated, stopped, [])
