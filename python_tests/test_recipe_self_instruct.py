"""recipes/smollm2/make_data/self_instruct.py: instructions read from kept batches are the ones a single
process picks, a run resumes from the batches kept, and a batch another process holds is left
to it."""
import argparse
import fcntl
import json
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2", "make_data"))
from self_instruct import choose, from_kept_batches  # noqa: E402


def fake_sample(calls):
    """Batch b's texts: some repeat earlier batches' (dropped as duplicates), some too short."""
    def sample(b):
        calls.append(b)
        return [f"instruction number {b * 3 + i} of the batch, long enough" for i in range(3)] + \
            ["instruction number 1 of the batch, long enough", "short"]
    return sample


def sequential(count, seen=()):
    chosen, seen, b = [], set(seen), 0
    while len(chosen) < count:
        choose(fake_sample([])(b), chosen, seen, count)
        b += 1
    return chosen


def test_kept_batches_give_the_single_process_choice_and_resume(tmp_path):
    args = argparse.Namespace(batches=str(tmp_path / "b"), count=10)
    calls = []
    assert from_kept_batches(args, fake_sample(calls), set(), limit=100) == sequential(10)
    assert calls == [0, 1, 2, 3]
    again = []
    assert from_kept_batches(args, fake_sample(again), set(), limit=100) == sequential(10)
    assert again == []   # every batch it needs is kept
    os.remove(tmp_path / "b" / "batch-00002.json")
    assert from_kept_batches(args, fake_sample(again), set(), limit=100) == sequential(10)
    assert again == [2]


def test_a_batch_another_process_holds_is_left_to_it(tmp_path):
    folder = tmp_path / "b"
    folder.mkdir()
    args = argparse.Namespace(batches=str(folder), count=10)
    lock = open(folder / "batch-00000.json.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)   # "another process" is on batch 0
    calls, result = [], {}
    worker = threading.Thread(target=lambda: result.update(chosen=from_kept_batches(args, fake_sample(calls),
                                                                                     set(), limit=100)))
    worker.start()
    while len(calls) < 3:   # it samples the batches after 0, then waits for 0
        worker.join(0.05)
    (folder / "batch-00000.json").write_text(json.dumps(fake_sample([])(0)))
    lock.close()
    worker.join(30)
    assert not worker.is_alive()
    assert 0 not in calls and result["chosen"] == sequential(10)
