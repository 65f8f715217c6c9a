"""recipes/smollm2/train_drafters/setting_probe.py: the values of the setting a probe varies."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2", "train_drafters"))
from setting_probe import probe_values  # noqa: E402


def test_values_are_read_as_json_and_checked_against_the_setting():
    assert probe_values("lr_continue", ["3e-4", "1e-4"]) == [3e-4, 1e-4]
    assert probe_values("lr_continue", ["1", "1e-4"]) == [1, 1e-4]   # an int where a float is due is a number
    assert probe_values("select_by", ["null", "greedy_accepted"]) == [None, "greedy_accepted"]
    with pytest.raises(SystemExit, match="lr_contine: not a campaign setting"):
        probe_values("lr_contine", ["3e-4", "1e-4"])
    with pytest.raises(SystemExit, match="at least two values"):
        probe_values("lr_continue", ["3e-4"])
    with pytest.raises(SystemExit, match="values are floats"):
        probe_values("lr_continue", ["3e-4", "fast"])
    with pytest.raises(SystemExit, match="the values repeat"):
        probe_values("base_steps", ["900", "900"])
