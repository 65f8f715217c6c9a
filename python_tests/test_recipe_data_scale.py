"""recipes/smollm2/make_data/data_scale.py: a store's fixed size, each shard's own sampling dtype,
and the shards a run makes when it takes only some temperatures."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2", "make_data"))
import data_scale  # noqa: E402
from data_scale import check_store, plan, sampling_dtype, shard_dtype, shard_facts_path, write_whole  # noqa: E402


def test_a_store_keeps_its_size_and_each_shard_its_own_dtype(tmp_path):
    store = str(tmp_path)
    os.makedirs(os.path.join(store, "responses"))
    check_store(store, {"shard_prompts": 200, "max_new_tokens": 256, "dtype": "bfloat16"})
    check_store(store, {"shard_prompts": 200, "max_new_tokens": 256, "dtype": "float32"})   # a machine without bf16
    with pytest.raises(SystemExit, match="give the same --shard-prompts"):
        check_store(store, {"shard_prompts": 100, "max_new_tokens": 256, "dtype": "bfloat16"})
    assert json.load(open(os.path.join(store, "settings.json")))["dtype"] == "bfloat16"   # the first shards'
    assert shard_dtype(store, "00000-chat") == "bfloat16"   # made before shards recorded their own
    write_whole(shard_facts_path(store, "00094-math"), [{"dtype": "float32", "seconds": 1, "response_tokens": 2}])
    assert shard_dtype(store, "00094-math") == "float32"


@pytest.mark.parametrize("native", [True, False])
def test_native_samples_in_bfloat16_only_where_the_cpu_computes_it(monkeypatch, native):
    from dblast_ext.decoding import fastest_settings

    monkeypatch.setattr(fastest_settings, "cpu_has_native_bf16", lambda: native)
    assert sampling_dtype("native") == ("bfloat16" if native else "float32")
    assert sampling_dtype("float32") == "float32"


def test_a_run_at_some_temperatures_makes_only_their_shards_and_leaves_the_others(tmp_path, monkeypatch):
    made = []

    class Recorder:
        def __init__(self, args):
            pass

        def take(self, entry):
            made.append(entry["shard"])
            return True

    monkeypatch.setattr(data_scale, "Run", Recorder)
    monkeypatch.setattr(sys, "argv", ["data_scale.py", "--shards", "0:12", "--temperatures", "0.7",
                                      "--store", str(tmp_path)])
    data_scale.main()
    assert made == [s for s in range(12) if plan(s)["temperature"] == 0.7] == [0, 1, 2, 3, 8, 9, 10, 11]
    monkeypatch.setattr(sys, "argv", ["data_scale.py", "--temperatures", "0.8", "--store", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--temperatures must be among the planned \[0.7, 1.0\], got \[0.8\]"):
        data_scale.main()
