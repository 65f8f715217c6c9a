"""Committed-length metrics against hand-computed values and direct computations."""
import numpy as np
import pytest
from scipy import stats

from dblast_ext.eval.metrics import (expansion_decomposition, first_draft_accepted, holm, macro_average,
                                     paired_delta_tau, paired_macro_delta, spearman, summarize)
from dblast_ext.eval.records import append_record, clip_last_cycle, read_records


def record(prompt_id, accepted, *, eos=True, block=16, dataset="d", expected=None, **extra):
    return dict(dataset=dataset, prompt_id=prompt_id, accepted=list(accepted), block_size=block,
                eos_terminated=eos, expected_accepted=list(expected if expected is not None else accepted),
                new_tokens=sum(n + 1 for n in accepted) + 1, wall_time=1.0, **extra)


@pytest.mark.parametrize("a,b,cycle_mean", [
    ([7, 7], [1] * 8, 3.2),   # DBloom Table 8, case 1: the long prompt drafts poorly
    ([1, 1], [7] * 8, 6.8),   # case 2: the long prompt drafts well
])
def test_dbloom_table_8_identical_tau_opposite_cycle_means(a, b, cycle_mean):
    s = summarize([record("A", a), record("B", b)])
    assert s["tau"] == pytest.approx(5.0)
    assert s["cycle_mean"] == pytest.approx(cycle_mean)
    assert s["n_prompts"] == 2 and s["n_cycles"] == 10


def test_cycle_mean_minus_tau_is_the_covariance_identity():
    rng = np.random.default_rng(0)
    records = [record(i, rng.integers(0, 16, size=rng.integers(1, 30))) for i in range(40)]
    s = summarize(records)
    c = np.array([len(r["accepted"]) for r in records], dtype=float)
    nbar = np.array([np.mean(r["accepted"]) for r in records])
    cov = np.mean((c - c.mean()) * (nbar - nbar.mean()))  # population covariance, DBloom Eq 2
    assert s["cycle_mean"] - s["tau"] == pytest.approx(cov / c.mean())


def test_non_terminated_responses_are_left_out_unless_asked():
    records = [record("a", [2, 4]), record("b", [15, 15, 15], eos=False), record("c", [0])]
    eos = summarize(records)
    assert eos["tau"] == pytest.approx(1 + (3 + 0) / 2)
    assert eos["cycle_mean"] == pytest.approx(1 + 6 / 3)
    assert eos["n_prompts"] == 2 and eos["n_responses"] == 3 and eos["n_eos_terminated"] == 2
    everything = summarize(records, eos_only=False)
    assert everything["tau"] == pytest.approx(1 + (3 + 15 + 0) / 3)
    assert everything["cycle_mean"] == pytest.approx(1 + 51 / 6)
    assert everything["ceiling_fraction"] == pytest.approx(3 / 6)


def test_histogram_ceiling_expected_and_speedup_by_hand():
    records = [record("a", [0, 3, 3], expected=[0.5, 2.0, 2.5], ar_wall_time=3.0, ar_new_tokens=10),
               record("b", [3, 1], block=4, expected=[1.0, 1.0])]
    records[0]["block_size"] = 4
    s = summarize(records)
    assert s["histogram"] == [1, 1, 0, 3]
    assert s["ceiling_fraction"] == pytest.approx(3 / 5)
    assert s["expected_accepted"] == pytest.approx(7.0 / 5)
    # pooled over the timed response only: (3.0 s / 10 tokens) / (1.0 s / 10 tokens)
    assert s["speedup"] == pytest.approx(3.0)
    assert summarize([record("x", [1])])["speedup"] is None


def test_repeated_responses_of_one_prompt_pool_their_cycles():
    s = summarize([record("p", [1, 1]), record("p", [4]), record("q", [0])])
    assert s["n_prompts"] == 2
    assert s["tau"] == pytest.approx(1 + (6 / 3 + 0) / 2)


def test_bootstrap_intervals_cover_the_truth_at_about_the_nominal_rate():
    """Synthetic runs from a known process: prompt quality q ~ U(0.2, 0.9), cycles c ~
    1 + Poisson(8) independent of q, n ~ Binomial(15, q). True tau = 1 + 15 E[q];
    true cycle mean = 1 + 15 E[c q] / E[c] = the same (c independent of q)."""
    truth = 1 + 15 * 0.55
    covered_tau = covered_cycle = 0
    experiments = 300
    for e in range(experiments):
        rng = np.random.default_rng(1000 + e)
        records = []
        for p in range(60):
            q = rng.uniform(0.2, 0.9)
            records.append(record(p, rng.binomial(15, q, size=1 + rng.poisson(8))))
        s = summarize(records, n_boot=400, seed=e)
        covered_tau += s["tau_ci"][0] <= truth <= s["tau_ci"][1]
        covered_cycle += s["cycle_mean_ci"][0] <= truth <= s["cycle_mean_ci"][1]
    # nominal 95%; percentile bootstraps run slightly under it at 60 prompts
    assert 0.89 <= covered_tau / experiments <= 0.99
    assert 0.89 <= covered_cycle / experiments <= 0.99


def test_intervals_are_reproducible_and_contain_the_estimate():
    records = [record(i, np.random.default_rng(i).integers(0, 16, size=5)) for i in range(30)]
    a, b = summarize(records, seed=3), summarize(records, seed=3)
    assert a == b
    assert a["tau_ci"][0] <= a["tau"] <= a["tau_ci"][1]
    assert a["cycle_mean_ci"][0] <= a["cycle_mean"] <= a["cycle_mean_ci"][1]


def test_paired_delta_tau_by_hand_and_its_test():
    a = [record("p1", [1, 3]), record("p2", [0]), record("p3", [5], eos=False)]
    b = [record("p1", [4]), record("p2", [2, 2]), record("p3", [9])]
    out = paired_delta_tau(a, b)
    assert out["n"] == 2  # p3 did not terminate in A
    assert out["delta"] == pytest.approx(((4 - 2) + (2 - 0)) / 2)
    # a clear shift on many prompts is significant; a null one is not
    rng = np.random.default_rng(0)
    base = [record(i, rng.integers(0, 10, size=4)) for i in range(50)]
    shifted = [record(r["prompt_id"], [min(15, n + 2) for n in r["accepted"]]) for r in base]
    noisy = [record(r["prompt_id"], rng.permutation(r["accepted"] + [int(rng.integers(0, 10))])) for r in base]
    sig = paired_delta_tau(base, shifted)
    assert sig["p_value"] < 0.01 and sig["ci"][0] > 0
    null = paired_delta_tau(base, base)
    assert null["delta"] == 0 and null["p_value"] == 1.0
    assert 0 < paired_delta_tau(base, noisy)["p_value"] <= 1


def test_paired_comparison_rejects_different_prompt_sets():
    with pytest.raises(ValueError, match="different prompts"):
        paired_delta_tau([record("a", [1])], [record("b", [1])])


def holm_direct(p, alpha):
    """Holm via adjusted p-values: p_adj(i) = max_{j <= i} min(1, (m - j) p_(j)), 0-based j."""
    m, order = len(p), np.argsort(p)
    adjusted, running = np.empty(m), 0.0
    for j, i in enumerate(order):
        running = max(running, min(1.0, (m - j) * p[i]))
        adjusted[i] = running
    return list(adjusted <= alpha)


def test_holm_matches_the_adjusted_p_value_form():
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = rng.uniform(0, 0.1, size=rng.integers(1, 12)) ** rng.uniform(0.5, 2)
        assert holm(p, 0.05) == holm_direct(p, 0.05)
    assert holm([0.01, 0.04, 0.03, 0.005]) == [True, False, False, True]
    assert holm([]) == []
    with pytest.raises(ValueError, match="p-values"):
        holm([0.5, 1.5])


def test_spearman_matches_scipy_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(50):
        x, y = rng.integers(0, 6, size=12), rng.normal(size=12)
        assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic)
    with pytest.raises(ValueError, match="same length"):
        spearman([1, 2, 3], [1, 2])


def test_expansion_decomposition_g_minus_l_is_the_change_in_mean_n():
    rng = np.random.default_rng(0)
    for _ in range(20):
        trained, wider = rng.integers(0, 50, size=16), rng.integers(0, 50, size=24)
        d = expansion_decomposition(trained, wider, 16)
        mean = lambda h: np.dot(np.arange(len(h)), h) / np.sum(h)  # noqa: E731
        assert d["G"] - d["L"] == pytest.approx(mean(wider) - mean(trained))
        assert d["G"] <= d["gain_bound"] + 1e-12
    # by hand: trained B=4 all at the ceiling; wider B=6 half at 1, half at 5
    d = expansion_decomposition([0, 0, 0, 10], [0, 5, 0, 0, 0, 5], 4)
    assert d["survival"] == pytest.approx(0.5)       # P_6(n >= 4)
    assert d["G"] == pytest.approx(0.5 + 0.5)        # P(n>=4) + P(n>=5)
    assert d["L"] == pytest.approx((1 - 1) + (1 - 0.5) + (1 - 0.5))
    with pytest.raises(ValueError, match="bins"):
        expansion_decomposition([1, 2, 3], [1, 2, 3, 4, 5], 4)


@pytest.mark.parametrize("records,message", [
    ([], "no records"),
    ([record("a", [1], block=4), record("b", [1], block=8)], "block sizes"),
    ([record("a", [4], block=4)], "outside 0..3"),
    ([record("a", [1], eos=False)], "end-of-sequence"),
])
def test_bad_runs_fail_clearly(records, message):
    with pytest.raises(ValueError, match=message):
        summarize(records)


def test_first_draft_accepted_is_the_share_of_cycles_with_a_draft_accepted():
    s = summarize([record("a", [0, 2, 0, 5]), record("b", [1, 0, 15, 0])])
    assert first_draft_accepted(s) == pytest.approx(4 / 8)


def test_records_read_count_only_the_tokens_a_response_kept(tmp_path):
    # the verifier accepted 5 drafts in the last cycle, the response kept 2 of its 6 tokens
    cut = dict(record("p", [3, 5]), new_tokens=1 + 4 + 2)
    path = str(tmp_path / "records.jsonl")
    append_record(path, cut)
    append_record(path, record("q", [3, 5]))  # not cut: unchanged
    assert [r["accepted"] for r in read_records(path)] == [[3, 1], [3, 5]]
    assert clip_last_cycle(clip_last_cycle(cut)) == clip_last_cycle(cut)
    with pytest.raises(ValueError, match="more tokens than its 3 new tokens"):
        clip_last_cycle(dict(record("p", [3, 5]), new_tokens=3))


def test_macro_averages_need_every_dataset():
    from dblast_ext.eval.report import summarize_run
    both = [record("p", [2, 4], dataset="a"), record("q", [0, 1], dataset="b")]
    result = summarize_run(both, n_boot=50)
    assert result["macro"]["tau"] == pytest.approx(np.mean([4.0, 1.5]))
    assert result["macro"]["speedup"] is None  # no dataset was timed
    # b's only response ran to the cap: b is reported as skipped and the run has no macro-average
    result = summarize_run([both[0], record("q", [0, 1], dataset="b", eos=False)], n_boot=50)
    assert set(result["skipped"]) == {"b"} and result["macro"]["tau"] is None
    assert macro_average({"a": {"speedup": 1.2}, "b": {"speedup": None}}, "speedup") is None


def test_a_live_read_skips_the_line_being_written(tmp_path):
    path = tmp_path / "records.jsonl"
    append_record(str(path), record("p", [1, 2]))
    with open(path, "a") as f:
        f.write('{"dataset": "d", "prompt_id": "q", "acc')  # another process is mid-write
    assert [r["prompt_id"] for r in read_records(str(path), live=True)] == ["p"]
    with pytest.raises(ValueError, match="line 2 is not valid JSON.*cut short"):
        read_records(str(path))  # a finished run's file: a cut line is reported


def test_contended_responses_counts_timed_responses_on_busy_cores():
    timed = dict(ar_wall_time=1.0, ar_new_tokens=5)
    records = [record("A", [1, 2], foreign_load=0.9, **timed),               # speculative run contended
               record("B", [1, 2], foreign_load=0.0, ar_foreign_load=0.4, **timed),  # target-only run contended
               record("C", [1, 2], foreign_load=0.1, ar_foreign_load=0.1, **timed),  # quiet
               record("D", [1, 2], **timed),                                  # load unknown (older records)
               record("E", [1, 2], foreign_load=3.0)]                         # not timed against the target
    assert summarize(records)["contended_responses"] == 2


def test_paired_macro_delta_by_hand_and_its_interval():
    """Per dataset the cycle mean of expected_accepted over the prompts both runs kept, then the
    mean over datasets; the interval resamples prompts within each dataset for both runs."""
    a = [record("p1", [1, 1], expected=[1.0, 2.0], dataset="x"), record("p2", [0], expected=[0.5], dataset="x"),
         record("p3", [2], expected=[3.0], dataset="x", eos=False), record("q1", [1], expected=[1.0], dataset="y")]
    b = [record("p1", [2], expected=[2.5], dataset="x"), record("p2", [1, 0], expected=[1.5, 0.5], dataset="x"),
         record("p3", [0], expected=[9.0], dataset="x"), record("q1", [3, 1], expected=[3.0, 2.0], dataset="y")]
    out = paired_macro_delta(a, b)
    # x: A (1 + 2 + 0.5) / 3, B (2.5 + 1.5 + 0.5) / 3 (p3 did not end with EOS in A); y: A 1, B 2.5
    expect_a, expect_b = (3.5 / 3 + 1.0) / 2, (4.5 / 3 + 2.5) / 2
    assert out["a"] == pytest.approx(expect_a) and out["b"] == pytest.approx(expect_b)
    assert out["delta"] == pytest.approx(expect_b - expect_a) and out["n"] == {"x": 2, "y": 1}
    assert paired_macro_delta(a, b, eos_only=False)["n"] == {"x": 3, "y": 1}
    # a clear shift on many prompts has an interval above 0; a run against itself has delta 0
    rng = np.random.default_rng(1)
    base = [record(i, [1] * 4, expected=rng.uniform(0, 3, size=4), dataset=("x", "y")[i % 2]) for i in range(60)]
    shifted = [dict(r, expected_accepted=[e + 0.3 + rng.normal(0, 0.2) for e in r["expected_accepted"]])
               for r in base]
    sig = paired_macro_delta(base, shifted)
    assert sig["ci"][0] > 0 and sig["ci"][0] < sig["delta"] < sig["ci"][1]
    same = paired_macro_delta(base, base)
    assert same["delta"] == 0 and same["ci"] == [0.0, 0.0]
    noisy = [dict(r, expected_accepted=[e + rng.normal(0, 1) for e in r["expected_accepted"]]) for r in base]
    null = paired_macro_delta(base, noisy)
    assert null["ci"][0] < 0 < null["ci"][1]
    with pytest.raises(ValueError, match="different prompts"):
        paired_macro_delta(a, b[:3])
    with pytest.raises(ValueError, match="dataset y: no prompt"):
        paired_macro_delta(a, [dict(r, eos_terminated=r["dataset"] == "x") for r in b])
