"""recipes/smollm2/train_drafters/temperature_probe.py: a chunk's scaled shards split by the
temperature they were sampled at, matched kind by kind."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2", "train_drafters"))
from temperature_probe import split_by_temperature  # noqa: E402


def test_a_chunk_splits_by_temperature_with_as_many_shards_of_each_kind_on_both_sides():
    # data_scale.py: kinds cycle chat, code, chat, math; shards 0-3 at T 0.7, 4-7 at T 1.0, 8-11 at 0.7, ...
    chunk = ["scaled/00000-chat.jsonl.gz", "scaled/00001-code.jsonl.gz", "scaled/00002-chat.jsonl.gz",
             "scaled/00004-chat.jsonl.gz", "scaled/00005-code.jsonl.gz", "scaled/00009-code.jsonl.gz",
             "scaled/00003-math.jsonl.gz", "5x/math-000.jsonl.gz"]
    split = split_by_temperature(chunk)
    # chat: two at 0.7, one at 1.0 -> one each; code: two at 0.7 (1, 9), one at 1.0 (5) -> one each;
    # math: only at 0.7 -> none; the 5x shard is not the scaled set's
    assert split == {0.7: ["scaled/00000-chat.jsonl.gz", "scaled/00001-code.jsonl.gz"],
                     1.0: ["scaled/00004-chat.jsonl.gz", "scaled/00005-code.jsonl.gz"]}
