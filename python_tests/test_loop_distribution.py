"""The decode loop's committed tokens against the target's exact distribution, with a stated power.

Each case runs one path of the loop (one chain, a batch, the trie, a controller switching the
depth every cycle, DFlash2's sampled chain) on a 16-token target and counts its first committed
tokens over many seeds; distribution_power.assert_follows tests the counts against the exact
joint, enumerated from the target's filtered conditionals. The slow tier's sample counts detect
a 10% relative error on any cell of probability >= 0.05 (a token at one position, a pair, the
triple) with the power stated in the case; the fast tier's detect a 50% error. Each case has a
negative control, the same procedure on a loop whose target is biased on one token, that must
fail, and test_the_stated_power_is_the_computed_power keeps the statements true."""
from dataclasses import dataclass

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from dblast_ext import reference  # noqa: E402
from dblast_ext.decoding import batch_loop  # noqa: E402
from dblast_ext.decoding import trie as trie_module  # noqa: E402
from dblast_ext.decoding.adaptive import ScriptedDepth  # noqa: E402
from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder  # noqa: E402
import distribution_power  # noqa: E402
from decoding_cases import (MASK, SMALL_PROMPT, SMALL_VOCAB, BatchOracleProposer, exact_prefix_joint,  # noqa: E402
                            make_decoder, oracle_decoder)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread
# a controller that changes the depth every cycle, plain steps included (block 4: depths 0..3)
SWITCHING = [3, 0, 1, 0, 0, 2, 3, 1]
ROWS_PER_CALL = 2000


@dataclass
class Case:
    """One path of the loop, its filter, its sample counts per prompt (fast and slow tier) and
    the power of each tier's test, computed by distribution_power.power and checked by
    test_the_stated_power_is_the_computed_power: against a 50% relative error (fast) and a 10%
    one (slow) on the least detectable cell of probability >= 0.05."""
    name: str
    sampling: SamplingParams
    fast: int
    slow: int
    fast_power: float
    slow_power: float
    length: int = 3
    prompts: tuple = (tuple(SMALL_PROMPT),)


CASES = {case.name: case for case in [
    # Beside each case its power, distribution_power.power at its counts: fast_power against a 50%
    # relative error, slow_power against a 10% one, on its least detectable cell >= 0.05.
    # One chain: K = 1, drafts the target often accepts (the oracle), one prompt. generate(prompt,
    # seed) is generate_batch([prompt], seeds=[seed]) and a row's tokens do not depend on the rest
    # of its batch (test_batched_decoding), so the rows of a batch are samples of one chain.
    Case("chain", SamplingParams(0.7, 6, 0.9), fast=4000, slow=70000, fast_power=0.98, slow_power=0.93),
    # a batch: K = 4, two prompts of different lengths interleaved (counts per prompt), rows
    # accepting different numbers of drafts and finishing in different cycles, the static target cache
    Case("batch", SamplingParams(1.0, 0, 1.0), fast=4000, slow=72000, fast_power=0.97, slow_power=0.91,
         prompts=(tuple(SMALL_PROMPT), (2, 9))),
    # a controller that changes the depth every cycle (plain steps included), each call of the
    # batch starting the script at another depth
    Case("switching", SamplingParams(1.0, 6, 0.9), fast=4000, slow=76000, fast_power=0.96, slow_power=0.92),
    # DFlash2's selector sampling its chain, verified by sparse verification
    Case("dflash2", SamplingParams(1.5, 0, 0.95), fast=4000, slow=72000, fast_power=0.97, slow_power=0.92),
    # trie verification, one prompt at a time (about 3 ms a sample): two tokens, the prefill's and
    # the walk's first; K = 4 oracle branches and two extra leaves per trie
    Case("trie", SamplingParams(0.5, 0, 1.0), fast=2000, slow=36000, fast_power=0.98, slow_power=0.92, length=2),
]}


def peaked_target(decoder):
    """The 16-token target with a peaked LM head (top token ~0.6), so drafts get accepted and
    every position of the block gets verified."""
    with torch.no_grad():
        decoder.target.model.lm_head.weight.mul_(12.0)
    return decoder


_LOOPS = {}


def loop_for(name: str, folder) -> SpeculativeDecoder:
    """The decoder whose target (and, for DFlash2, drafter) a case runs: built once per session."""
    if name not in _LOOPS:
        if name == "dflash2":
            from test_dflash2 import small_dflash2_decoder
            _LOOPS[name] = small_dflash2_decoder(folder)
        else:
            branches = 1 if name == "chain" else 4
            _LOOPS[name] = peaked_target(make_decoder(folder, branches=branches, block_size=4, vocab=SMALL_VOCAB,
                                                      mask=MASK, layers=2, target_layer_ids=(0, 1),
                                                      target_cache="static" if name == "batch" else "dynamic"))
    return _LOOPS[name]


def count(case: Case, decoder, samples: int):
    """(counts of each prompt's first `case.length` tokens over `samples` seeds per prompt, the
    number of drafts each sample's first cycle accepted)."""
    return (count_trie if case.name == "trie" else count_batched)(case, decoder, samples)


def count_batched(case: Case, decoder, samples: int):
    """`count` for generate_batch: the prompts' rows interleaved in calls of ROWS_PER_CALL
    (seeds 0, 1, ...)."""
    prompts = [list(p) for p in case.prompts]
    counts = [np.zeros((SMALL_VOCAB,) * case.length) for _ in prompts]
    accepted = []
    total = samples * len(prompts)
    for call, first in enumerate(range(0, total, ROWS_PER_CALL)):
        rows = [prompts[i % len(prompts)] for i in range(first, min(first + ROWS_PER_CALL, total))]
        if case.name == "dflash2":  # its own drafter: a sampled chain and sparse verification
            loop, stream = decoder, None
        else:
            oracle = BatchOracleProposer(decoder, decoder.proposer.num_branches, rows)
            # each call starts the script elsewhere, so the first cycles meet every depth
            controller = (ScriptedDepth(SWITCHING[call % len(SWITCHING):] + SWITCHING[:call % len(SWITCHING)])
                          if case.name == "switching" else "off")
            loop = SpeculativeDecoder(decoder.target.model, proposer=oracle, target_cache=decoder.target_cache,
                                      controller=controller)
            stream = oracle.on_tokens
        outs = loop.generate_batch(rows, case.sampling, max_new_tokens=case.length,
                                   seeds=range(first, first + len(rows)), on_tokens=stream)
        for i, out in enumerate(outs):
            counts[(first + i) % len(prompts)][tuple(out.token_ids[: case.length])] += 1
            accepted.append(out.cycles[0].num_accepted)
    return counts, accepted


def count_trie(case: Case, decoder, samples: int):
    """`count` with trie verification (one prompt at a time): the oracle's branches and two
    extra leaves of its ranked tokens per trie. The drafts accepted are the first walk's (the
    cycle's record counts only the tokens kept under the limit)."""
    counts, accepted = np.zeros((SMALL_VOCAB,) * case.length), []
    prompt = list(case.prompts[0])
    walk, walks = trie_module.DraftTrie.walk, []

    def spy(trie, drawn, child_probs):
        result = walk(trie, drawn, child_probs)
        walks.append(len(result.tokens) - 1)
        return result

    trie_module.DraftTrie.walk = spy
    try:
        loop, oracle = oracle_decoder(decoder, 4, prompt, ranked=True, verify="tree", extra_leaves=2)
        for seed in range(samples):
            before = len(walks)
            oracle.prefix = list(prompt)  # the oracle follows one response at a time
            out = loop.generate(prompt, case.sampling, max_new_tokens=case.length, seed=seed,
                                on_tokens=oracle.on_tokens)
            counts[tuple(out.token_ids[: case.length])] += 1
            accepted.append(walks[before])
    finally:
        trie_module.DraftTrie.walk = walk
    return [counts], accepted


class PlantedBias:
    """A target whose filtered probability of `token` is (1 + relative) times the true one in
    every conditional (at most 1; the other tokens scaled down to make room): a hook on the LM
    head shifts the token's logit by the amount that gives exactly that under `sampling`'s
    temperature and top-k (raised, the token stays inside both filters; top-p may drop a tail
    token). The loop under test sees only this target."""

    def __init__(self, model, token: int, sampling: SamplingParams, relative: float):
        self.model, self.token, self.sampling, self.relative = model, token, sampling, relative

    def shift(self, module, args, logits):
        p = reference.filter_target_probs(logits.reshape(-1, logits.shape[-1]), **self.sampling.kwargs())
        p = p[:, self.token].reshape(logits.shape[:-1])
        biased = (p * (1 + self.relative)).clamp(max=1 - 1e-9)
        odds = torch.where(p > 0, biased * (1 - p) / (p * (1 - biased)).clamp(min=1e-300), torch.ones_like(p))
        out = logits.clone()
        out[..., self.token] += (odds.log() * self.sampling.temperature).to(logits.dtype)
        return out

    def __enter__(self):
        self.handle = self.model.lm_head.register_forward_hook(self.shift)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def planted_token(model, case: Case, relative: float):
    """(token, biased joint, the relative error planted on its second-position cell): the least
    likely second-position cell >= 0.05 on which PlantedBias plants at least 95% of `relative`
    (where the token's conditionals are near 1 the raise saturates), so that the bias sits
    where the test is weakest."""
    prompt = list(case.prompts[0])
    exact = exact_prefix_joint(model, prompt, case.sampling, case.length)
    others = tuple(a for a in range(case.length) if a != 1)
    second = exact.sum(axis=others)
    for token in np.argsort(second):
        if second[token] < distribution_power.MIN_CELL:
            continue
        with PlantedBias(model, int(token), case.sampling, relative):
            biased = exact_prefix_joint(model, prompt, case.sampling, case.length)
        planted = biased.sum(axis=others)[token] / second[token] - 1
        if planted >= 0.95 * relative:
            return int(token), exact, planted
    raise AssertionError(f"no second-position cell >= 0.05 takes a {relative:.0%} bias")


def run_control(case: Case, folder, samples: int, relative: float):
    """The case's counts for its first prompt with the target biased by `relative` on the
    planted token, the true exact joint, and the relative error planted on the token's cell."""
    decoder = loop_for(case.name, folder)
    model = decoder.target.model
    token, exact, planted = planted_token(model, case, relative)
    with PlantedBias(model, token, case.sampling, relative):
        counts, _ = count(case, decoder, samples)
    return counts[0], exact, planted


def tiers(relative_fast=None, relative_slow=None):
    """Each case at the fast tier's sample count and, marked slow, at the slow tier's."""
    params = []
    for case in CASES.values():
        fast, slow = (case.fast,), (case.slow,)
        if relative_fast is not None:
            fast, slow = (case.fast, relative_fast), (case.slow, relative_slow)
        params.append(pytest.param(case, *fast, id=f"{case.name}-fast"))
        params.append(pytest.param(case, *slow, id=f"{case.name}-slow", marks=pytest.mark.slow))
    return params


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("loop-distribution")


@pytest.mark.parametrize("case,samples", tiers())
def test_committed_tokens_follow_the_targets_exact_distribution(case, samples, folder):
    decoder = loop_for(case.name, folder)
    counts, first_accepted = count(case, decoder, samples)
    # drafts accepted often: the second token is often an accepted draft, not only a residual draw
    assert np.mean(np.array(first_accepted) >= 1) > 0.1
    for prompt, observed in zip(case.prompts, counts):
        distribution_power.assert_follows(observed, exact_prefix_joint(decoder.target.model, list(prompt),
                                                                       case.sampling, case.length))


@pytest.mark.parametrize("case,samples,relative", tiers(distribution_power.GROSS, distribution_power.SUBTLE))
def test_a_target_biased_on_one_token_fails_the_same_test(case, samples, relative, folder):
    """The negative control: the loop run on a target whose conditionals give one token a
    relative error of 50% (fast tier) or 10% (slow tier), so that its second-position cell of
    probability >= 0.05 is off by that much, at the tier's sample count and seeds; the procedure
    must reject it."""
    counts, exact, planted = run_control(case, folder, samples, relative)
    assert planted >= 0.95 * relative
    distribution_power.assert_rejects(counts, exact)


def stale_uniforms(generators, count, device):
    """A loop bug: every draw of a row's cycle reuses its first uniform (the branch choice's)."""
    first = torch.stack([torch.rand(1, generator=g, device=device, dtype=torch.float64) for g in generators])
    return first.expand(-1, count).contiguous()


@pytest.mark.parametrize("name", ["chain", "batch"])
def test_a_loop_reusing_a_uniform_fails_the_test(name, folder, monkeypatch):
    """A loop bug, not a biased target: the cycle's acceptance tests and residual draws reuse the
    uniform that chose the branch. The fast tier's count must catch it."""
    case = CASES[name]
    monkeypatch.setattr(batch_loop, "draw_uniforms", stale_uniforms)
    counts, _ = count(case, loop_for(name, folder), case.fast)
    exact = exact_prefix_joint(loop_for(name, folder).target.model, list(case.prompts[0]), case.sampling,
                               case.length)
    distribution_power.assert_rejects(counts[0], exact)


@pytest.mark.parametrize("case", CASES.values(), ids=lambda case: case.name)
def test_the_stated_power_is_the_computed_power(case, folder):
    """Each case's statement holds for the exact joints it tests, and meets the bar: >= 90%
    against a 10% error at the slow tier's count, against a 50% error at the fast tier's."""
    model = loop_for(case.name, folder).target.model
    exacts = [exact_prefix_joint(model, list(p), case.sampling, case.length) for p in case.prompts]
    computed = {"fast": min(distribution_power.power(e, case.fast, distribution_power.GROSS) for e in exacts),
                "slow": min(distribution_power.power(e, case.slow, distribution_power.SUBTLE) for e in exacts)}
    stated = {"fast": case.fast_power, "slow": case.slow_power}
    for tier in computed:
        # a lower bound, at most 2 points low (the power moves in small steps with the exact joint)
        assert stated[tier] <= computed[tier] <= stated[tier] + 0.02, (tier, computed[tier])
        assert stated[tier] >= distribution_power.REQUIRED_POWER, tier
