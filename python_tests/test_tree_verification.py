"""Trie verification (verify="tree", dblast_ext.decoding.trie): the trie, the tree-masked target pass,
the kept cache, and the losslessness of the walk on tiny random Qwen3 / Llama targets."""
import contextlib
import inspect
import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from dblast_ext.decoding import trie as trie_module  # noqa: E402
from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder  # noqa: E402
from dblast_ext import reference  # noqa: E402
from dblast_ext.decoding.decoder import TREE_EXTRA_LEAVES  # noqa: E402
from dblast_ext.decoding.trie import TrieWalk, add_alternative_leaves, build_trie, drafted_token_probs  # noqa: E402
from decoding_cases import (MASK, PROMPT, SMALL_PROMPT, SMALL_VOCAB, exact_prefix_joint, hf_greedy,  # noqa: E402
                            make_decoder, oracle_decoder)
from losslessness import chi_square_pvalue  # noqa: E402
from tiny_models import tiny_target  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


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


def test_a_node_budget_with_token_probabilities_keeps_the_likeliest_reached_nodes():
    """Scored by reach (prior x the product of the drafter's token probabilities along the path),
    the budget keeps the shallow node of a low-prior branch the drafter is sure of before the deep
    node of the heavy branch it doubts; by mass alone it keeps the heavy branch's path."""
    branches, prior = [[5, 6, 7], [4, 8, 9]], [0.7, 0.3]
    probs = [[0.5, 0.2, 0.9], [0.9, 0.9, 0.1]]
    # reach: 5: 0.35, 56: 0.07, 567: 0.063; 4: 0.27, 48: 0.243, 489: 0.0243
    by_reach = build_trie(branches, prior, max_nodes=3, token_probs=probs)
    assert sorted(by_reach.tokens[1:]) == [4, 5, 8]
    by_mass = build_trie(branches, prior, max_nodes=3)
    assert sorted(by_mass.tokens[1:]) == [5, 6, 7]
    assert build_trie(branches, prior, token_probs=probs).num_nodes == 6  # no budget: every node


def test_the_drafts_probabilities_are_read_where_the_ranking_put_them():
    """A proposer may rank a branch's draft anywhere among its m tokens, or not at all (then 0)."""
    drafts = [[5, 6], [7, 8]]
    top_tokens = [[[5, 1], [2, 6]], [[3, 4], [8, 7]]]
    top_probs = [[[0.6, 0.3], [0.5, 0.25]], [[0.7, 0.2], [0.4, 0.35]]]
    assert drafted_token_probs(drafts, top_tokens, top_probs) == [[0.6, 0.25], [0.0, 0.4]]


@pytest.mark.parametrize("seed", range(20))
def test_a_reach_scored_budget_keeps_every_kept_nodes_ancestors(seed):
    """Random branches sharing prefixes, probabilities with ties, zeros and ones: whatever the
    budget, the kept rows form a trie (each node's parent kept) of the budgeted size, its prefixes
    are the full trie's, and no dropped node scores above a kept one."""
    g = torch.Generator().manual_seed(seed)
    k, b = 4, 5
    tokens = torch.randint(0, 3, (k, b), generator=g).tolist()
    prior = torch.softmax(torch.randn(k, generator=g), 0).tolist()
    probs = torch.rand(k, b, generator=g)
    probs[probs < 0.2], probs[probs > 0.9] = 0.0, 1.0
    full = build_trie(tokens, prior)
    prefix = lambda trie: {r: tuple(trie.tokens[a] for a in _path(trie, r)) for r in range(1, len(trie.tokens))}
    full_prefix = prefix(full)
    for budget in range(1, full.num_nodes + 1):
        kept = build_trie(tokens, prior, max_nodes=budget, token_probs=probs.tolist())
        assert kept.num_nodes == budget
        assert all(0 <= kept.parents[r] < r for r in range(1, len(kept.tokens)))
        kept_prefixes = set(prefix(kept).values())
        assert kept_prefixes <= set(full_prefix.values())
        reach = {p: sum(prior[z] * float(torch.prod(probs[z, :len(p)])) for z in range(k)
                        if tuple(tokens[z][:len(p)]) == p) for p in full_prefix.values()}
        dropped = [reach[p] for p in reach if p not in kept_prefixes]
        assert not dropped or min(reach[p] for p in kept_prefixes) >= max(dropped) - 1e-12


def _path(trie, row):
    rows = []
    while row > 0:
        rows.append(row)
        row = trie.parents[row]
    return rows[::-1]


def test_the_node_budget_uses_the_drafters_probabilities_when_it_ranks_tokens(tmp_path):
    """SpeculativeDecoder with max_tree_nodes asks a DrafterProposer for ranked tokens (even
    without extra leaves) and stays exact: T 0 still equals greedy decoding."""
    dec = make_decoder(tmp_path, branches=4, block_size=4, verify="tree", extra_leaves=0, max_tree_nodes=3)
    assert dec.proposer.top_tokens == 1
    out = dec.generate(PROMPT, SamplingParams(temperature=0.0), max_new_tokens=12)
    assert out.token_ids == hf_greedy(dec.target.model, PROMPT, 12)
    assert max(c.tree_nodes for c in out.cycles) <= 3


def hand_ranked_trie(count):
    """Branches [5, 6] and [5, 9] (prior 0.6 / 0.4), each ranking three tokens per position. Under
    the anchor (child 5): 8 scores 0.6 * 0.1 + 0.4 * 0.35 = 0.20, 7 scores 0.6 * 0.3 = 0.18, 3
    scores 0.4 * 0.2 = 0.08; under node 5 (children 6 and 9): 4 scores 0.6 * 0.1 + 0.4 * 0.15 = 0.12.
    The depth-2 nodes have no draft position below them."""
    top_tokens = [[[5, 7, 8], [6, 9, 4]], [[5, 8, 3], [9, 6, 4]]]
    top_probs = [[[0.5, 0.3, 0.1], [0.6, 0.2, 0.1]], [[0.4, 0.35, 0.2], [0.5, 0.3, 0.15]]]
    return add_alternative_leaves(build_trie([[5, 6], [5, 9]], [0.6, 0.4]), top_tokens, top_probs, [0.6, 0.4], count)


def test_extra_leaves_are_the_best_scored_tokens_that_are_not_children():
    assert hand_ranked_trie(0).num_nodes == 3
    two = hand_ranked_trie(2)
    assert two.tokens[4:] == [7, 8] and two.parents[4:] == [0, 0] and two.depths[4:] == [1, 1]
    assert two.children[0] == {5: 1, 7: 4, 8: 5} and two.extra_leaves == 2
    assert two.mass[4:] == [0.0, 0.0] and two.branches[4:] == [[0, 1], [0, 1]]
    three = hand_ranked_trie(3)
    assert three.tokens[4:] == [7, 8, 4] and three.parents[6] == 1 and three.depths[6] == 2
    assert hand_ranked_trie(10).num_nodes == 3 + 4   # 7, 8, 3 under the anchor, 4 under node 5: all there are
    with pytest.raises(ValueError, match="count"):
        hand_ranked_trie(-1)


def test_an_extra_leaf_adds_to_the_walk_but_not_to_the_branch_rules_figure():
    """With the target's probability 0.5 for 5, 0.2 for 7, 0.1 for 8 under the anchor and 0.5 for
    6 and 9 under 5: the walk reaches the extra leaves with 0.2 and 0.1 more; the branch rule's
    figure is that of the branches alone (test_the_walk_gives_the_branch_rules_expected_length...)."""
    trie = hand_ranked_trie(2)
    probs = [[0.5, 0.2, 0.1], [0.5, 0.5], [0.0], [0.0], [0.0], [0.0]]
    walk = trie.walk([8, 0, 0, 0, 0, 11], probs)
    assert walk.tokens == [8, 11] and walk.rows == [0, 5] and walk.branches == [0, 1]
    assert walk.expected_accepted == pytest.approx(0.5 + 0.2 + 0.1 + 0.25 + 0.25)
    assert walk.branch_rule_expected == pytest.approx(0.5 + 0.5 * 0.5 + 0.5 * 0.4)


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
    from dblast_ext.target.adapter import TargetAdapter
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
    from dblast_ext.target.adapter import TargetAdapter
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



@pytest.mark.parametrize("rows", [[0], [0, 1, 2], [0, 2], [0, 1, 3]])
def test_keeping_rows_given_as_a_list_equals_the_gather(rows):
    """The decode loop hands the walk's rows as a list: a path of the forward's first rows (the
    root alone, or a chain laid out first) is kept by a crop, any other by the gather; the cache
    left is the gather's either way."""
    target = tiny_target("qwen3", vocab_size=100, layers=3)
    from dblast_ext.target.adapter import TargetAdapter
    adapter = TargetAdapter(target, [0, 2])
    trie = build_trie([[11, 12, 13], [11, 14, 15], [16, 12, 13]], [0.5, 0.3, 0.2])
    trie.tokens[0] = PROMPT[-1]
    context = PROMPT[:-1]
    caches = []
    with torch.no_grad():
        for given in (torch.tensor(rows), rows):
            cache = adapter.new_cache()
            adapter.forward(torch.tensor([context]), cache)
            adapter.forward_tree(torch.tensor([trie.tokens]), cache, trie.positions(len(context), "cpu"),
                                 trie.attention_mask(len(context), torch.float32, "cpu"))
            adapter.keep_rows(cache, len(context), given)
            caches.append(cache)
    for gathered, kept in zip(caches[0].layers, caches[1].layers):
        assert kept.keys.shape[-2] == len(context) + len(rows)
        assert torch.equal(gathered.keys, kept.keys) and torch.equal(gathered.values, kept.values)



def test_a_cpu_tree_forward_hands_sdpa_the_grouped_heads_and_restores_the_switch(monkeypatch):
    """Under a 4D mask transformers would repeat the K/V heads (tiny targets: 4 query heads on 2
    K/V heads); the adapter's CPU forwards set transformers' switch for their duration so sdpa
    takes the grouped heads: the same logits and features bit for bit, no repetition where the
    switch is read (transformers 5), and the environment as it was afterwards."""
    from dblast_ext.target import adapter as target_module
    from dblast_ext.target.adapter import FORCE_GQA_SWITCH, TargetAdapter
    monkeypatch.delenv(FORCE_GQA_SWITCH, raising=False)
    model = tiny_target("qwen3", vocab_size=100, layers=3)
    model.config._attn_implementation = "sdpa"
    adapter = TargetAdapter(model, [0, 2])
    trie = build_trie([[11, 12, 13], [11, 14, 15], [16, 12, 13]], [0.5, 0.3, 0.2])
    trie.tokens[0] = PROMPT[-1]
    context = PROMPT[:-1]

    def tree_forward():
        with torch.no_grad():
            cache = adapter.new_cache()
            adapter.forward(torch.tensor([context]), cache)
            return adapter.forward_tree(torch.tensor([trie.tokens]), cache, trie.positions(len(context), "cpu"),
                                        trie.attention_mask(len(context), torch.float32, "cpu"))

    with monkeypatch.context() as patched:  # as transformers runs it without the switch
        patched.setattr(target_module, "grouped_heads_under_masks", lambda device: contextlib.nullcontext())
        repeated = tree_forward()
    with monkeypatch.context() as patched:  # a switch the user set is theirs
        patched.setenv(FORCE_GQA_SWITCH, "0")
        tree_forward()
        assert os.environ[FORCE_GQA_SWITCH] == "0"
    sdpa = pytest.importorskip("transformers.integrations.sdpa_attention")
    if "TRANSFORMERS_SDPA_FORCE_GQA" in inspect.getsource(sdpa.use_gqa_in_sdpa):  # transformers reads it

        def no_repeat(*args):
            raise AssertionError("the K/V heads were repeated")
        monkeypatch.setattr(sdpa, "repeat_kv", no_repeat)
    grouped = tree_forward()
    assert FORCE_GQA_SWITCH not in os.environ
    for a, b in zip(repeated, grouped):
        assert torch.equal(a, b)

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
    (dict(verify="branch", extra_leaves=2), "extra_leaves"),
    (dict(verify="tree", extra_leaves=-1), "extra_leaves"),
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


def committed_joint_counts(branches, sampling, samples, length=4, block_size=4, extra_leaves=0,
                           max_tree_nodes=None):
    """Counts of the first `length` committed tokens over `samples` seeds, with the oracle
    proposer (drafts the target often accepts, branches splitting at different depths; with
    `extra_leaves`, ranking tokens for that many extra leaves per trie), the target's exact
    joint, the first cycle's accepted drafts, and whether each walk ended on an extra leaf."""
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        from pathlib import Path
        dec = make_decoder(Path(folder), branches=branches, block_size=block_size, vocab=SMALL_VOCAB, mask=MASK,
                           layers=2, target_layer_ids=(0, 1))
    with torch.no_grad():  # a peaked target (top token ~0.6): drafts get accepted, deep nodes get reached
        dec.target.model.lm_head.weight.mul_(12.0)
    exact = exact_prefix_joint(dec.target.model, SMALL_PROMPT, sampling, length)
    counts = np.zeros_like(exact)
    accepted, on_extra_leaf = [], []
    walk = trie_module.DraftTrie.walk   # as it is now (a test may have planted a bug in it)

    def spy(trie, drawn, child_probs):
        result = walk(trie, drawn, child_probs)
        on_extra_leaf.append(result.rows[-1] >= len(trie.tokens) - trie.extra_leaves > 0)
        return result

    trie_module.DraftTrie.walk = spy
    try:
        for seed in range(samples):
            tree_dec, oracle = oracle_decoder(dec, branches, SMALL_PROMPT, ranked=extra_leaves > 0, verify="tree",
                                              extra_leaves=extra_leaves, max_tree_nodes=max_tree_nodes)
            out = tree_dec.generate(SMALL_PROMPT, sampling, max_new_tokens=max(length, block_size + 1), seed=seed,
                                    on_tokens=oracle.on_tokens)
            assert oracle.prefix == SMALL_PROMPT + out.token_ids
            counts[tuple(out.token_ids[:length])] += 1
            accepted.append(out.cycles[0].num_accepted)
    finally:
        trie_module.DraftTrie.walk = walk
    return counts, exact, np.array(accepted), np.array(on_extra_leaf)


def assert_follows(counts, exact, samples):
    length = counts.ndim
    assert counts[exact == 0].sum() == 0
    assert chi_square_pvalue(counts.ravel(), exact.ravel() * samples) > 1e-3
    for position in range(length):  # each committed position's marginal
        axes = tuple(a for a in range(length) if a != position)
        assert chi_square_pvalue(counts.sum(axes), exact.sum(axes) * samples) > 1e-3, position


FULL = pytest.mark.slow
# (K, filter, seeds): the fast tier's two, the slow tier's three with more seeds
DISTRIBUTION_CASES = [
    (2, SamplingParams(1.0, 0, 1.0), 400),
    (4, SamplingParams(1.0, 6, 0.9), 400),
    pytest.param(2, SamplingParams(1.0, 6, 0.9), 2000, marks=FULL),
    pytest.param(4, SamplingParams(1.0, 0, 1.0), 2000, marks=FULL),
    pytest.param(4, SamplingParams(0.7, 6, 0.9), 2000, marks=FULL),
]


@pytest.mark.parametrize("branches,sampling,samples", DISTRIBUTION_CASES)
def test_committed_tokens_follow_the_targets_distribution(branches, sampling, samples):
    counts, exact, accepted, _ = committed_joint_counts(branches, sampling, samples)
    # the walk must reach the deepest nodes often, or the test would check little
    assert np.mean(accepted == 3) > 0.05
    assert_follows(counts, exact, samples)


@pytest.mark.parametrize("branches,sampling,samples", DISTRIBUTION_CASES)
def test_committed_tokens_follow_the_targets_distribution_with_extra_leaves(branches, sampling, samples):
    counts, exact, accepted, on_extra_leaf = committed_joint_counts(branches, sampling, samples, extra_leaves=3)
    # walks must end on extra leaves often, and still reach the deepest nodes, or the test would check little
    assert np.mean(on_extra_leaf) > 0.05 and np.mean(accepted == 3) > 0.05
    assert_follows(counts, exact, samples)


def test_committed_tokens_follow_the_targets_distribution_under_a_reach_scored_node_budget():
    """A budget of 4 of the oracle's branch nodes, chosen by the drafter's reach estimate, plus 2
    extra leaves: the trie changes with every proposal, each one fixed given its context."""
    counts, exact, accepted, on_extra_leaf = committed_joint_counts(4, SamplingParams(1.0, 6, 0.9), 400,
                                                                    extra_leaves=2, max_tree_nodes=4)
    assert np.mean(on_extra_leaf) > 0.05 and np.mean(accepted >= 2) > 0.05
    assert_follows(counts, exact, 400)


@pytest.mark.parametrize("extra_leaves", [0, 3])
def test_a_walk_descending_on_a_non_child_fails_the_distribution_test(monkeypatch, extra_leaves):
    monkeypatch.setattr(trie_module.DraftTrie, "walk", descend_on_any_draw)
    counts, exact, _, _ = committed_joint_counts(4, SamplingParams(1.0, 0, 1.0), 400, extra_leaves=extra_leaves)
    with pytest.raises(AssertionError):
        assert_follows(counts, exact, 400)


def test_extra_leaves_add_to_the_tries_expected_length_and_leave_the_branch_rules(tmp_path):
    """On the same proposals (the oracle's, ranking the target's likeliest tokens), extra leaves
    raise the trie's expected accepted drafts and leave the branch rule's same-context figure as
    it was: the leaves carry no prior mass."""
    dec = make_decoder(tmp_path, branches=4, block_size=4, vocab=SMALL_VOCAB, mask=MASK, layers=2,
                       target_layer_ids=(0, 1))
    gains = []
    for last in range(SMALL_VOCAB - 1):
        prefix = SMALL_PROMPT + [last]
        records = []
        for extra_leaves in (0, 3):
            tree_dec, _ = oracle_decoder(dec, 4, prefix, ranked=True, verify="tree", extra_leaves=extra_leaves)
            records.append(tree_dec.first_cycle(prefix, SamplingParams(1.0), seed=0))
        without, with_leaves = records
        assert with_leaves.tree_nodes == without.tree_nodes + 3
        assert with_leaves.branch_rule_expected == pytest.approx(without.branch_rule_expected, abs=1e-6)
        gains.append(with_leaves.expected_accepted - without.expected_accepted)
    assert min(gains) >= -1e-6 and np.mean(gains) > 0.05, gains


@pytest.mark.parametrize("draft_vocab", [None, 60])
def test_a_drafter_ranks_its_argmax_first_with_the_references_probability(tmp_path, draft_vocab):
    """DrafterProposer.ranked_tokens (trie verification's extra leaves): first the token the
    argmax reference drafts, with probability exp(max logit - logsumexp) of that reference;
    then tokens of the draft vocabulary in decreasing probability."""
    dec = make_decoder(tmp_path, branches=4, block_size=4, verify="tree", draft_vocab=draft_vocab)
    proposer = dec.proposer
    assert dec.extra_leaves == TREE_EXTRA_LEAVES and proposer.top_tokens == TREE_EXTRA_LEAVES + 1
    hidden = torch.randn(2, 4, dec.drafter.config.hidden_size, generator=torch.Generator().manual_seed(3))
    tokens, probs = proposer.ranked_tokens(hidden, 5)
    assert tokens.shape == probs.shape == (2, 4, 3, 5)
    proposer.use_kernels = False
    assert torch.equal(tokens[..., 0], proposer.draft_tokens(hidden))
    assert (probs[..., :-1] >= probs[..., 1:]).all() and (probs > 0).all()
    head = dec.target.lm_head_weight[:dec.target.vocab_size]
    allowed = torch.arange(head.shape[0]) if draft_vocab is None else proposer.draft_ids
    assert torch.isin(tokens, allowed).all()
    d = dec.drafter
    best = reference.branch_argmax(hidden[:, 1:].reshape(-1, hidden.shape[-1]), head[allowed],
                                   d.branch_expander.weight, d.branch_expander.bias)
    first = torch.exp(best.max_logits - best.logsumexp).view(2, 3, 4).transpose(1, 2)
    torch.testing.assert_close(probs[..., 0], first, rtol=1e-5, atol=1e-6)


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


@pytest.mark.parametrize("bad_field,message", [
    ("branch_tokens", "branch_tokens has entries outside"),
    ("top_tokens", "top_tokens has entries outside"),
    ("top_probs", "top_probs must be finite and in"),
    ("top_shape", "top_tokens and top_probs must be"),
])
def test_a_proposal_outside_the_vocabulary_is_refused_before_the_target_runs(tmp_path, bad_field, message):
    dec = make_decoder(tmp_path, branches=2, verify="tree")

    class Bad:
        block_size, num_branches, target_layer_ids = 4, 2, dec.proposer.target_layer_ids

        def new_cache(self, rows, capacity, device):
            return dec.proposer.new_cache(rows, capacity, device)

        def propose(self, anchors, context, cache, context_lens=None):
            from dblast_ext.drafting.proposer import RankedProposal
            tokens, top_tokens = torch.full((1, 2, 3), 1), torch.full((1, 2, 3, 2), 1)
            top_probs = torch.full((1, 2, 3, 2), 0.5)
            if bad_field == "branch_tokens":
                tokens = torch.full((1, 2, 3), 10_000)
            elif bad_field == "top_tokens":
                top_tokens = torch.full((1, 2, 3, 2), 10_000)
            elif bad_field == "top_probs":
                top_probs = torch.full((1, 2, 3, 2), 1.5)
            else:
                top_tokens = torch.full((1, 2, 3), 1)
            return RankedProposal(tokens, torch.tensor([[0.5, 0.5]]), top_tokens, top_probs)

    bad = SpeculativeDecoder(dec.target.model, proposer=Bad(), verify="tree", controller="off")
    with pytest.raises(ValueError, match=message):
        bad.generate(PROMPT, SamplingParams(1.0), max_new_tokens=8)
