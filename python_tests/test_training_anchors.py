"""The held-out evaluation's per-anchor output (eval_anchors.jsonl): each block's acceptance
estimate beside eval_log.jsonl's mean, on anchors that depend on the records, the seed,
num_anchors and batch_size alone (so two drafters can be compared block by block), trimmed
with the other logs when a run resumes."""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from dblast_ext.training.config import TrainConfig, validate  # noqa: E402
from dblast_ext.training.losses import accepted_length_per_block, accepted_length_proxy  # noqa: E402
from dblast_ext.training.trainer import read_anchor_log, train  # noqa: E402
from test_training_feature_cache import write_tiny_world  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("anchors")
    target_dir, data = write_tiny_world(root, prompts=14, seed=7, longest_prompt=6, max_new_tokens=16)
    records = open(data).readlines()
    (root / "heldout.jsonl").write_text("".join(records[10:]))
    (root / "train.jsonl").write_text("".join(records[:10]))
    return root, target_dir


def run(world, out, **overrides):
    root, target_dir = world
    fields = dict(target=target_dir, data=str(root / "train.jsonl"), eval_data=str(root / "heldout.jsonl"),
                  out=str(root / out), init_from=None, drafter={"num_hidden_layers": 1, "mask_token_id": 2},
                  block_size=4, objective="nll", num_anchors=4, batch_size=3, lr=3e-3, max_steps=4, save_every=2,
                  eval_at_start=True, device="cpu", autocast="off")
    fields.update(overrides)
    return validate(TrainConfig(**fields))


def test_the_per_block_estimates_are_what_the_proxy_averages():
    torch.manual_seed(0)
    prior = torch.randn(5, 3)
    branch = torch.log_softmax(torch.randn(5, 3, 6, 9), -1)[..., 0]
    target = torch.log(torch.rand(5, 6))
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[2, 3:] = False
    blocks = accepted_length_per_block(prior, branch, target, mask)
    assert blocks.shape == (5,) and torch.all(blocks >= 0) and torch.all(blocks <= 6)
    assert blocks[2] <= 3   # a block cut after 3 positions accepts at most 3
    assert accepted_length_proxy(prior, branch, target, mask) == pytest.approx(float(blocks.mean()), rel=1e-6)


def test_every_held_out_measurement_logs_its_blocks_and_their_mean_is_the_logged_proxy(world):
    config = run(world, "one-layer")
    train(config, progress=False)
    means = [json.loads(line) for line in open(os.path.join(config.out, "eval_log.jsonl"))]
    blocks = read_anchor_log(config.out)
    assert [e["step"] for e in blocks] == [e["step"] for e in means] == [0, 2, 4]
    for entry, mean in zip(blocks, means):
        assert len(entry["record"]) == len(entry["anchor"]) == len(entry["accepted_proxy"]) > 4
        assert sum(entry["accepted_proxy"]) / len(entry["accepted_proxy"]) == pytest.approx(
            mean["accepted_proxy"], abs=1e-5)
    assert blocks[0]["accepted_proxy"] != blocks[-1]["accepted_proxy"]   # the drafter trained in between
    assert set(blocks[0]["record"]) == {0, 1, 2, 3}                       # every held-out record


def test_drafters_of_other_depths_are_measured_on_the_same_anchors_and_another_seed_moves_them(world):
    first = run(world, "one-layer-again")
    train(first, progress=False)
    one = read_anchor_log(first.out)
    deeper = run(world, "two-layers", drafter={"num_hidden_layers": 2, "mask_token_id": 2})
    train(deeper, progress=False)
    two = read_anchor_log(deeper.out)
    pairs = lambda entry: list(zip(entry["record"], entry["anchor"]))  # noqa: E731
    assert [pairs(e) for e in one] == [pairs(e) for e in two]
    assert one[-1]["accepted_proxy"] != two[-1]["accepted_proxy"]
    reseeded = run(world, "seed-1", seed=1, max_steps=0)
    train(reseeded, progress=False)
    assert pairs(read_anchor_log(reseeded.out)[0]) != pairs(one[0])


def test_a_resumed_run_logs_each_step_s_blocks_once(world):
    config = run(world, "stopped")
    train(config, progress=False, stop_at_step=2)
    with open(os.path.join(config.out, "eval_anchors.jsonl"), "a") as f:   # a measurement past the checkpoint
        f.write(json.dumps({"step": 3, "record": [], "anchor": [], "accepted_proxy": []}) + "\n")
    train(config, progress=False)
    assert [e["step"] for e in read_anchor_log(config.out)] == [0, 2, 4]
