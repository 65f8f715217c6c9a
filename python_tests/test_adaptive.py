"""The adaptive drafting controller (dblast_ext.decoding.adaptive): its decisions from acceptance and
cost, the cost table, the calibration, and the decode loop under a controller that changes the
depth every cycle (0 included): greedy output equals the target's, sampled tokens follow the
target's distribution, drafting resumes after plain steps with the drafter's context complete."""
import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from dblast_ext.decoding import adaptive  # noqa: E402
from dblast_ext.decoding import cost_calibration  # noqa: E402
from dblast_ext.decoding import learned_costs  # noqa: E402
from dblast_ext.decoding.adaptive import (AdaptiveDepth, CostTable, FixedDepth, ScriptedDepth,  # noqa: E402
                                          expected_committed)
from dblast_ext.decoding.chain_cycle import ChainCycle  # noqa: E402
from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder  # noqa: E402
from dblast_ext.decoding.learned_costs import LearnedCosts  # noqa: E402
from decoding_cases import (MASK, SMALL_PROMPT, SMALL_VOCAB, BatchOracleProposer, exact_prefix_joint,  # noqa: E402
                            hf_greedy, make_decoder, oracle_decoder)
from losslessness import chi_square_pvalue  # noqa: E402

PROMPTS = [[3, 17, 42, 8, 25], [9, 4], [60, 61, 62, 63, 64, 65, 66, 67, 68], [11, 5, 7]]
# a controller that changes depth every cycle, plain steps included (block 4: depths 0..3)
SWITCHING = [3, 0, 1, 0, 0, 2, 3, 1]
FULL = pytest.mark.slow


# ------------------------------------------------------------------ the decision


def test_expected_committed_counts_the_bonus_token_and_each_survival():
    assert expected_committed([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_committed([0.5, 0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_committed([1.0, 0.0, 1.0], 3) == pytest.approx(2.0)


def observe_rows(controller, rows, depth, acceptance, cycles):
    for _ in range(cycles):
        controller.depth()
        controller.observe(depth, [list(acceptance)[:depth]] * rows)


def test_it_drafts_the_whole_block_when_drafts_are_accepted_and_cycles_are_cheap():
    controller = AdaptiveDepth()
    controller.start(1, 7, [1.0, 1.2, 1.25, 1.3, 1.35, 1.4, 1.45, 1.5])
    observe_rows(controller, 1, 7, [0.9] * 7, 20)
    assert controller.depth() == 7


def test_it_decodes_plainly_when_drafts_are_rejected_and_probes_within_its_budget():
    controller = AdaptiveDepth()
    costs = [1.0, 1.1, 1.2, 1.3]
    controller.start(1, 3, costs)
    observe_rows(controller, 1, 3, [0.0] * 3, 30)
    depths = [controller.depth() for _ in range(200)]
    assert depths.count(0) >= len(depths) - len(depths) // adaptive.MIN_PROBE_INTERVAL
    probes = [d for d in depths if d]
    assert probes and set(probes) == {1}  # one position deeper than the best, now and then
    # in expectation probing costs at most the budget
    spent = sum(costs[d] for d in depths) / (len(depths) * costs[0]) - 1
    assert spent <= adaptive.PROBE_BUDGET + 1e-9


def test_a_depth_that_became_good_again_is_found():
    controller = AdaptiveDepth()
    controller.start(1, 3, [1.0, 1.1, 1.2, 1.3])
    observe_rows(controller, 1, 3, [0.0] * 3, 30)
    assert controller.depth() == 0
    for _ in range(200):  # the text became predictable: each probe reports it
        d = controller.depth()
        controller.observe(d, [[0.95] * d])
    assert controller.depth() == 3



def test_it_leaves_the_whole_block_only_for_a_gain_beyond_the_margin():
    """Flat costs past the first draft and late positions rarely accepted: a shallower depth is
    predicted a little faster. Within DEPARTURE_MARGIN the controller keeps the whole block (as
    fixed drafting); with a steeper cost curve the same acceptance makes the cut worth taking; a
    plain step is taken on the argmax alone."""
    acceptance = [0.6, 0.5, 0.3, 0.1, 0.05, 0.05, 0.05]
    flat = [1.0, 1.3, 1.305, 1.31, 1.315, 1.32, 1.325, 1.33]
    controller = AdaptiveDepth()
    controller.start(1, 7, flat)
    observe_rows(controller, 1, 7, acceptance, 40)
    rates = controller.rates()
    assert max(rates) > rates[7]  # a cut is predicted faster ...
    assert max(rates) < rates[7] * (1 + adaptive.DEPARTURE_MARGIN)  # ... by less than the margin
    assert controller.best_depth() == 7
    steep = AdaptiveDepth()
    steep.start(1, 7, [1.0, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9])
    observe_rows(steep, 1, 7, acceptance, 40)
    assert 0 < steep.best_depth() < 7
    # a plain step is not held to the margin: predicted 1% faster than the whole block, it is taken
    committed = [r * c for r, c in zip(controller.rates(), flat)]  # E(d), as the controller predicts it
    plain = AdaptiveDepth()
    plain.start(1, 7, [1.0] + [e * 1.01 for e in committed[1:]])  # every drafting depth 1% slower than a plain step
    observe_rows(plain, 1, 7, acceptance, 40)
    rates = plain.rates()
    assert rates[0] == max(rates) and rates[0] < rates[7] * (1 + adaptive.DEPARTURE_MARGIN)
    assert plain.best_depth() == 0

def test_a_batch_decodes_plainly_where_verification_costs_more_than_it_commits():
    controller = AdaptiveDepth()
    controller.start(16, 3, [1.0, 2.5, 3.5, 4.5])  # a big batch: every verified position costs as much as a step
    observe_rows(controller, 16, 3, [0.6] * 3, 6)
    assert controller.best_depth() == 0
    cheap = AdaptiveDepth()
    cheap.start(16, 3, [1.0, 1.1, 1.2, 1.3])
    observe_rows(cheap, 16, 3, [0.6] * 3, 6)
    assert cheap.best_depth() == 3


def test_the_prior_alone_gets_no_benefit_of_the_doubt():
    """A batch of 16 whose cycle of d drafts costs as measured on the embedded pair (2026-12-06):
    on the even prior a plain step is the faster; the optimism bonus, were it given before any
    observation, would make the first cycles draft (they did: batch 16 fell to 0.91x)."""
    costs = [59.3, 111.2, 117.1, 123.1, 129.1, 135.0, 141.0, 147.0]
    controller = AdaptiveDepth()
    controller.start(16, 7, costs)
    assert controller.depth() == 0
    rates = controller.rates()
    boosted = adaptive.PRIOR_ACCEPTANCE + adaptive.OPTIMISM / (adaptive.PRIOR_WEIGHT + 1) ** 0.5
    assert 16 * expected_committed([boosted] * 7, 4) / costs[4] > rates[0]  # what the bonus would have done


def test_rows_that_finish_leave_the_decision_and_the_batch_cost_follows_the_rows():
    table = CostTable(chain={1: [1.0, 1.1, 1.2], 4: [1.0, 3.0, 5.0]})
    controller = AdaptiveDepth()
    controller.start(4, 2, table.chain_costs)
    controller.observe(2, [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.9, 0.9]])
    assert controller.best_depth() == 0
    controller.select([3])  # only the predictable row goes on: batch 1's costs
    assert controller.costs == [1.0, 1.1, 1.2] and controller.best_depth() == 2


def test_the_same_observations_give_the_same_depths():
    runs = []
    for _ in range(2):
        controller = AdaptiveDepth()
        controller.start(2, 3, [1.0, 1.2, 1.3, 1.5])
        rng = np.random.default_rng(0)
        chosen = []
        for _ in range(100):
            d = controller.depth()
            chosen.append(d)
            controller.observe(d, rng.uniform(size=(2, d)).tolist())
        runs.append(chosen)
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


@pytest.mark.parametrize("make,message", [
    (lambda: AdaptiveDepth(alpha=0), "alpha"),
    (lambda: AdaptiveDepth(probe_budget=1.5), "probe_budget"),
    (lambda: FixedDepth(-1), "depth"),
    (lambda: ScriptedDepth([]), "depths"),
    (lambda: AdaptiveDepth().start(1, 3, [1.0, 1.0]), "costs"),
    (lambda: AdaptiveDepth().start(1, 1, [1.0, float("nan")]), "costs"),
])
def test_bad_controller_settings_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ------------------------------------------------------------------ the cost table


def test_batch_costs_are_interpolated_between_measured_sizes():
    table = CostTable(chain={1: [1.0, 2.0], 4: [4.0, 8.0]})
    assert table.chain_costs(1) == [1.0, 2.0]
    assert table.chain_costs(2) == pytest.approx([2.0, 4.0])
    assert table.chain_costs(8) == pytest.approx([8.0, 16.0])  # beyond: in proportion to the rows


def test_a_cost_table_round_trips_and_bad_files_are_named(tmp_path):
    table = CostTable({"machine": "m"}, {1: [0.01, 0.02], 2: [0.02, 0.03]}, [0.01, 0.05], {1: 1e-4, 2: 3e-4}, 2e-4)
    path = str(tmp_path / "costs.json")
    table.save(path)
    again = CostTable.load(path)
    assert again == table
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not JSON"):
        CostTable.load(str(bad))
    bad.write_text(json.dumps({"version": 99}))
    with pytest.raises(ValueError, match="bad.json: not a dblast cost table"):
        CostTable.load(str(bad))
    bad.write_text(json.dumps({"version": 1, "chain": {"1": [0.01, 0.02]}}))  # before the catch-up costs
    with pytest.raises(ValueError, match="bad.json: not a dblast cost table of version 2"):
        CostTable.load(str(bad))
    bad.write_text(json.dumps({"version": 2, "chain": {"1": [0.01, -1]}}))
    with pytest.raises(ValueError, match="bad.json: every cost"):
        CostTable.load(str(bad))
    bad.write_text(json.dumps({"version": 2, "chain": {"1": [0.01, 0.02]}, "chain_catch_up": {"1": float("nan")}}))
    with pytest.raises(ValueError, match="bad.json: every catch-up cost"):
        CostTable.load(str(bad))


def test_catch_up_costs_are_interpolated_and_default_to_none():
    table = CostTable(chain={1: [1.0, 2.0], 4: [4.0, 8.0]}, chain_catch_up={1: 1.0, 4: 4.0})
    assert [table.catch_up(n) for n in (1, 2, 4, 16)] == pytest.approx([1.0, 2.0, 4.0, 4.0])
    assert CostTable(chain={1: [1.0, 2.0]}).catch_up(3) == 0.0


def started(costs, catch_up, rows=1, acceptance=0.9, cycles=20):
    """An adaptive controller that has seen `cycles` cycles of `acceptance` at every position."""
    controller = AdaptiveDepth()
    controller.start(rows, len(costs) - 1, costs, catch_up)
    for _ in range(cycles):
        controller.observe(len(costs) - 1, [[acceptance] * (len(costs) - 1)] * rows)
    return controller


def test_drafting_resumes_only_when_it_repays_reading_the_unseen_context():
    costs = [1.0, 1.2, 1.25, 1.3]  # drafting pays per cycle: E(3) ~ 3.4 tokens for 1.3 steps
    controller = started(costs, catch_up=0.01)
    assert controller.depth(unseen=2, remaining=100) == 3  # steady drafting: nothing to catch up
    # 500 unseen tokens cost 5 s to read; 100 tokens to go save ~100 * (1 - 1.3 / 3.4) ~ 62 s of plain steps
    assert controller.depth(unseen=500, remaining=100) == 3
    # with 5 tokens to go the catch-up costs more than drafting saves: a plain step
    assert controller.depth(unseen=500, remaining=5) == 0
    # no catch-up cost measured: the unseen context is free
    assert started(costs, catch_up=0.0).depth(unseen=500, remaining=5) == 3


def test_a_probe_goes_one_deeper_even_where_load_made_the_next_depth_look_cheaper():
    """Timings taken on a loaded machine need not rise with depth (a CI run beside a compile gave a
    depth-2 cost under the depth-1 one); the probe still verifies at least one position deeper."""
    controller = started([1.0, 1.3, 1.2, 1.9], catch_up=0.0)
    assert controller.probe_depth(1) == 2  # depth 2 looks free, so no slack reaches depth 3
    assert controller.probe_depth(0) == 2  # 0.2 extra is within 1.5 x 0.3, depth 3's 0.9 is not
    assert controller.probe_interval(1) >= 1


def test_probes_stop_where_their_catch_up_outgrows_the_budget():
    costs = [1.0, 3.0, 3.1, 3.2]  # drafting cannot pay at this acceptance: d* = 0, probes only
    cheap = started(costs, catch_up=1e-5, acceptance=0.3)
    dear = started(costs, catch_up=1.0, acceptance=0.3)
    cheap_depths = [cheap.depth(unseen=2 + i, remaining=1000) for i in range(400)]
    dear_depths = [dear.depth(unseen=2 + i, remaining=1000) for i in range(400)]
    assert any(cheap_depths) and not any(dear_depths)


def test_the_decoder_names_a_bad_controller_or_cost_table(tmp_path):
    with pytest.raises(ValueError, match="controller must be one of adaptive, off"):
        make_decoder(tmp_path, controller="sometimes")
    with pytest.raises(TypeError, match="controller"):
        make_decoder(tmp_path, controller=object())
    with pytest.raises(FileNotFoundError, match="missing.json"):
        make_decoder(tmp_path, cost_table=str(tmp_path / "missing.json"))
    with pytest.raises(TypeError, match="cost_table"):
        make_decoder(tmp_path, cost_table={"chain": {}})


def test_a_controller_choosing_a_depth_outside_the_block_is_named(tmp_path):
    dec = make_decoder(tmp_path, branches=2, block_size=4, controller=ScriptedDepth([9]))
    dec.controller.max_depth = 9  # a controller that ignores the block it was given
    dec.controller.start = lambda rows, max_depth, costs=None, catch_up=0.0: None
    with pytest.raises(ValueError, match="depth 9: a cycle verifies 0..3 drafts"):
        dec.generate(PROMPTS[0], max_new_tokens=6)


def test_calibration_times_every_depth_and_is_cached_once(tmp_path, monkeypatch):
    """`prepare` (and `dblast calibrate --cost`) measure the whole table; a generation measures
    nothing before it starts."""
    monkeypatch.setenv("DBLAST_COST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cost_calibration, "_LOADED", {})
    timed = []
    real = cost_calibration._time_cycles
    monkeypatch.setattr(cost_calibration, "_time_cycles",
                        lambda dec, rows, tree, repeats: timed.append((rows, tree)) or real(dec, rows, tree, repeats))
    dec = make_decoder(tmp_path, branches=2, block_size=4, controller="adaptive")
    dec.generate_batch(PROMPTS[:3], SamplingParams(1.0), max_new_tokens=6)
    assert timed == []  # the costs are learned from the generation's own cycles
    dec.prepare(3)
    assert timed == [(1, False), (2, False), (4, False)]  # powers of two up to the batch
    files = list((tmp_path / "cache").iterdir())
    assert len(files) == 1
    table = CostTable.load(str(files[0]))
    assert sorted(table.chain) == [1, 2, 4] and all(len(c) == 4 and min(c) > 0 for c in table.chain.values())
    assert table.key["block_size"] == 4 and table.key["verify"] == "branch"
    assert table.learned["chain"]["costs"]  # what the generation timed, kept beside the measured table
    monkeypatch.setattr(cost_calibration, "_LOADED", {})  # a new process reads the file: nothing timed again
    again = make_decoder(tmp_path, branches=2, block_size=4, controller="adaptive")
    again.prepare(3)
    again.generate(PROMPTS[0], max_new_tokens=4)
    assert timed == [(1, False), (2, False), (4, False)]
    # the trie has a curve of its own
    tree = make_decoder(tmp_path, branches=2, block_size=4, verify="tree", controller="adaptive")
    tree.prepare()
    assert timed[-1] == (1, True)


# ------------------------------------------------------------------ costs learned while decoding


class FakeClock:
    """A cycle's time is what `cost(rows, depth)` says (the depth and rows of the cycle the
    controller chose last); a drafting cycle after plain steps adds `catch_up` per unseen token."""

    def __init__(self, cost, catch_up=0.0):
        self.cost, self.catch_up, self.now, self.controller = cost, catch_up, 0.0, None

    def __call__(self):
        c = self.controller
        if c is not None and c._running is not None:
            rows, d, _, unseen, after_draft = c._running
            extra = self.catch_up * max(0, unseen - adaptive.STEADY_UNSEEN * rows) if d and not after_draft else 0.0
            self.now += self.cost(rows, d) + extra
        return self.now


def learning_controller(cost, rows=1, max_depth=7, table=None, catch_up=0.0):
    clock = FakeClock(cost, catch_up)
    controller = AdaptiveDepth(clock=clock)
    clock.controller = controller
    learner = LearnedCosts(table or CostTable(), tree=False, max_depth=max_depth)
    controller.start(rows, max_depth, learner)
    return controller, learner


def run_cycles(controller, cycles, acceptance, remaining, unseen_start=100):
    """`cycles` cycles with `acceptance` at every position (each row committing a token a cycle,
    as far as `remaining` counts); returns the depths chosen."""
    unseen, rows = unseen_start * len(controller.rows), len(controller.rows)
    for i in range(cycles):
        d = controller.depth(unseen, remaining - i * rows)
        controller.observe(d, [[acceptance] * controller.max_depth for _ in range(rows)])
        unseen = unseen + rows if d == 0 else rows * 2
    return controller.chosen


def test_with_no_costs_known_it_times_plain_steps_then_learns_drafting_where_the_budget_allows():
    # batch 1, a long generation: drafting costs 1.5 steps and is accepted: it drafts from the third cycle
    controller, learner = learning_controller(lambda rows, d: 1.0 if d == 0 else 1.4 + 0.02 * d)
    depths = run_cycles(controller, 40, 0.8, remaining=256)
    assert depths[0] == 0  # nothing known: a plain step, which times the plain cost
    assert depths[1] == 7  # the most a learning cycle could lose fits in the budget of 256 plain steps
    assert all(d == 7 for d in depths[2:])
    assert learner.curve(1)[0] == pytest.approx(1.0) and learner.curve(1)[7] == pytest.approx(1.54)
    assert learner.catch_up(1) == 0.0


def test_a_short_generation_of_a_big_batch_never_risks_a_learning_cycle():
    """48 tokens at batch 16: even one drafting cycle at the prior's bound (PRIOR_DRAFT_RATIO plain
    steps) would cost more than LEARN_BUDGET of the generation, so every cycle is a plain step."""
    controller, learner = learning_controller(lambda rows, d: 1.0 if d == 0 else 3.6, rows=16)
    depths = run_cycles(controller, 48, 0.6, remaining=16 * 48)
    assert depths == [0] * 48
    assert learner.curve(16) is None and learner.plain_cost(16) == pytest.approx(1.0)


def test_short_generations_add_up_to_a_learning_cycle(tmp_path):
    """32 tokens at batch 1 cannot afford a learning cycle alone; the plain steps of earlier
    generations, kept in the cache, count towards the budget, so the third one learns."""
    path = str(tmp_path / "costs.json")
    CostTable().save(path)
    first_drafting = []
    for generation in range(4):
        clock = FakeClock(lambda rows, d: 1.0 if d == 0 else 1.5)
        controller = AdaptiveDepth(clock=clock)
        clock.controller = controller
        learner = LearnedCosts(CostTable.load(path), tree=False, max_depth=7, path=path)
        controller.start(1, 7, learner)
        depths = run_cycles(controller, 32, 0.8, remaining=32)
        learner.save()
        first_drafting.append(next((i for i, d in enumerate(depths) if d), None))
    assert first_drafting[:2] == [None, None] and first_drafting[2] is not None
    assert first_drafting[3] == 0  # the costs it learned are cached: the next generation drafts at once


def test_learning_where_drafting_does_not_pay_costs_at_most_the_budget():
    steps = 400
    cost = lambda rows, d: 1.0 if d == 0 else 3.6  # noqa: E731
    controller, _ = learning_controller(cost, rows=4)
    depths = run_cycles(controller, steps, 0.5, remaining=4 * steps)
    assert depths[1:3] == [7, 7]  # it learns what drafting costs (a catch-up cycle, then a steady one)
    spent = sum(cost(4, d) for d in depths)
    # every cycle commits >= 1 token a row, so learning and probing lose at most their cost beyond a step
    assert spent <= steps * (1 + learned_costs.LEARN_BUDGET + adaptive.PROBE_BUDGET)
    assert depths[3:].count(0) / len(depths[3:]) > 0.9


def test_the_catch_up_cost_is_learned_from_the_first_drafting_cycle():
    controller, learner = learning_controller(lambda rows, d: 1.0 if d == 0 else 1.5, catch_up=0.01)
    run_cycles(controller, 6, 0.8, remaining=256, unseen_start=100)
    # the first drafting cycle read the prompt and the plain step's token: 101 beyond its steady 2
    assert learner.catch_up(1) == pytest.approx(0.01)


def test_a_measured_table_is_refined_by_the_timed_cycles_and_the_timings_are_saved(tmp_path):
    table = CostTable(chain={1: [1.0, 1.2, 1.3, 1.4]})
    learner = LearnedCosts(table, tree=False, max_depth=3, path=str(tmp_path / "costs.json"))
    assert learner.curve(1) == [1.0, 1.2, 1.3, 1.4]  # the table until something is timed
    for _ in range(3):
        learner.record(1, 3, 2.8, unseen=2, after_draft=True)  # this machine is twice as slow at drafting
    # the table's shape scaled to the timed depth; the plain step too, until one is timed (a machine
    # slower at one is most often slower at both)
    assert learner.curve(1) == pytest.approx([2.0, 2.4, 2.6, 2.8])
    learner.record(1, 0, 1.5, unseen=1, after_draft=False)
    assert learner.curve(1) == pytest.approx([1.5, 2.4, 2.6, 2.8])
    learner.save()
    kept = CostTable.load(str(tmp_path / "costs.json"))
    assert kept.learned["chain"]["costs"]["1"] == {"0": 1.5, "3": 2.8}
    again = LearnedCosts(kept, tree=False, max_depth=3)
    assert again.curve(1) == pytest.approx([1.5, 2.4, 2.6, 2.8])  # the next generation starts from them


def test_without_a_table_the_unseen_drafting_depths_follow_the_timed_ones():
    learner = LearnedCosts(CostTable(), tree=False, max_depth=4)
    learner.record(2, 0, 1.0, unseen=2, after_draft=False)
    assert learner.curve(2) is None  # no drafting cycle timed yet
    learner.record(2, 4, 2.0, unseen=4, after_draft=True)
    assert learner.curve(2) == pytest.approx([1.0, 2.0, 2.0, 2.0, 2.0])  # flat with one drafting depth
    learner.record(2, 2, 1.6, unseen=4, after_draft=True)
    assert learner.curve(2) == pytest.approx([1.0, 1.4, 1.6, 1.8, 2.0])  # the line through two
    assert learner.curve(3) == learner.curve(2)  # a batch whose rows finish: the nearest size timed
    assert learner.curve(5) is None  # beyond a factor of 2: learned anew


def test_timings_are_medians_of_the_latest_window():
    learner = LearnedCosts(CostTable(), tree=True, max_depth=2)
    for seconds in [9.0] + [1.0] * learned_costs.WINDOW:
        learner.record(1, 0, seconds, unseen=1, after_draft=False)
    assert learner.plain_cost(1) is None or learner.plain_cost(1) == 1.0
    assert learner.timings[(1, 0)] == [1.0] * learned_costs.WINDOW
    learner.record(1, 2, 50.0, unseen=2, after_draft=False)  # a steady cycle (no catch-up) is timed as it is
    assert learner.curve(1) == [1.0, 50.0, 50.0]


def test_a_learned_generation_measures_nothing_first_and_keeps_the_target_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("DBLAST_COST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cost_calibration, "_LOADED", {})
    monkeypatch.setattr(cost_calibration, "_time_cycles", lambda *a: pytest.fail("a generation calibrated"))
    dec = make_decoder(tmp_path, branches=2, block_size=4, controller="adaptive")
    out = dec.generate(PROMPTS[0], SamplingParams(0.0), max_new_tokens=24)
    assert out.token_ids == hf_greedy(dec.target.model, PROMPTS[0], 24)[: len(out.token_ids)]
    table = CostTable.load(str(next((tmp_path / "cache").iterdir())))
    assert table.learned["chain"]["costs"]["1"]["0"] > 0  # the plain steps it timed


def test_a_given_cost_table_is_used_as_it_is_and_gives_reproducible_output(tmp_path):
    table = CostTable(chain={1: [1.0, 1.05, 1.1, 1.15]}, tree=[1.0, 1.05, 1.1, 1.15])
    dec = make_decoder(tmp_path, branches=2, block_size=4, cost_table=table, controller="adaptive")
    sampling = SamplingParams(1.0, 20, 0.9)
    first = dec.generate(PROMPTS[0], sampling, max_new_tokens=30, seed=5)
    again = dec.generate(PROMPTS[0], sampling, max_new_tokens=30, seed=5)
    assert first.token_ids == again.token_ids
    assert [c.drafts for c in first.cycles] == [c.drafts for c in again.cycles]
    assert all(0 <= c.drafts <= 3 for c in first.cycles)


# ------------------------------------------------------------------ the loop under any depth


def batch_oracle(dec, branches, prompts, controller):
    oracle = BatchOracleProposer(dec, branches, prompts)
    return SpeculativeDecoder(dec.target.model, proposer=oracle, target_cache=dec.target_cache,
                              controller=controller), oracle


@pytest.mark.parametrize("target_cache", ["dynamic", "static"])
def test_greedy_output_equals_the_targets_under_a_switching_controller(tmp_path, target_cache):
    """Depth changing every cycle, plain steps included, drafts the target accepts: greedy
    output is the target's, every cycle's commit is what its depth allows, and the proposer is
    given every committed token's features exactly once (the oracle asserts it), plain steps'
    included, so drafting resumes without a new prefill."""
    dec = make_decoder(tmp_path, "qwen3", 2, block_size=4, target_cache=target_cache)
    expected = [hf_greedy(dec.target.model, p, 30) for p in PROMPTS]
    script = ScriptedDepth(SWITCHING)
    batch_dec, oracle = batch_oracle(dec, 2, PROMPTS, script)
    outs = batch_dec.generate_batch(PROMPTS, SamplingParams(temperature=0.0), max_new_tokens=30,
                                    on_tokens=oracle.on_tokens)
    assert [o.token_ids for o in outs] == expected
    for out in outs:
        assert [c.drafts for c in out.cycles] == script.chosen[: len(out.cycles)]
        assert all(c.num_accepted <= c.drafts for c in out.cycles)
        assert any(c.num_accepted == 3 for c in out.cycles) and any(c.drafts == 0 for c in out.cycles)
    # the real drafter and the adaptive controller (with a cost table that makes it switch)
    table = CostTable(chain={n: [1.0, 1.3, 1.6, 1.9] for n in (1, 2, 4)})
    adaptive_dec = make_decoder(tmp_path, "qwen3", 2, block_size=4, target_cache=target_cache, cost_table=table,
                                controller="adaptive")
    plain = adaptive_dec.generate_batch(PROMPTS, SamplingParams(temperature=0.0), max_new_tokens=30)
    assert [o.token_ids for o in plain] == expected


def test_trie_greedy_output_equals_the_targets_under_a_switching_controller(tmp_path):
    dec = make_decoder(tmp_path, "qwen3", 4, block_size=4)
    expected = hf_greedy(dec.target.model, PROMPTS[0], 30)
    tree_dec, oracle = oracle_decoder(dec, 4, PROMPTS[0], verify="tree", controller=ScriptedDepth(SWITCHING))
    out = tree_dec.generate(PROMPTS[0], SamplingParams(temperature=0.0), max_new_tokens=30,
                            on_tokens=oracle.on_tokens)
    assert out.token_ids == expected
    assert any(c.drafts == 0 for c in out.cycles) and any(c.num_accepted == 3 for c in out.cycles)
    assert all(c.num_accepted <= c.drafts for c in out.cycles)
    table = CostTable(tree=[1.0, 1.3, 1.6, 1.9])
    assert make_decoder(tmp_path, "qwen3", 4, block_size=4, verify="tree", cost_table=table,
                        controller="adaptive").generate(
        PROMPTS[0], SamplingParams(temperature=0.0), max_new_tokens=30).token_ids == expected


def switching_counts(sampling, samples, verify, length=4):
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as folder:
        dec = make_decoder(Path(folder), branches=4, block_size=4, vocab=SMALL_VOCAB, mask=MASK, layers=2,
                           target_layer_ids=(0, 1))
    with torch.no_grad():  # a peaked target: drafts get accepted, deep positions get reached
        dec.target.model.lm_head.weight.mul_(12.0)
    exact = exact_prefix_joint(dec.target.model, SMALL_PROMPT, sampling, length)
    counts = np.zeros_like(exact)
    if verify == "batch":
        rows = [SMALL_PROMPT] * 100
        for first in range(0, samples, len(rows)):
            batch_dec, oracle = batch_oracle(dec, 4, rows, ScriptedDepth(SWITCHING[first // 100 % 8:] + SWITCHING))
            for out in batch_dec.generate_batch(rows, sampling, max_new_tokens=length + 1,
                                                seeds=range(first, first + len(rows)), on_tokens=oracle.on_tokens):
                counts[tuple(out.token_ids[:length])] += 1
        return counts, exact
    for seed in range(samples):
        # each seed starts the script at another point, so every position meets every depth
        script = ScriptedDepth(SWITCHING[seed % len(SWITCHING):] + SWITCHING[: seed % len(SWITCHING)])
        one, oracle = oracle_decoder(dec, 4, SMALL_PROMPT, ranked=verify == "tree", verify=verify, controller=script)
        out = one.generate(SMALL_PROMPT, sampling, max_new_tokens=length + 1, seed=seed, on_tokens=oracle.on_tokens)
        counts[tuple(out.token_ids[:length])] += 1
    return counts, exact


@pytest.mark.parametrize("verify,sampling,samples", [
    ("branch", SamplingParams(0.7, 6, 0.9), 400),
    ("batch", SamplingParams(1.0, 6, 0.9), 400),
    ("tree", SamplingParams(1.5, 6, 0.95), 400),
    pytest.param("branch", SamplingParams(1.5, 0, 0.9), 2000, marks=FULL),
    pytest.param("batch", SamplingParams(0.7, 6, 1.0), 2000, marks=FULL),
    pytest.param("tree", SamplingParams(1.0, 6, 0.9), 2000, marks=FULL),
])
def test_committed_tokens_follow_the_targets_distribution_under_a_switching_controller(verify, sampling, samples):
    counts, exact = switching_counts(sampling, samples, verify)
    assert counts.sum() == samples and counts[exact == 0].sum() == 0
    assert chi_square_pvalue(counts.ravel(), exact.ravel() * samples) > 1e-3
    for position in range(counts.ndim):
        axes = tuple(a for a in range(counts.ndim) if a != position)
        assert chi_square_pvalue(counts.sum(axes), exact.sum(axes) * samples) > 1e-3, position


def test_a_depth_chosen_from_the_cycles_own_draws_fails_the_distribution_test(monkeypatch):
    """The test above can fail: a loop that picks the depth after its draws (a plain step
    whenever this cycle's first uniform is above 1/2, so that uniform then draws the token by
    inverse CDF from the upper half) is not exact, and the test says so."""
    real = ChainCycle.score_and_verify

    def peeking(self, anchors, draft, proposal, branch, uniforms, layout, target_cache, sampling, validate):
        if float(uniforms[0, 1]) > 0.5:
            return self.plain_step(anchors, uniforms, layout, target_cache, sampling)
        return real(self, anchors, draft, proposal, branch, uniforms, layout, target_cache, sampling, validate)

    monkeypatch.setattr(ChainCycle, "score_and_verify", peeking)
    counts, exact = switching_counts(SamplingParams(1.0, 0, 1.0), 400, "branch")
    with pytest.raises(AssertionError):
        assert chi_square_pvalue(counts.ravel(), exact.ravel() * 400) > 1e-3
        for position in range(counts.ndim):
            axes = tuple(a for a in range(counts.ndim) if a != position)
            assert chi_square_pvalue(counts.sum(axes), exact.sum(axes) * 400) > 1e-3, position


def test_an_adaptive_cycle_still_reads_the_device_once(tmp_path):
    """The acceptance the controller needs comes with the cycle's one host read."""
    from test_batched_decoding import HostReads

    table = CostTable(chain={n: [1.0, 1.3, 1.6, 1.9] for n in (1, 2, 4)})
    dec = make_decoder(tmp_path, "qwen3", 4, block_size=4, controller="adaptive", cost_table=table)
    with HostReads() as reads:
        outs = dec.generate_batch(PROMPTS, SamplingParams(1.0, 20, 0.9), max_new_tokens=24, seeds=[1, 2, 3, 4])
    cycles = max(len(o.cycles) for o in outs)
    assert cycles >= 5 and len({c.drafts for o in outs for c in o.cycles}) > 1
    assert len(reads.where) == cycles + 2, reads.where
