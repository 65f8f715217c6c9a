"""The speculative decode loop on tiny random Qwen3 / Llama targets (built from configs)."""

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from dblast_ext import load_drafter  # noqa: E402
from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder  # noqa: E402
from dblast_ext.drafting.proposer import Proposal  # noqa: E402
from dblast_ext import reference  # noqa: E402
from decoding_cases import (MASK, PROMPT, SMALL_PROMPT, SMALL_VOCAB, CountingCache, exact_first_two,  # noqa: E402
                            exact_prefix_joint, hf_greedy, make_decoder, oracle_decoder)
from losslessness import chi_square_pvalue  # noqa: E402
from tiny_models import lm_head_rows, tiny_target, write_dflash_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("branches", [1, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_output_equals_the_targets_own(tmp_path, family, branches, block_size):
    dec = make_decoder(tmp_path, family, branches, block_size)
    expected = hf_greedy(dec.target.model, PROMPT, 40)
    out = dec.generate(PROMPT, SamplingParams(temperature=0.0), max_new_tokens=40)
    assert out.token_ids == expected
    assert not out.stopped_by_eos
    committed = sum(c.num_accepted + 1 for c in out.cycles)
    assert committed + 1 == len(out.token_ids)  # the first token comes from the prefill
    assert all(0 <= c.num_accepted <= block_size - 1 for c in out.cycles)


def test_greedy_output_equals_the_targets_own_on_each_device(tmp_path, device):
    dec = make_decoder(tmp_path, "qwen3", 4, 16)
    dec.target.model.to(device)
    dec.drafter.to(device)
    expected = hf_greedy(dec.target.model, PROMPT, 40)
    assert dec.generate(PROMPT, SamplingParams(temperature=0.0), max_new_tokens=40).token_ids == expected
    # sampled runs on the device follow the seed too
    sampling = SamplingParams(1.0, 20, 0.95)
    runs = [dec.generate(PROMPT, sampling, max_new_tokens=30, seed=5).token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 30


def test_greedy_stops_at_a_stop_token_like_the_target(tmp_path):
    dec = make_decoder(tmp_path, "qwen3", 4, 4)
    full = hf_greedy(dec.target.model, PROMPT, 30)
    stop = full[12]
    expected = hf_greedy(dec.target.model, PROMPT, 30, eos=stop)
    out = dec.generate(PROMPT, SamplingParams(temperature=0.0), max_new_tokens=30, stop_token_ids=[stop])
    assert out.token_ids == expected and out.token_ids[-1] == stop and out.stopped_by_eos


class ScriptedProposer:
    """One branch drafting a known continuation of the prompt: after the anchor at response
    position i it proposes positions i + 1 .. i + b. At T = 0 against the target's own greedy
    continuation every draft is accepted, so every cycle commits a whole block."""

    num_branches = 1

    def __init__(self, continuation, prompt_length, block_size, target_layer_ids):
        self.continuation, self.prompt_length = list(continuation), prompt_length
        self.block_size, self.target_layer_ids = block_size, list(target_layer_ids)

    def new_cache(self, rows, capacity, device):
        return CountingCache()

    def propose(self, anchors, context, cache, context_lens=None):
        cache.length += context.shape[1] if context_lens is None else int(context_lens[0])  # committed before the anchor
        i = cache.length - self.prompt_length
        drafts = (self.continuation[i + 1 : i + self.block_size] + [0] * self.block_size)[: self.block_size - 1]
        return Proposal(torch.tensor([[drafts]], device=anchors.device), torch.ones(1, 1, device=anchors.device))


@pytest.mark.parametrize("stop_at", [None, 7])
def test_a_cut_cycle_counts_only_the_tokens_kept(tmp_path, stop_at):
    """Cycles that accept the whole block (a proposer drafting the target's greedy path), cut
    by the token limit (9 -> 10) or by a stop token: the last cycle counts what was kept."""
    target = make_decoder(tmp_path, "qwen3", 1, 4).target.model
    greedy = hf_greedy(target, PROMPT, 30)
    dec = SpeculativeDecoder(target, proposer=ScriptedProposer(greedy, len(PROMPT), 4, (1, 4)), controller="off")
    stops, kept = None, 10
    if stop_at:  # the first token from the stop_at-th on that did not occur before it
        kept = next(k for k in range(stop_at - 1, len(greedy)) if greedy[k] not in greedy[:k]) + 1
        stops = [greedy[kept - 1]]
    out = dec.generate(PROMPT, SamplingParams(temperature=0.0), max_new_tokens=10, stop_token_ids=stops)
    assert out.token_ids == greedy[: min(kept, 10)]
    assert 1 + sum(c.num_accepted + 1 for c in out.cycles) == len(out.token_ids)
    full, last = divmod(len(out.token_ids) - 1, 4)  # cycles after the prefill's token commit 4 tokens each
    assert [c.num_accepted for c in out.cycles] == [3] * full + ([last - 1] if last else [])


def test_a_proposer_missing_part_of_the_protocol_is_refused(tmp_path):
    target = make_decoder(tmp_path).target.model

    class NoPropose:
        block_size, num_branches, target_layer_ids = 4, 1, [1, 4]

        def new_cache(self, rows, capacity, device):
            return CountingCache()

    with pytest.raises(TypeError, match="propose"):
        SpeculativeDecoder(target, proposer=NoPropose())
    with pytest.raises(ValueError, match="exactly one"):
        SpeculativeDecoder(target)
    greedy = ScriptedProposer([], len(PROMPT), 4, (1, 9))  # the target has 6 layers
    with pytest.raises(ValueError, match="target_layer_ids"):
        SpeculativeDecoder(target, proposer=greedy)
    greedy.target_layer_ids = [1, 4]
    with pytest.raises(ValueError, match="proposer"):  # a drafter's setting, ignored by a proposer otherwise
        SpeculativeDecoder(target, proposer=greedy, category_temperature=0.5)


def test_a_proposal_breaking_the_verifiers_contract_is_refused(tmp_path):
    """A foreign proposer's proposals are checked every cycle: a prior that does not sum to 1
    would make the verification inexact, so it fails instead of sampling."""
    target = make_decoder(tmp_path).target.model
    greedy = hf_greedy(target, PROMPT, 30)

    class HalfPrior(ScriptedProposer):
        def propose(self, anchors, context, cache, context_lens=None):
            tokens, prior = super().propose(anchors, context, cache, context_lens)
            return Proposal(tokens, prior * 0.5)

    dec = SpeculativeDecoder(target, proposer=HalfPrior(greedy, len(PROMPT), 4, (1, 4)), controller="off")  # the ops check values
    with pytest.raises(ValueError, match="branch_prior"):
        dec.generate(PROMPT, SamplingParams(temperature=1.0), max_new_tokens=8)


def test_use_kernels_switches_drafting_and_verifying_together(tmp_path):
    dec = make_decoder(tmp_path, branches=4)
    dec.use_kernels = False
    assert dec.proposer.use_kernels is False and dec.use_kernels is False
    with pytest.raises(ValueError, match="category_temperature"):
        dec.category_temperature = -1.0


def test_autoregressive_greedy_equals_the_targets_own(tmp_path):
    dec = make_decoder(tmp_path)
    assert dec.generate_autoregressive(PROMPT, SamplingParams(0.0), max_new_tokens=20).token_ids == \
        hf_greedy(dec.target.model, PROMPT, 20)


def test_prefills_project_only_the_last_position(tmp_path):
    dec = make_decoder(tmp_path, branches=4, block_size=4)
    rows = lm_head_rows(dec.target.model)
    dec.generate(PROMPT, SamplingParams(1.0), max_new_tokens=9, seed=1)
    assert rows[0] == 1 and set(rows[1:]) == {4}  # prefill, then every verify pass: anchor + 3 drafts
    rows.clear()
    dec.generate_autoregressive(PROMPT, SamplingParams(1.0), max_new_tokens=5, seed=1)
    assert rows == [1] * 5
    rows.clear()
    dec.first_cycle(PROMPT, SamplingParams(1.0), seed=1)
    assert rows == [1, 4]  # the prefix pass, then the verify pass


def test_kernels_and_reference_paths_give_the_same_tokens(tmp_path):
    sampling = SamplingParams(temperature=1.0, top_k=20, top_p=0.95)
    a = make_decoder(tmp_path, branches=4, use_kernels=True).generate(PROMPT, sampling, max_new_tokens=30, seed=7)
    b = make_decoder(tmp_path, branches=4, use_kernels=False).generate(PROMPT, sampling, max_new_tokens=30, seed=7)
    assert a.token_ids == b.token_ids
    assert [c.num_accepted for c in a.cycles] == [c.num_accepted for c in b.cycles]


def test_same_seed_same_output(tmp_path):
    dec = make_decoder(tmp_path, branches=4)
    runs = [dec.generate(PROMPT, SamplingParams(1.0), max_new_tokens=25, seed=3).token_ids for _ in range(2)]
    assert runs[0] == runs[1]


# the fast tier runs every setting at a size that still fails a sampler ignoring the target or
# its filter; the slow tier (-m slow) runs them at full size, with the power for subtler errors
FULL = pytest.mark.slow


@pytest.mark.parametrize("branches,sampling,draft_vocab,samples", [  # with the test below: K {1, 4} x filters
    (1, SamplingParams(1.0, 6, 0.9), None, 600),
    (4, SamplingParams(1.0, 0, 1.0), None, 600),
    (4, SamplingParams(1.0, 6, 0.9), 6, 600),  # drafts from ids 0..5 only: the output is still the target's
    pytest.param(1, SamplingParams(1.0, 6, 0.9), None, 3000, marks=FULL),
    pytest.param(4, SamplingParams(1.0, 0, 1.0), None, 3000, marks=FULL),
    pytest.param(4, SamplingParams(1.0, 6, 0.9), 6, 3000, marks=FULL),
])
def test_first_two_tokens_follow_the_targets_distribution(tmp_path, branches, sampling, draft_vocab, samples):
    dec = make_decoder(tmp_path, branches=branches, block_size=4, vocab=SMALL_VOCAB, mask=MASK,
                       draft_vocab=draft_vocab)
    with torch.no_grad():  # far from uniform (top token ~0.16): a sampler ignoring the target fails at once
        dec.target.model.lm_head.weight.mul_(3.0)
    exact = exact_first_two(dec.target.model, sampling)
    counts = np.zeros((SMALL_VOCAB, SMALL_VOCAB))
    for seed in range(samples):
        tokens = dec.generate(SMALL_PROMPT, sampling, max_new_tokens=2, seed=seed).token_ids
        counts[tokens[0], tokens[1]] += 1
    assert counts[exact == 0].sum() == 0
    assert chi_square_pvalue(counts.ravel(), exact.ravel() * samples) > 1e-3
    # the second token's marginal: the verified one, with fewer cells and so more power
    assert chi_square_pvalue(counts.sum(0), exact.sum(0) * samples) > 1e-3


@pytest.mark.parametrize("branches,block_size", [(1, 4), (4, 4), (4, 16)])
def test_greedy_output_equals_the_targets_own_when_drafts_are_accepted(tmp_path, device, branches, block_size):
    """With drafts the target accepts (OracleProposer), whole blocks and partial ones get
    committed, so the caches are cropped after accepted drafts and the accepted tokens'
    features feed the next drafter pass: the output must still be the target's greedy one."""
    dec = make_decoder(tmp_path, "qwen3", branches, block_size)
    dec.target.model.to(device)
    dec.drafter.to(device)
    expected = hf_greedy(dec.target.model, PROMPT, 40)
    dec, oracle = oracle_decoder(dec, branches, PROMPT)
    out = dec.generate(PROMPT, SamplingParams(temperature=0.0), max_new_tokens=40, on_tokens=oracle.on_tokens)
    assert out.token_ids == expected
    accepted = [c.num_accepted for c in out.cycles[:-1]]  # the last cycle may be cut by the limit
    assert block_size - 1 in accepted  # a whole block committed at least once
    if branches > 1:  # a runner-up branch drafted: a block cut short too
        assert any(n < block_size - 1 for n in accepted)


@pytest.mark.parametrize("branches,block_size,sampling,samples", [
    (4, 3, SamplingParams(1.0, 0, 1.0), 400),   # b = 2: the fourth token is often the bonus token
    (4, 4, SamplingParams(1.0, 6, 0.9), 400),   # b = 3: three verified positions in the first cycle
    (1, 4, SamplingParams(1.0, 0, 1.0), 400),
    pytest.param(4, 3, SamplingParams(1.0, 0, 1.0), 2000, marks=FULL),
    pytest.param(4, 4, SamplingParams(1.0, 6, 0.9), 2000, marks=FULL),
    pytest.param(1, 4, SamplingParams(1.0, 0, 1.0), 2000, marks=FULL),
])
def test_committed_tokens_follow_the_targets_distribution_at_every_position(tmp_path, branches, block_size,
                                                                            sampling, samples):
    dec = make_decoder(tmp_path, branches=branches, block_size=block_size, vocab=SMALL_VOCAB, mask=MASK, layers=2,
                       target_layer_ids=(0, 1))
    with torch.no_grad():  # a peaked target (top token ~0.6): drafts get accepted, deep positions get reached
        dec.target.model.lm_head.weight.mul_(12.0)
    length = 4
    exact = exact_prefix_joint(dec.target.model, SMALL_PROMPT, sampling, length)
    counts = np.zeros_like(exact)
    accepted = []
    for seed in range(samples):
        oracle_dec, oracle = oracle_decoder(dec, branches, SMALL_PROMPT)
        # room for the prefill's token and a whole first cycle (b + 1), so the first cycle is never
        # cut by the limit: its count is the verifier's
        out = oracle_dec.generate(SMALL_PROMPT, sampling, max_new_tokens=max(length, block_size + 1), seed=seed,
                                  on_tokens=oracle.on_tokens)
        assert oracle.prefix == SMALL_PROMPT + out.token_ids
        counts[tuple(out.token_ids[:length])] += 1
        accepted.append(out.cycles[0].num_accepted)
    # the drafts must reach every position often, or the test would check little
    assert np.mean(np.array(accepted) == block_size - 1) > 0.05
    assert counts[exact == 0].sum() == 0
    assert chi_square_pvalue(counts.ravel(), exact.ravel() * samples) > 1e-3
    for position in range(1, length):  # each committed position's marginal, more power per cell
        axes = tuple(a for a in range(length) if a != position)
        assert chi_square_pvalue(counts.sum(axes), exact.sum(axes) * samples) > 1e-3, position


@pytest.mark.parametrize("kwargs,message", [
    (dict(input_ids=[]), "empty"), (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_generation_arguments_fail_clearly(tmp_path, kwargs, message):
    dec = make_decoder(tmp_path)
    args = dict(input_ids=PROMPT, max_new_tokens=5)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        dec.generate(**args)


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=float("nan")), "top_p"),
])
def test_a_bad_filter_fails_before_any_sampling(kwargs, message):
    # target-only sampling never reaches the kernels' checks: the filter is checked when made
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    assert SamplingParams(temperature=0.0, top_k=20, top_p=1.0).top_p == 1.0  # 1: off (above 1: an error)


def test_drafter_target_mismatch_fails_clearly(tmp_path):
    target = tiny_target("qwen3", layers=3)  # the drafter reads layers 1 and 4
    drafter = load_drafter(write_dflash_checkpoint(tmp_path / "d"))
    with pytest.raises(ValueError, match="target_layer_ids"):
        SpeculativeDecoder(target, drafter)


@pytest.mark.parametrize("branches", [1, 4])
@pytest.mark.parametrize("use_kernels", [True, False])
def test_drafts_are_the_argmax_over_the_draft_vocabulary(tmp_path, device, branches, use_kernels):
    """Each branch drafts the best-scoring token among the shortlist's ids (ties: the lowest
    id), i.e. the full LM head's logits with every other id ruled out."""
    dec = make_decoder(tmp_path, branches=branches, block_size=8, draft_vocab=[40, 3, 77, 12, 5, 91, 60, 18],
                       use_kernels=use_kernels)
    dec.target.model.to(device)
    dec.drafter.to(device)
    assert dec.draft_ids.tolist() == [3, 5, 12, 18, 40, 60, 77, 91]
    hidden = torch.randn(1, 8, dec.drafter.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(device)
    drafter = dec.drafter
    expander = (drafter.branch_expander.weight, drafter.branch_expander.bias) if branches > 1 else (None, None)
    states = reference.branch_states(hidden[0, 1:].double(), *(None if e is None else e.double() for e in expander))
    logits = states @ dec.target.lm_head_weight.double().T  # [b, K, V]
    outside = torch.ones(logits.shape[-1], dtype=torch.bool, device=device)
    outside[dec.draft_ids.to(device)] = False
    expected = logits.masked_fill(outside, float("-inf")).argmax(-1).T  # [K, b]
    tokens = dec.proposer.draft_tokens(hidden)
    assert tokens.shape == (1, branches, 7) and tokens.device.type == device
    assert torch.equal(tokens[0].cpu(), expected.cpu())
    full = dec.drafter.branch_tokens(hidden, dec.target.lm_head_weight, dec.target.vocab_size)
    assert not torch.equal(full, tokens)  # the shortlist changed some drafts: the test is not vacuous


def test_the_draft_vocabulary_keeps_the_end_of_sequence_ids(tmp_path):
    dec = make_decoder(tmp_path, draft_vocab=10)
    assert dec.draft_ids.tolist() == list(range(10))  # the tiny target declares none
    target = dec.target.model
    target.generation_config.eos_token_id = [61, 2]
    assert SpeculativeDecoder(target, dec.drafter, draft_vocab=10).draft_ids.tolist() == list(range(10)) + [61]


@pytest.mark.parametrize("branches", [1, 4])
def test_greedy_output_with_a_draft_vocabulary_equals_the_targets_own(tmp_path, branches):
    dec = make_decoder(tmp_path, branches=branches, block_size=8, draft_vocab=30)
    expected = hf_greedy(dec.target.model, PROMPT, 40)
    assert dec.generate(PROMPT, SamplingParams(temperature=0.0), max_new_tokens=40).token_ids == expected


def test_the_gathered_head_follows_the_model_to_another_dtype(tmp_path):
    dec = make_decoder(tmp_path, branches=4, block_size=4, draft_vocab=20)
    assert len(dec.generate(PROMPT, SamplingParams(temperature=0.0), max_new_tokens=12).token_ids) == 12
    assert dec.proposer._draft_head[0][2] == torch.float32
    dec.target.model.to(torch.bfloat16)
    dec.drafter.to(torch.bfloat16)
    hidden = torch.randn(1, 4, dec.drafter.config.hidden_size, dtype=torch.bfloat16)
    assert dec.proposer.draft_tokens(hidden).max() < 20
    # regathered from the bfloat16 head (on a CPU kept as float32, which the kernel computes in)
    assert dec.proposer._draft_head[0][2] == torch.bfloat16
    rows = dec.target.lm_head_weight.index_select(0, dec.draft_ids)
    assert torch.equal(dec.proposer._draft_head[2], rows.float() if rows.device.type == "cpu" else rows)
    # and the drafts are those of the bfloat16 rows themselves (the upcast is exact)
    assert torch.equal(dec.proposer.draft_tokens(hidden), dec.draft_ids[dec.drafter.branch_tokens(hidden, rows, len(rows))])
    # the ranking (trie verification) multiplies by the rows in their own dtype, not the upcast copy
    assert dec.proposer._draft_head[3].dtype == torch.bfloat16 and torch.equal(dec.proposer._draft_head[3], rows)
    local, probs = dec.drafter.ranked_branch_tokens(hidden, rows, len(rows), 3)
    tokens, ranked_probs = dec.proposer.ranked_tokens(hidden, 3)
    assert torch.equal(tokens, dec.draft_ids[local]) and torch.equal(ranked_probs, probs)
    expected = hf_greedy(dec.target.model, PROMPT, 12)
    assert dec.generate(PROMPT, SamplingParams(temperature=0.0), max_new_tokens=12).token_ids == expected



def test_the_kept_branch_expander_follows_the_weights(tmp_path):
    """The expander converted for the head's dtype is kept between cycles: a change of the
    weights (an optimizer step, a load) must reach the drafts, and keeping must not change them."""
    dec = make_decoder(tmp_path, branches=4, block_size=4, draft_vocab=20)
    drafter = dec.drafter
    rows = dec.target.lm_head_weight.index_select(0, dec.draft_ids).to(torch.bfloat16)
    hidden = torch.randn(2, 4, drafter.config.hidden_size)

    def fresh():  # the ranking with the expander converted now, as before keeping
        drafts = hidden[:, 1:].reshape(-1, hidden.shape[-1]).to(rows.dtype)
        states = reference.branch_states(drafts, drafter.branch_expander.weight.to(rows.dtype),
                                         drafter.branch_expander.bias.to(rows.dtype)).to(rows.dtype)
        return (states @ rows.T).float().topk(3, dim=-1).indices

    with torch.no_grad():
        for _ in range(2):  # converted, then kept
            local, _ = drafter.ranked_branch_tokens(hidden, rows, len(rows), 3)
            assert torch.equal(local, drafter._per_branch(fresh(), hidden))
        drafter.branch_expander.weight.mul_(-3.0)  # in place: same storage, a new version
        changed, _ = drafter.ranked_branch_tokens(hidden, rows, len(rows), 3)
        assert torch.equal(changed, drafter._per_branch(fresh(), hidden))
        assert not torch.equal(changed, local)
