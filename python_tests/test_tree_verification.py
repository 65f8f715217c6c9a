"""Trie verification (verify="tree", dblast_ext.trie): the trie, the tree-masked target pass,
the kept cache, and the losslessness of the walk on tiny random Qwen3 / Llama targets."""
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from dblast_ext import trie as trie_module  # noqa: E402
from dblast_ext.decoding import SamplingParams, SpeculativeDecoder  # noqa: E402
from dblast_ext.trie import TrieWalk, build_trie  # noqa: E402
from decoding_cases import (MASK, PROMPT, SMALL_PROMPT, SMALL_VOCAB, exact_prefix_joint, hf_greedy,  # noqa: E402
                            make_decoder, oracle_decoder)
from losslessness import chi_square_pvalue  # noqa: E402
from tiny_models import tiny_target  # noqa: E402


# --- the trie ----------------------------------------------------------------------------------

def test_branches_sharing_a_prefix_share_its_nodes():
    trie = build_trie([[5, 6, 7], [5, 6, 8], [5, 9, 7], [4, 6, 7]], [0.4, 0.3, 0.2, 0.1])
    # distinct prefixes: 5, 4 | 56, 59, 46 | 567, 568, 597, 467
    assert trie.num_nodes == 9
    assert trie.tokens[1:] == [5, 4, 6, 9, 6, 7, 8, 7, 7]
    assert trie.depths == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert all(trie.parents[r] < r for r in range(1, 10))  # parents before children
    node_56 = trie.children[trie.children[0][5]][6]
    assert trie.branches[node_56] == [0, 1]
    assert trie.mass[node_56] == pytest.approx(0.7)
    assert set(trie.children[node_56]) == {7, 8}


def test_identical_branches_make_one_path():
    trie = build_trie([[1, 2, 3]] * 4, [0.25] * 4)
    assert trie.num_nodes == 3 and trie.branches[3] == [0, 1, 2, 3]


@pytest.mark.parametrize("budget", [1, 2, 4, 6])
def test_a_node_budget_keeps_the_heaviest_nodes_and_their_ancestors(budget):
    branches, prior = [[5, 6, 7], [5, 6, 8], [5, 9, 7], [4, 6, 7]], [0.4, 0.3, 0.2, 0.1]
    full = build_trie(branches, prior)
    kept = build_trie(branches, prior, max_nodes=budget)
    assert kept.num_nodes == budget
    prefixes = {}
    for r in range(1, len(kept.tokens)):
        assert 0 <= kept.parents[r] < r
        prefixes[r] = prefixes.get(kept.parents[r], ()) + (kept.tokens[r],)
    full_prefix = {}
    for r in range(1, len(full.tokens)):
        full_prefix[r] = full_prefix.get(full.parents[r], ()) + (full.tokens[r],)
    masses = sorted((full.mass[r] for r in full_prefix), reverse=True)
    kept_masses = sorted((kept.mass[r] for r in prefixes), reverse=True)
    assert kept_masses == masses[:budget]
    assert set(prefixes.values()) <= set(full_prefix.values())


def test_the_mask_shows_each_row_its_ancestors_and_the_context():
    trie = build_trie([[5, 6], [5, 7], [4, 6]], [0.5, 0.3, 0.2])
    mask = trie.attention_mask(3, torch.float32, "cpu")[0, 0]
    visible = mask == 0
    assert visible[:, :3].all()
    own = visible[:, 3:]
    for r in range(len(trie.tokens)):
        ancestors = set()
        a = r
        while a >= 0:
            ancestors.add(a)
            a = trie.parents[a]
        assert {c for c in range(len(trie.tokens)) if own[r, c]} == ancestors
    assert (mask[~visible] == torch.finfo(torch.float32).min).all()


def test_the_walk_descends_on_children_and_stops_on_another_token():
    trie = build_trie([[5, 6, 7], [5, 9, 8]], [0.6, 0.4])
    row5 = trie.children[0][5]
    row59 = trie.children[row5][9]
    drawn = [0] * len(trie.tokens)
    drawn[0], drawn[row5], drawn[row59] = 5, 9, 3  # accepts 5, 9, then draws 3 (not a child)
    probs = [[0.5] * max(1, len(c)) for c in trie.children]
    walk = trie.walk(drawn, probs)
    assert walk.tokens == [5, 9, 3] and walk.rows == [0, row5, row59] and walk.branches == [1]
    # each node's reach: the product of the child probabilities along its path
    assert walk.expected_accepted == pytest.approx(0.5 + 2 * 0.25 + 2 * 0.125)


# --- the target pass over a trie ---------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_tree_pass_gives_every_node_the_logits_of_its_own_path(family, attention):
    target = tiny_target(family, vocab_size=100, layers=3)
    target.config._attn_implementation = attention
    from dblast_ext.target import TargetAdapter
    adapter = TargetAdapter(target, [0, 2])
    trie = build_trie([[11, 12, 13], [11, 14, 15], [16, 12, 13]], [0.5, 0.3, 0.2])
    trie.tokens[0] = PROMPT[-1]
    context = PROMPT[:-1]
    with torch.no_grad():
        cache = adapter.new_cache()
        adapter.forward(torch.tensor([context]), cache)
        logits, features = adapter.forward_tree(torch.tensor([trie.tokens]), cache, trie.positions(len(context), "cpu"),
                                                trie.attention_mask(len(context), torch.float32, "cpu"))
        for r in range(len(trie.tokens)):
            path, a = [], r
            while a >= 0:
                path.insert(0, trie.tokens[a])
                a = trie.parents[a]
            plain = target(torch.tensor([context + path]), output_hidden_states=True)
            torch.testing.assert_close(logits[0, r], plain.logits[0, -1], rtol=1e-4, atol=1e-4)
            expected = torch.cat([plain.hidden_states[1][0, -1], plain.hidden_states[3][0, -1]])
            torch.testing.assert_close(features[0, r], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_keeping_the_walked_path_leaves_the_cache_of_the_committed_tokens(family):
    target = tiny_target(family, vocab_size=100, layers=3)
    from dblast_ext.target import TargetAdapter
    adapter = TargetAdapter(target, [0, 2])
    trie = build_trie([[11, 12, 13], [11, 14, 15], [16, 12, 13]], [0.5, 0.3, 0.2])
    trie.tokens[0] = PROMPT[-1]
    context = PROMPT[:-1]
    row11 = trie.children[0][11]
    row14 = trie.children[row11][14]
    with torch.no_grad():
        cache = adapter.new_cache()
        adapter.forward(torch.tensor([context]), cache)
        adapter.forward_tree(torch.tensor([trie.tokens]), cache, trie.positions(len(context), "cpu"),
                             trie.attention_mask(len(context), torch.float32, "cpu"))
        adapter.keep_rows(cache, len(context), torch.tensor([0, row11, row14]))
        assert cache.get_seq_length() == len(context) + 3
        after, _ = adapter.forward(torch.tensor([[77]]), cache)
        plain = target(torch.tensor([context + [PROMPT[-1], 11, 14, 77]])).logits[0, -1]
    torch.testing.assert_close(after[0, -1], plain, rtol=1e-4, atol=1e-4)


# --- the decode loop ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("branches,block_size", [(2, 4), (4, 4), (4, 16)])
def test_greedy_output_equals_the_targets_own(tmp_path, family, branches, block_size):
    dec = make_decoder(tmp_path, family, branches, block_size, verify="tree")
    expected = hf_greedy(dec.target.model, PROMPT, 30)
    assert dec.generate(PROMPT, SamplingParams(temperature=0.0), max_new_tokens=30).token_ids == expected


@pytest.mark.parametrize("branches,block_size", [(2, 4), (4, 8)])
def test_greedy_output_equals_the_targets_own_when_drafts_are_accepted(tmp_path, branches, block_size):
    dec = make_decoder(tmp_path, "qwen3", branches, block_size)
    expected = hf_greedy(dec.target.model, PROMPT, 40)
    dec, oracle = oracle_decoder(dec, branches, PROMPT, verify="tree")
    out = dec.generate(PROMPT, SamplingParams(temperature=0.0), max_new_tokens=40, on_tokens=oracle.on_tokens)
    assert out.token_ids == expected
    accepted = [c.num_accepted for c in out.cycles[:-1]]
    assert block_size - 1 in accepted
    assert all(c.tree_nodes >= block_size - 1 for c in out.cycles)


def test_a_node_budget_bounds_the_nodes_scored(tmp_path):
    dec = make_decoder(tmp_path, "qwen3", 4, 8)
    dec, oracle = oracle_decoder(dec, 4, PROMPT, verify="tree", max_tree_nodes=9)
    out = dec.generate(PROMPT, SamplingParams(temperature=0.0), max_new_tokens=30, on_tokens=oracle.on_tokens)
    assert max(c.tree_nodes for c in out.cycles) == 9
    assert out.token_ids == hf_greedy(dec.target.model, PROMPT, 30)


@pytest.mark.parametrize("kwargs,message", [
    (dict(verify="trie"), "verify must be one of"),
    (dict(verify="branch", max_tree_nodes=4), "max_tree_nodes"),
    (dict(verify="tree", max_tree_nodes=0), "max_tree_nodes"),
])
def test_bad_tree_settings_fail_clearly(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_decoder(tmp_path, branches=2, **kwargs)


def test_kernels_and_reference_paths_give_the_same_tokens(tmp_path):
    dec = make_decoder(tmp_path, branches=4, verify="tree")
    runs = []
    for use_kernels in (True, False):
        dec.use_kernels = use_kernels
        runs.append(dec.generate(PROMPT, SamplingParams(1.0, 20, 0.9), max_new_tokens=30, seed=5).token_ids)
    assert runs[0] == runs[1]


def descend_on_any_draw(self, drawn, child_probs):
    """A planted bug: after a draw that is not a child, descend to the first child anyway (and
    commit that child's token), as a walk that trusted the drafter would."""
    tokens, rows, row = [], [0], 0
    while True:
        token = int(drawn[row])
        child = self.children[row].get(token)
        if child is None and self.children[row]:
            token, child = next(iter(self.children[row].items()))
        tokens.append(token)
        if child is None:
            break
        rows.append(child)
        row = child
    return TrieWalk(tokens, rows, list(self.branches[rows[-1]]), 0.0)


def committed_joint_counts(branches, sampling, samples, length=4, block_size=4):
    """Counts of the first `length` committed tokens over `samples` seeds, with the oracle
    proposer (drafts the target often accepts, branches splitting at different depths), and the
    target's exact joint."""
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        from pathlib import Path
        dec = make_decoder(Path(folder), branches=branches, block_size=block_size, vocab=SMALL_VOCAB, mask=MASK,
                           layers=2, target_layer_ids=(0, 1))
    with torch.no_grad():  # a peaked target (top token ~0.6): drafts get accepted, deep nodes get reached
        dec.target.model.lm_head.weight.mul_(12.0)
    exact = exact_prefix_joint(dec.target.model, SMALL_PROMPT, sampling, length)
    counts = np.zeros_like(exact)
    accepted = []
    for seed in range(samples):
        tree_dec, oracle = oracle_decoder(dec, branches, SMALL_PROMPT, verify="tree")
        out = tree_dec.generate(SMALL_PROMPT, sampling, max_new_tokens=max(length, block_size + 1), seed=seed,
                                on_tokens=oracle.on_tokens)
        assert oracle.prefix == SMALL_PROMPT + out.token_ids
        counts[tuple(out.token_ids[:length])] += 1
        accepted.append(out.cycles[0].num_accepted)
    return counts, exact, np.array(accepted)


def assert_follows(counts, exact, samples):
    length = counts.ndim
    assert counts[exact == 0].sum() == 0
    assert chi_square_pvalue(counts.ravel(), exact.ravel() * samples) > 1e-3
    for position in range(length):  # each committed position's marginal
        axes = tuple(a for a in range(length) if a != position)
        assert chi_square_pvalue(counts.sum(axes), exact.sum(axes) * samples) > 1e-3, position


FULL = pytest.mark.slow


@pytest.mark.parametrize("branches,sampling,samples", [
    (2, SamplingParams(1.0, 0, 1.0), 400),
    (4, SamplingParams(1.0, 6, 0.9), 400),
    pytest.param(2, SamplingParams(1.0, 6, 0.9), 2000, marks=FULL),
    pytest.param(4, SamplingParams(1.0, 0, 1.0), 2000, marks=FULL),
    pytest.param(4, SamplingParams(0.7, 6, 0.9), 2000, marks=FULL),
])
def test_committed_tokens_follow_the_targets_distribution(branches, sampling, samples):
    counts, exact, accepted = committed_joint_counts(branches, sampling, samples)
    # the walk must reach the deepest nodes often, or the test would check little
    assert np.mean(accepted == 3) > 0.05
    assert_follows(counts, exact, samples)


def test_a_walk_descending_on_a_non_child_fails_the_distribution_test(monkeypatch):
    monkeypatch.setattr(trie_module.DraftTrie, "walk", descend_on_any_draw)
    counts, exact, _ = committed_joint_counts(4, SamplingParams(1.0, 0, 1.0), 400)
    with pytest.raises(AssertionError):
        assert_follows(counts, exact, 400)


def test_more_tokens_per_pass_than_the_branch_rule_on_the_same_proposals(tmp_path):
    """Trie verification accepts at least as much as greedy-branch verification from the same
    proposal (its chance to descend is the target mass of all children), and more on average
    with the oracle's branches splitting at different depths. Compared exactly, not by
    sampling: a cycle record's expected accepted length is that of its proposal, which the
    oracle fixes for a given prefix; the branch rule's is averaged over its K branches by the
    prior (every branch occurs among the seeds). The prior favours the branch that swaps the
    first token for the runner-up, so the branch rule's proposal underweights the target's top
    token, which the trie still descends on with the target's full mass."""
    prior = torch.tensor([[0.1, 0.6, 0.2, 0.1]])
    dec = make_decoder(tmp_path, branches=4, block_size=4, vocab=SMALL_VOCAB, mask=MASK, layers=2,
                       target_layer_ids=(0, 1))
    with torch.no_grad():  # a peaked target (top token about 0.7): more than the prior gives the branches proposing it
        dec.target.model.lm_head.weight.mul_(30.0)
    gains = []
    for last in range(SMALL_VOCAB - 1):  # the mask id is never committed
        prefix = SMALL_PROMPT + [last]
        tree_dec, oracle = oracle_decoder(dec, 4, prefix, verify="tree")
        oracle.prior = prior
        tree_record = tree_dec.first_cycle(prefix, SamplingParams(1.0), seed=0)
        tree = tree_record.expected_accepted
        per_branch = {}
        for seed in range(60):
            branch_dec, oracle = oracle_decoder(dec, 4, prefix, verify="branch")
            oracle.prior = prior
            record = branch_dec.first_cycle(prefix, SamplingParams(1.0), seed=seed)
            per_branch[record.branch] = record.expected_accepted
        assert sorted(per_branch) == [0, 1, 2, 3]
        branch = sum(record.prior[z] * expected for z, expected in per_branch.items())
        assert tree >= branch - 1e-6, (prefix, tree, branch)
        # the trie pass's own same-context figure for the branch rule is that value (up to float32
        # logits computed over the trie rather than one branch at a time)
        assert tree_record.branch_rule_expected == pytest.approx(branch, abs=1e-5)
        gains.append(tree - branch)
    assert np.mean(gains) > 0.5, gains


def test_the_walk_gives_the_branch_rules_expected_length_from_the_same_probabilities():
    """By hand: branches [5, 6] and [5, 9] with prior 0.6 / 0.4, the target's probability 0.5
    for every child. The branch rule proposes 5 with q 1 (accepted with 0.5), then 6 with q 0.6
    or 9 with q 0.4, each accepted with min(1, 0.5 / q): reach 0.5 * min(0.6, 0.5) + 0.5 *
    min(0.4, 0.5). A node budget leaves nodes unscored, so no figure then."""
    trie = build_trie([[5, 6], [5, 9]], [0.6, 0.4])
    probs = [[0.5] * max(1, len(c)) for c in trie.children]
    walk = trie.walk([0] * len(trie.tokens), probs)
    assert walk.branch_rule_expected == pytest.approx(0.5 + 0.5 * 0.5 + 0.5 * 0.4)
    assert walk.expected_accepted == pytest.approx(0.5 + 2 * 0.25)
    cut = build_trie([[5, 6], [5, 9]], [0.6, 0.4], max_nodes=2)
    assert cut.walk([0] * len(cut.tokens), [[0.5] * max(1, len(c)) for c in cut.children]).branch_rule_expected is None


def test_a_proposal_outside_the_vocabulary_is_refused_before_the_target_runs(tmp_path):
    dec = make_decoder(tmp_path, branches=2, verify="tree")

    class Bad:
        block_size, num_branches, target_layer_ids = 4, 2, dec.proposer.target_layer_ids

        def new_cache(self, rows, capacity, device):
            return dec.proposer.new_cache(rows, capacity, device)

        def propose(self, anchors, context, cache, context_lens=None):
            from dblast_ext.proposer import Proposal
            return Proposal(torch.full((1, 2, 3), 10_000), torch.tensor([[0.5, 0.5]]))

    bad = SpeculativeDecoder(dec.target.model, proposer=Bad(), verify="tree")
    with pytest.raises(ValueError, match="branch_tokens has entries outside"):
        bad.generate(PROMPT, SamplingParams(1.0), max_new_tokens=8)
