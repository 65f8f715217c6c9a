"""Category-temperature calibration: the split and the choice."""
import pytest

from dblast_ext.eval.calibration import DEFAULT_GRID, calibrate, macro_expected_accepted, parse_grid, split_prompts
from dblast_ext.eval.datasets import Prompt


def prompts(counts):
    return [Prompt(name, f"{name}-{i}", ["x"]) for name, n in counts.items() for i in range(n)]


def test_split_is_a_disjoint_seeded_tenth_of_each_dataset():
    ps = prompts({"a": 100, "b": 30, "c": 3})
    cal, ev = split_prompts(ps, 0.1, seed=0)
    key = lambda p: (p.dataset, p.prompt_id)  # noqa: E731
    assert not {key(p) for p in cal} & {key(p) for p in ev}
    assert len(cal) + len(ev) == len(ps)
    assert [sum(p.dataset == d for p in cal) for d in "abc"] == [10, 3, 1]
    assert split_prompts(ps, 0.1, seed=0) == (cal, ev)
    assert split_prompts(ps, 0.1, seed=1)[0] != cal
    with pytest.raises(ValueError, match="at least 2"):
        split_prompts(prompts({"a": 1}))


def test_calibration_picks_the_best_macro_average_and_the_smaller_z_on_ties():
    def records(z):  # dataset a peaks at 0.6, b is flat
        return [{"dataset": "a", "expected_accepted": [3 - abs(z - 0.6)]},
                {"dataset": "b", "expected_accepted": [1.0, 2.0]}]
    result = calibrate(records)
    assert result["best"] == 0.6 and result["grid"] == list(DEFAULT_GRID)
    assert result["scores"][3] == pytest.approx((3 + 1.5) / 2)
    assert calibrate(lambda z: [{"dataset": "a", "expected_accepted": [1.0]}], [0.4, 0.8])["best"] == 0.4
    assert macro_expected_accepted([{"dataset": "a", "expected_accepted": [1, 3]},
                                    {"dataset": "b", "expected_accepted": [5]}]) == pytest.approx(3.5)


def test_grid_parsing():
    assert parse_grid("1.0, 0.2,0") == [0.0, 0.2, 1.0]
    with pytest.raises(ValueError, match="--grid"):
        parse_grid("0.2,abc")
    with pytest.raises(ValueError, match="--grid values are category temperatures, >= 0"):
        parse_grid("0.5,-1")
