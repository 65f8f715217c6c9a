"""Decoders, proposers and exact distributions shared by the decode-loop tests (test_decoding,
test_tree_verification): tiny random targets with a DFlash-format drafter, an oracle proposer
whose drafts the target often accepts, and the target's exact joint over a few tokens."""
import weakref

import numpy as np
import torch

from dblast_ext import load_drafter, reference
from dblast_ext.decoding.decoder import SpeculativeDecoder
from dblast_ext.drafting.proposer import Proposal, RankedProposal
from dblast_ext.target.ragged_cache import RaggedRows
from tiny_models import tiny_target, write_dflash_checkpoint

PROMPT = [3, 17, 42, 8, 25]


def make_decoder(tmp_path, family="qwen3", branches=1, block_size=4, vocab=100, mask=97, use_kernels=True,
                 category_temperature=1.0, layers=6, target_layer_ids=(1, 4), draft_vocab=None, device="cpu",
                 **decoder_kwargs):
    target = tiny_target(family, vocab_size=vocab, layers=layers).to(device)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    path = write_dflash_checkpoint(tmp_path / f"drafter-{block_size}-{mask}", block_size=block_size,
                                   dflash_config={"mask_token_id": mask, "target_layer_ids": list(target_layer_ids)})
    drafter = load_drafter(path, target=target, num_branches=branches if branches > 1 else None)
    if branches > 1:  # make the branches genuinely different
        torch.nn.init.normal_(drafter.branch_expander.weight, std=0.3, generator=torch.Generator().manual_seed(1))
    drafter.to(device)
    # every cycle verifies the whole block unless a test asks for a controller (test_adaptive.py)
    decoder_kwargs.setdefault("controller", "off")
    return SpeculativeDecoder(target, drafter, use_kernels=use_kernels, category_temperature=category_temperature,
                              draft_vocab=draft_vocab, **decoder_kwargs)


def ragged_prefill(adapter, prompts):
    """The prompts left-padded in one cache of `adapter` (a TargetAdapter), on its device, as
    generate_batch prefills them: (the RaggedRows layout, the cache, the features over the
    padded slots)."""
    layout = RaggedRows.left_padded([len(p) for p in prompts])
    cache = adapter.new_cache()
    ids, mask, positions = layout.prefill_inputs(prompts, adapter.device)
    _, features = adapter.forward(ids, cache, attention_mask=mask, position_ids=positions)
    return layout, cache, features


def hf_greedy(target, prompt, max_new_tokens, eos=None):
    ids = torch.tensor([prompt], device=target.device)
    out = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                          attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


class CountingCache:
    """A proposer cache that holds nothing but how many committed tokens it has seen."""

    def __init__(self):
        self.length = 0

    def crop(self, length):
        self.length = length


SMALL_VOCAB, MASK = 16, 15
SMALL_PROMPT = [3, 7, 1, 8, 5]


def exact_first_two(target, sampling):
    """p(x1, x2) of the target's filtered sampling after SMALL_PROMPT, straight from its logits."""
    with torch.no_grad():
        first = target(torch.tensor([SMALL_PROMPT])).logits[0, -1]
        p1 = reference.filter_target_probs(first, **sampling.kwargs())
        rows = torch.tensor([SMALL_PROMPT + [x] for x in range(SMALL_VOCAB)])
        second = target(rows).logits[:, -1]
        p2 = reference.filter_target_probs(second, **sampling.kwargs())
    return (p1[:, None] * p2).numpy()


def exact_prefix_joint(target, prompt, sampling, length):
    """p(x_1..x_length) of the target's filtered sampling after `prompt`, as a [V]*length
    array, from batched forwards over every prefix (fine for a 16-token vocabulary)."""
    joint = np.ones(())
    prefixes = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(length):
            probs = reference.filter_target_probs(target(prefixes).logits[:, -1], **sampling.kwargs()).numpy()
            joint = joint[..., None] * probs.reshape(joint.shape + (SMALL_VOCAB,))
            prefixes = torch.cat([prefixes.repeat_interleave(SMALL_VOCAB, 0),
                                  torch.arange(SMALL_VOCAB).repeat(prefixes.shape[0])[:, None]], dim=1)
    return joint


_ORACLE_DRAFTS = weakref.WeakKeyDictionary()


class OracleProposer:
    """A proposer with drafts the target often accepts, so that deep positions, the bonus
    token and the consistent-set bookkeeping all get exercised. Branch 0 is the target's
    greedy path from the committed prefix (which it follows through the decoder's `on_tokens`);
    branch z > 0 is that path with position (z - 1) mod b swapped for the runner-up token (so
    branches share prefixes and split at different depths). The prior is fixed and far from
    uniform."""

    def __init__(self, decoder, branches, prompt):
        self.target, self.num_branches, self.prefix = decoder.target.model, branches, list(prompt)
        self.block_size = decoder.proposer.block_size
        self.target_layer_ids = decoder.proposer.target_layer_ids
        self.device = decoder.target.device
        self.prior = torch.tensor([[0.45, 0.3, 0.15, 0.1][:branches]], device=self.device)
        self.prior /= self.prior.sum()

    def on_tokens(self, ids):
        self.prefix.extend(ids)

    def new_cache(self, rows, capacity, device):
        return CountingCache()

    def propose(self, anchors, context, cache, context_lens=None):
        cache.length += context.shape[1] if context_lens is None else int(context_lens[0])
        assert cache.length == len(self.prefix) - 1 and int(anchors[0]) == self.prefix[-1]
        return Proposal(self.draft_from_prefix(), self.prior.clone())

    def draft_from_prefix(self):
        """[1, K, b]: the greedy path after self.prefix and its runner-up variants (remembered per
        target, its weights' versions and the prefix: the distribution tests draft the same few
        prefixes for tens of thousands of seeds)."""
        if self.target not in _ORACLE_DRAFTS:
            _ORACLE_DRAFTS[self.target] = (list(self.target.parameters()), {})
        parameters, drafts_of = _ORACLE_DRAFTS[self.target]
        key = (tuple(p._version for p in parameters), tuple(self.prefix), self.num_branches, self.block_size,
               str(self.device))
        if key not in drafts_of:
            drafts_of[key] = (self._draft_from_prefix(), self.ranked)
        drafts, self.ranked = drafts_of[key]
        return drafts.clone()

    def _draft_from_prefix(self):
        num_draft = self.block_size - 1
        path, runner_up, self.ranked = list(self.prefix), [], []
        with torch.no_grad():
            for _ in range(num_draft):
                top = self.target(torch.tensor([path], device=self.device)).logits[0, -1].topk(4).indices.tolist()
                path.append(top[0])
                runner_up.append(top[1])
                self.ranked.append(top)   # the target's 4 likeliest after the greedy path so far
        greedy = path[len(self.prefix):]
        rows = [list(greedy) for _ in range(self.num_branches)]
        for z in range(1, self.num_branches):
            rows[z][(z - 1) % num_draft] = runner_up[(z - 1) % num_draft]
        return torch.tensor([rows], device=self.device)


class RankedOracleProposer(OracleProposer):
    """OracleProposer that also ranks tokens (a `RankedProposal`, for trie verification's
    extra leaves): at each position every branch ranks its own draft first, then the target's
    likeliest tokens after the greedy path, so that extra leaves are tokens the target often
    draws. Probabilities 0.5, 0.3, 0.15, 0.05 by rank."""

    PROBS = (0.5, 0.3, 0.15, 0.05)

    def propose(self, anchors, context, cache, context_lens=None):
        proposal = super().propose(anchors, context, cache, context_lens)
        drafts = proposal.branch_tokens[0].tolist()
        top = [[[draft] + [t for t in ranked if t != draft][:len(self.PROBS) - 1]
                for draft, ranked in zip(row, self.ranked)] for row in drafts]
        top_tokens = torch.tensor([top], device=self.device)
        top_probs = torch.tensor(self.PROBS, device=self.device).expand(top_tokens.shape).clone()
        return RankedProposal(proposal.branch_tokens, proposal.prior, top_tokens, top_probs)


def oracle_decoder(dec, branches, prompt, ranked=False, **decoder_kwargs):
    """`dec`'s target driven by an OracleProposer (a RankedOracleProposer with `ranked`), and
    that proposer."""
    oracle = (RankedOracleProposer if ranked else OracleProposer)(dec, branches, prompt)
    decoder_kwargs.setdefault("controller", "off")  # an oracle follows one response: no calibration runs
    return SpeculativeDecoder(dec.target.model, proposer=oracle, **decoder_kwargs), oracle


class RowsCache:
    """A batch proposer's cache: which prompts its rows are, and how many committed tokens
    each has seen."""

    def __init__(self, rows):
        self.rows, self.lengths = list(range(rows)), [0] * rows

    def select_rows(self, index):
        keep = index.tolist()
        self.rows, self.lengths = [self.rows[i] for i in keep], [self.lengths[i] for i in keep]


class BatchOracleProposer(OracleProposer):
    """OracleProposer for a batch of prompts (each row's drafts from its own committed prefix,
    followed through `on_tokens(row, ids)`), so that rows accept different numbers of drafts."""

    def __init__(self, decoder, branches, prompts):
        super().__init__(decoder, branches, [])
        self.prefixes = [list(p) for p in prompts]

    def on_tokens(self, row, ids):
        self.prefixes[row].extend(ids)

    def new_cache(self, rows, capacity, device):
        return RowsCache(rows)

    def propose(self, anchors, context, cache, context_lens=None):
        proposals = []
        for i, (row, new) in enumerate(zip(cache.rows, context_lens.tolist())):
            cache.lengths[i] += new
            assert cache.lengths[i] == len(self.prefixes[row]) - 1 and int(anchors[i]) == self.prefixes[row][-1]
            self.prefix = self.prefixes[row]
            proposals.append(self.draft_from_prefix())
        return Proposal(torch.cat(proposals), self.prior.expand(len(proposals), -1).clone())
