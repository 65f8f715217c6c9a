"""The trainer end to end on a tiny target (with a peaked LM head, so there is something to
learn) and a DFlash-format drafter: learning, exact resume, block expansion, from-scratch
initialisation, checkpoints that load and decode, the position weights, feature scaling
folded into the saved drafter, and config errors."""
import copy
import json
import math
import os
import random

import pytest
import torch

pytest.importorskip("transformers")

from dblast_ext import load_drafter  # noqa: E402
from dblast_ext.cli import main  # noqa: E402
from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder  # noqa: E402
from dblast_ext.eval.datasets import load_prompts  # noqa: E402
from dblast_ext.target.loading import load_target  # noqa: E402
from dblast_ext.training.config import TrainConfig, load_config, validate  # noqa: E402
from dblast_ext.training.data import generate_training_data  # noqa: E402
from dblast_ext.drafting.drafter_io import set_feature_scale  # noqa: E402
from dblast_ext.training.block_forward import block_inputs, drafter_block_hidden  # noqa: E402
from dblast_ext.training.trainer import (STATE_FILE, _Distributed, default_target_layers, lr_factor,  # noqa: E402
                                         position_weights, train)
from tiny_models import write_dflash_checkpoint, write_tiny_target_dir  # noqa: E402

SAMPLING = SamplingParams(0.7, 20, 0.8)  # the DBLast data setting


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target_dir = write_tiny_target_dir(root / "target", logit_scale=10.0, eos_id=1)
    rng = random.Random(0)
    files = {}
    for name, count in (("train", 40), ("heldout", 8)):
        lines = [json.dumps({"prompt": " ".join(f"t{rng.randrange(3, 96)}" for _ in range(rng.randrange(2, 6)))})
                 for _ in range(count)]
        (root / f"{name}-prompts.jsonl").write_text("\n".join(lines) + "\n")
        model, tokenizer = load_target(target_dir, device="cpu")
        generate_training_data(model, tokenizer, load_prompts(str(root / f"{name}-prompts.jsonl")),
                               str(root / f"{name}.jsonl"), sampling=SAMPLING, samples_per_prompt=2 if name == "train" else 1,
                               max_new_tokens=24, batch_size=8, seed=0, progress=False)
        files[name] = str(root / f"{name}.jsonl")
    drafter = write_dflash_checkpoint(root / "dflash", block_size=4)
    return root, target_dir, drafter, files


def config(world, out, **overrides):
    root, target, drafter, files = world
    fields = dict(target=target, data=files["train"], eval_data=files["heldout"], out=str(root / out),
                  init_from=drafter, num_branches=4, objective="al", num_anchors=6, batch_size=4, lr=3e-3,
                  warmup_ratio=0.05, max_steps=40, save_every=20, log_every=5, device="cpu")
    fields.update(overrides)
    return validate(TrainConfig(**fields))


def heldout_expected_accepted(target_dir, drafter, prompts_file):
    model, tokenizer = load_target(target_dir, device="cpu")
    decoder = SpeculativeDecoder(model, drafter, controller="off")  # acceptance: every cycle drafts
    values = []
    for i, prompt in enumerate(load_prompts(prompts_file)):
        ids = tokenizer(prompt.turns[0])["input_ids"]
        out = decoder.generate(ids, SAMPLING, max_new_tokens=24, seed=i)
        values += [c.expected_accepted for c in out.cycles]
    return sum(values) / len(values)


@pytest.mark.parametrize("objective,branches,distill", [("al", 4, 0.0), ("nll", 4, 0.5), ("nll", 1, 0.0)])
def test_training_lowers_the_loss_and_raises_held_out_acceptance(world, objective, branches, distill):
    root, target_dir, drafter_dir, _ = world
    name = f"learn-{objective}-{branches}-{distill}"
    c = config(world, name, objective=objective, num_branches=branches, max_steps=300, save_every=150, lr=1e-2,
               distill_weight=distill)
    result = train(c, progress=False)
    losses = [h["loss"] for h in result["history"]]
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10
    evals = [json.loads(line) for line in open(root / name / "eval_log.jsonl")]
    assert [e["step"] for e in evals] == [150, 300]
    model, _ = load_target(target_dir, device="cpu")
    before = load_drafter(drafter_dir, target=model, num_branches=branches if branches > 1 else None)
    after = load_drafter(result["final"], target=model)
    assert after.num_branches == branches
    gain = (heldout_expected_accepted(target_dir, after, str(root / "heldout-prompts.jsonl"))
            - heldout_expected_accepted(target_dir, before, str(root / "heldout-prompts.jsonl")))
    # a random drafter is almost never accepted (~0.001); a few hundred steps reach ~0.05-0.1
    assert gain > 0.03, gain


def test_an_interrupted_run_resumes_to_the_same_state(world):
    whole = train(config(world, "whole", max_steps=12, save_every=4, grad_accum=2), progress=False)
    cut = config(world, "cut", max_steps=12, save_every=4, grad_accum=2)
    partial = train(cut, progress=False, stop_at_step=8)
    assert partial["steps"] == 8 and partial["final"] is None
    resumed = train(cut, progress=False)
    assert [h["step"] for h in resumed["history"]] == [9, 10, 11, 12]
    a = load_drafter(whole["final"]).state_dict()
    b = load_drafter(resumed["final"]).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [h["loss"] for h in whole["history"][8:]] == [h["loss"] for h in resumed["history"]]


def _scripted_held_out_losses(monkeypatch, losses):
    """trainer.evaluate returning the given held-out losses in turn (the real one runs too, for
    its other fields)."""
    from dblast_ext.training import trainer

    real, queue = trainer.evaluate, list(losses)

    def scripted(*args, **kwargs):
        return dict(real(*args, **kwargs), loss=queue.pop(0))
    monkeypatch.setattr(trainer, "evaluate", scripted)


def test_training_stops_at_a_plateau_and_keeps_the_best_checkpoint(world, monkeypatch):
    # held-out losses at steps 4, 8, 12, 16: best at 8, then two checkpoints without a lower one
    _scripted_held_out_losses(monkeypatch, [5.0, 4.0, 4.5, 4.0, 3.0])
    c = config(world, "plateau", max_steps=40, save_every=4, patience=2)
    result = train(c, progress=False)
    assert result["stopped_early"] and result["steps"] == 16 and result["best_step"] == 8
    assert not os.path.exists(os.path.join(c.out, "checkpoint-0000020"))
    best = os.path.join(c.out, "checkpoint-0000008")
    for name in ("model.safetensors", "config.json"):
        with open(os.path.join(best, name), "rb") as a, open(os.path.join(result["final"], name), "rb") as b:
            assert a.read() == b.read(), name
    assert not os.path.exists(os.path.join(result["final"], STATE_FILE))
    # run again: it had stopped, so nothing more is trained
    again = train(c, progress=False)
    assert again["history"] == [] and again["stopped_early"] and again["best_step"] == 8


def test_a_resumed_run_counts_the_plateau_from_where_it_stopped(world, monkeypatch):
    _scripted_held_out_losses(monkeypatch, [5.0, 4.0, 4.5, 4.6])
    c = config(world, "plateau-resume", max_steps=40, save_every=4, patience=2)
    assert train(c, progress=False, stop_at_step=12)["steps"] == 12  # one stale checkpoint so far
    resumed = train(c, progress=False)
    assert resumed["stopped_early"] and resumed["steps"] == 16 and resumed["best_step"] == 8


def test_select_by_the_accepted_proxy_keeps_the_highest_proxy_however_the_loss_moves(world, monkeypatch):
    """The surrogate's held-out loss can rise while the drafter gets better (its retained prefix
    set grows): with select_by accepted_proxy the plateau and final/ follow the proxy."""
    from dblast_ext.training import trainer

    real = trainer.evaluate
    queue = [(5.0, 0.40), (5.2, 0.45), (5.3, 0.50), (4.9, 0.48), (4.8, 0.47)]  # (loss, proxy) at 4..20

    def scripted(*args, **kwargs):
        loss, proxy = queue.pop(0)
        return dict(real(*args, **kwargs), loss=loss, accepted_proxy=proxy)
    monkeypatch.setattr(trainer, "evaluate", scripted)
    c = config(world, "select-proxy", max_steps=40, save_every=4, patience=2, select_by="accepted_proxy")
    result = train(c, progress=False)
    assert result["stopped_early"] and result["steps"] == 20 and result["best_step"] == 12


def test_a_resumed_run_may_change_select_by_and_replays_its_plateau(world, monkeypatch):
    """select_by chooses among checkpoints, not what is trained: a run resumed with another
    measure continues (its plateau replayed from eval_log.jsonl), and the steps logged after
    the checkpoint it resumes from are logged once."""
    from dblast_ext.training import trainer

    real = trainer.evaluate
    queue = [(5.0, 0.40), (5.5, 0.50), (5.6, 0.45), (5.7, 0.44)]  # (loss, proxy) at steps 4, 8, 10, 12

    def scripted(*args, **kwargs):
        loss, proxy = queue.pop(0)
        return dict(real(*args, **kwargs), loss=loss, accepted_proxy=proxy)
    monkeypatch.setattr(trainer, "evaluate", scripted)
    c = config(world, "reselect", max_steps=40, save_every=4, log_every=1, patience=2)
    # by the loss it stops at step 10 (the last step checkpoints too): best 4, then two stale
    first = train(c, progress=False, stop_at_step=10)
    assert first["stopped_early"] and first["best_step"] == 4
    with open(os.path.join(c.out, "train_log.jsonl"), "a") as f:  # a kill after step 11: logged, not saved,
        f.write(json.dumps({"step": 11, "loss": 1.0}) + "\n" + '{"step": 12, "lo')  # and step 12 cut short
    # by the proxy the same checkpoints say best 8, one stale: it goes on, to step 12
    resumed = train(config(world, "reselect", max_steps=40, save_every=4, log_every=1, patience=2,
                           select_by="accepted_proxy"), progress=False)
    assert resumed["stopped_early"] and resumed["steps"] == 12 and resumed["best_step"] == 8
    steps = [json.loads(line)["step"] for line in open(os.path.join(c.out, "train_log.jsonl"))]
    assert steps == list(range(1, 13))


def test_a_plateau_saved_before_select_by_resumes_on_the_loss():
    from dblast_ext.training import trainer

    plateau = trainer.Plateau(3, {"plateau": {"best_step": 8, "best_loss": 4.0, "stale": 1}})
    plateau.update(12, {"loss": 4.5, "accepted_proxy": 0.9})
    assert (plateau.best_step, plateau.best_value, plateau.stale) == (8, 4.0, 2)
    plateau.update(16, {"loss": 3.5, "accepted_proxy": 0.1})
    assert (plateau.best_step, plateau.stale) == (16, 0)


def test_held_out_evaluation_reports_top1_agreement_per_block_position(world):
    c = config(world, "agreement", max_steps=4, save_every=4)
    train(c, progress=False)
    entry = json.loads(open(os.path.join(c.out, "eval_log.jsonl")).readline())
    agreement = entry["top1_agreement"]
    assert len(agreement) == 3  # block 4: three draft positions
    assert all(a is None or 0 <= a <= 1 for a in agreement) and any(a is not None for a in agreement)
    # the greedy chain's accepted length: a run over at most the three draft positions
    assert 0 <= entry["greedy_accepted"] <= 3


def test_select_by_the_greedy_chain_keeps_its_best_checkpoint(world, monkeypatch):
    from dblast_ext.training import trainer

    real = trainer.evaluate
    queue = [(5.0, 0.40, 1.0), (4.0, 0.45, 1.3), (3.0, 0.50, 1.2), (2.9, 0.55, 1.1)]  # at steps 4..16

    def scripted(*args, **kwargs):
        loss, proxy, greedy = queue.pop(0)
        return dict(real(*args, **kwargs), loss=loss, accepted_proxy=proxy, greedy_accepted=greedy)
    monkeypatch.setattr(trainer, "evaluate", scripted)
    c = config(world, "select-greedy", max_steps=40, save_every=4, patience=2, select_by="greedy_accepted")
    result = train(c, progress=False)
    assert result["stopped_early"] and result["steps"] == 16 and result["best_step"] == 8


def test_eval_at_start_measures_the_initial_drafter_as_step_zero(world):
    c = config(world, "at-start", max_steps=4, save_every=4, eval_at_start=True)
    result = train(c, progress=False)
    evals = [json.loads(line) for line in open(os.path.join(c.out, "eval_log.jsonl"))]
    assert [e["step"] for e in evals] == [0, 4]
    assert result["initial_held_out"] == {k: v for k, v in evals[0].items() if k != "step"}
    # step 0 is the init's loss: a zero-step run of the same config measures the same number
    measured = train(config(world, "at-start-only", max_steps=0, save_every=4, eval_at_start=True), progress=False)
    assert measured["steps"] == 0 and measured["history"] == []
    assert measured["initial_held_out"]["loss"] == pytest.approx(evals[0]["loss"], rel=1e-6)
    # its final/ is the drafter it started from, K = 4 head added
    before, after = load_drafter(world[2], num_branches=4), load_drafter(measured["final"])
    assert after.num_branches == 4
    assert torch.allclose(before.fc.weight, after.fc.weight, rtol=1e-5, atol=1e-7)
    # a resumed run does not measure its start again
    cut = config(world, "at-start-resume", max_steps=8, save_every=4, eval_at_start=True)
    train(cut, progress=False, stop_at_step=4)
    train(cut, progress=False)
    steps = [json.loads(line)["step"] for line in open(os.path.join(cut.out, "eval_log.jsonl"))]
    assert steps == [0, 4, 8]


def test_eval_at_start_needs_held_out_data_and_zero_steps_need_eval_at_start(world):
    with pytest.raises(ValueError, match="eval_at_start .* needs eval_data"):
        config(world, "x", eval_data=None, eval_at_start=True)
    with pytest.raises(ValueError, match="max_steps must be a positive integer"):
        config(world, "x", max_steps=0)


def test_a_resume_refuses_other_training_data_at_the_same_path(world, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(open(world[3]["train"]).read())
    c = config(world, "resume-data", data=str(data), max_steps=8, save_every=4)
    assert train(c, progress=False, stop_at_step=4)["steps"] == 4
    data.write_text("".join(open(world[3]["train"]).readlines()[:-3]))  # regenerated: fewer records
    with pytest.raises(ValueError, match="another data_sha256"):
        train(c, progress=False)


def test_the_log_gives_each_steps_learning_rate_and_checkpoints_are_whole(world):
    c = config(world, "lr-log", max_steps=10, save_every=5, warmup_ratio=0.3)
    result = train(c, progress=False)
    warmup = int(0.3 * 10)
    expected = [c.lr * lr_factor(step, 10, warmup) for step in range(10)]  # step 1 uses the rate of s = 0
    assert [h["lr"] for h in result["history"]] == pytest.approx(expected)
    for step in (5, 10):
        folder = os.path.join(c.out, f"checkpoint-{step:07d}")
        assert os.path.isfile(os.path.join(folder, STATE_FILE))
        assert not [f for f in os.listdir(folder) if f.endswith(".partial")]


def test_every_rank_reduces_every_gradient_and_weighs_by_blocks(monkeypatch):
    """A rank whose micro-batches held no valid block has no gradient for some parameters; it
    must still take part in each all_reduce, or the ranks' collectives fall out of step. The
    gradients (of per-block loss sums) end as the mean over every block of the step: this rank
    3 blocks, the other 1, so (sum here + sum there) / 4, as one batch of 4 blocks would give."""
    other_rank = iter([torch.tensor([1.0]), torch.full((3,), 2.0), torch.full((2,), 6.0)])  # count, then grads
    reduced = []
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda tensor: reduced.append(tensor.shape) or tensor.add_(next(other_rank)))
    parallel = _Distributed("cpu")
    parallel.world = 2
    used, unused, frozen = (torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2)),
                            torch.nn.Parameter(torch.ones(1), requires_grad=False))
    used.grad = torch.full((3,), 10.0)
    assert parallel.average_gradients([used, unused, frozen], blocks=3) == 4
    assert reduced == [(1,), (3,), (2,)] and frozen.grad is None
    assert torch.equal(used.grad, torch.full((3,), 3.0)) and torch.equal(unused.grad, torch.full((2,), 1.5))


def test_one_process_divides_the_summed_gradients_by_its_blocks():
    parallel = _Distributed("cpu")
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.tensor([6.0, -3.0])
    assert parallel.average_gradients([weight], blocks=3) == 3
    assert torch.equal(weight.grad, torch.tensor([2.0, -1.0]))


def test_a_checkpoint_loads_and_decodes_like_the_target(world):
    root, target_dir, _, _ = world
    result = train(config(world, "decode", max_steps=6, save_every=3), progress=False)
    model, tokenizer = load_target(target_dir, device="cpu")
    for path in (result["final"], str(root / "decode" / "checkpoint-0000003")):
        decoder = SpeculativeDecoder(model, load_drafter(path, target=model))
        ids = tokenizer("t5 t6 t7")["input_ids"]
        expected = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, eos_token_id=None,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
        assert decoder.generate(ids, SamplingParams(0.0), max_new_tokens=16).token_ids == expected[0, len(ids):].tolist()


def test_position_weights_are_the_dflash_decay_times_the_flat_step(world):
    decay = [math.exp(-k / 7) for k in range(5)]
    assert position_weights(config(world, "w"), 5, None).tolist() == pytest.approx(decay)   # gamma 7 by default
    stepped = position_weights(config(world, "w", new_position_weight=3.0), 5, 4).tolist()
    assert stepped == pytest.approx([w * (3 if k >= 3 else 1) for k, w in enumerate(decay)])
    assert position_weights(config(world, "w", decay=2.5), 3, None).tolist() == \
        pytest.approx([1, math.exp(-1 / 2.5), math.exp(-2 / 2.5)])
    for uniform in (None, 0):
        assert position_weights(config(world, "w", decay=uniform), 5, None) is None


def test_block_expansion_trains_the_new_positions_with_the_flat_step(world):
    c = config(world, "expand", block_size=6, new_position_weight=3.0, decay=None, max_steps=6, save_every=6)
    assert position_weights(c, 5, 4).tolist() == [1, 1, 1, 3, 3]
    result = train(c, progress=False)
    assert load_drafter(result["final"]).config.block_size == 6
    with pytest.raises(ValueError, match="below the checkpoint"):
        train(config(world, "shrink", block_size=3, max_steps=2), progress=False)


def test_an_expansion_without_the_tail_weight_says_so(world, capsys):
    train(config(world, "expand-flat", block_size=6, max_steps=2, save_every=2), progress=False)
    assert "block 4 -> 6 with the new positions weighted like the others" in capsys.readouterr().err
    train(config(world, "expand-weighted", block_size=6, new_position_weight=3.0, max_steps=2, save_every=2),
          progress=False)
    assert "weighted like the others" not in capsys.readouterr().err


def block_hidden(drafter, seed=0):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(2, 12, len(drafter.config.target_layer_ids) * drafter.config.hidden_size, generator=g)
    table = torch.randn(100, drafter.config.hidden_size, generator=g)
    anchors, input_ids = torch.tensor([[2, 7], [5, 8]]), torch.randint(3, 90, (2, 12), generator=g)
    inputs = block_inputs(drafter, lambda ids: table[ids], input_ids, anchors)
    with torch.no_grad():
        return drafter_block_hidden(drafter, inputs["embeddings"], inputs["positions"], features, anchors)


def test_the_saved_drafter_is_dflash_format_and_computes_the_trained_one(world):
    """Checkpoints hold fc with the feature scale folded in (DFlash's keys, nothing more) and
    give what the drafter computed during training: the unfolded weights and the scale in
    the trainer state."""
    c = config(world, "scaled", max_steps=4, save_every=4)
    assert c.feature_scaling == "rms"
    result = train(c, progress=False)
    state = torch.load(os.path.join(c.out, "checkpoint-0000004", STATE_FILE), weights_only=False)
    scale = state["feature_scale"]
    assert scale.shape == (2 * 64,) and not torch.allclose(scale, torch.ones_like(scale))
    saved = load_drafter(result["final"])
    assert set(saved.state_dict()) == set(state["drafter"])
    trained = load_drafter(result["final"])
    trained.load_state_dict(state["drafter"])
    set_feature_scale(trained, scale, keep_function=False)
    assert not torch.allclose(trained.fc.weight, saved.fc.weight)
    torch.testing.assert_close(block_hidden(saved), block_hidden(trained), rtol=1e-5, atol=1e-5)


def test_a_run_from_before_the_new_fields_resumes_with_their_old_values(world):
    c = config(world, "legacy", feature_scaling="none", decay=None, max_steps=6, save_every=3)
    train(c, progress=False, stop_at_step=3)
    path = os.path.join(c.out, "checkpoint-0000003", STATE_FILE)
    state = torch.load(path, weights_only=False)
    for key in ("distill_weight", "feature_scaling"):
        del state["config"][key]
    del state["drafter"], state["feature_scale"]       # an older trainer's state: the weights in model.safetensors
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"decay None -> 7\.0; feature_scaling 'none' -> 'rms'"):
        train(config(world, "legacy", max_steps=6, save_every=3), progress=False)
    assert [h["step"] for h in train(c, progress=False)["history"]] == [4, 5, 6]


def test_from_scratch_initialisation(world):
    c = config(world, "scratch", init_from=None, drafter={"num_hidden_layers": 1, "mask_token_id": 97}, max_steps=4,
               save_every=4)
    result = train(c, progress=False)
    drafter = load_drafter(result["final"])
    assert drafter.config.target_layer_ids == default_target_layers(6, 1) and drafter.num_branches == 4
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]  # the DFlash Qwen3-8B layout


def test_train_command_runs_a_config_file(world, capsys):
    root = world[0]
    c = config(world, "cli", max_steps=3, save_every=3)
    path = root / "config.json"
    path.write_text(json.dumps({k: v for k, v in c.to_json().items()}))
    assert main(["train", "--config", str(path), "--no-progress", "--out", str(root / "cli2")]) == 0
    assert "final" in capsys.readouterr().out
    assert load_drafter(str(root / "cli2" / "final")).num_branches == 4


@pytest.mark.parametrize("change,message", [
    ({"objective": "kl"}, "objective"),
    ({"batch_size": 0}, "batch_size"),
    ({"data": "/nonexistent.jsonl"}, "dblast data generate"),
    ({"init_from": None}, "mask_token_id"),
    ({"al_variant": "some"}, "al_variant"),
    ({"decay": 0.9}, "decay must be null or 0"),
    ({"decay": -2}, "decay"),
    ({"decay": True}, "decay"),
    ({"distill_weight": 1.5}, "distill_weight"),
    ({"distill_weight": 0.5}, "distill_weight 0.5 applies to the nll objective only"),
    ({"feature_scaling": "std"}, "feature_scaling"),
    ({"select_by": "tau"}, "select_by must be one of"),
    ({"dflash2": {"conv_kernel_size": 2}}, "dflash2 must be an object with exactly"),
    ({"dflash2": {"conv_kernel_size": 2, "conv_group_size": 0, "selector_rank": 4, "selector_top_k": 4}},
     "dflash2.conv_group_size must be a positive integer"),
    ({"dflash2": {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 4},
      "num_branches": 4}, "num_branches must be 1 or null with dflash2"),
    ({"selector_weight": -1}, "selector_weight"),
    ({"freeze_backbone": "yes"}, "freeze_backbone"),
    ({"selector_only": 1}, "selector_only must be true or false"),
])
def test_bad_configs_fail_clearly(world, change, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        config(world, "bad", **change)


def test_config_files_are_checked(world, tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"target": world[1], "data": world[3]["train"], "out": "x",
                                                 "learning_rate": 1.0}))
    with pytest.raises(ValueError, match="unknown training config fields"):
        load_config(str(tmp_path / "c.json"))
    (tmp_path / "d.json").write_text(json.dumps({"target": world[1]}))
    with pytest.raises(ValueError, match="lacks"):
        load_config(str(tmp_path / "d.json"))


def test_a_drafter_that_does_not_fit_the_target_is_refused(world, tmp_path):
    other = write_dflash_checkpoint(tmp_path / "wrong", dflash_config={"mask_token_id": 97, "target_layer_ids": [1, 9]})
    with pytest.raises(ValueError, match="target_layer_ids"):
        train(config(world, "mismatch", init_from=other, max_steps=1), progress=False)


def test_torchrun_processes_share_a_step_like_gradient_accumulation(world):
    """Two processes with batch B equal one process with batch B and two accumulation steps:
    the same records and anchors per step, gradients averaged across processes."""
    import os
    import subprocess
    import sys

    root = world[0]
    single = train(config(world, "single", batch_size=2, grad_accum=2, max_steps=3, save_every=3), progress=False)
    c = config(world, "ddp", batch_size=2, grad_accum=1, max_steps=3, save_every=3).to_json()
    (root / "ddp.json").write_text(json.dumps(c))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "dblast_ext.cli", "train", "--config", str(root / "ddp.json"), "--no-progress"],
                          capture_output=True, text=True, timeout=600, env=env, cwd="/")
    # the failed rank's own message comes just before torchrun's traceback (about 3,000 characters)
    assert done.returncode == 0, done.stderr[-8000:]
    a = load_drafter(single["final"]).state_dict()
    b = load_drafter(str(root / "ddp" / "final")).state_dict()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5)


# --- DFlash2: identity convolutions and a selector added to a DFlash drafter, then trained ---------

DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}


@pytest.mark.parametrize("trains", ["everything", "frozen-backbone", "selector-only"])
def test_a_dflash_drafter_trains_into_a_dflash2_one(world, trains):
    """The DFlash2 parts start as a no-op (the converted drafter's greedy chain is the DFlash
    drafter's), the selector's cross-entropy falls, a frozen backbone stays as it was (and the
    convolutions too when only the selector trains), and the result saves as a DFlash2
    checkpoint that decodes exactly."""
    root, target_dir, drafter_dir, _ = world
    name = f"dflash2-{trains}"
    c = config(world, name, num_branches=None, objective="nll", dflash2=DFLASH2,
               freeze_backbone=trains == "frozen-backbone", selector_only=trains == "selector-only",
               max_steps=60, save_every=30, lr=1e-2, eval_at_start=True)
    result = train(c, progress=False)
    evals = [json.loads(line) for line in open(root / name / "eval_log.jsonl")]
    assert evals[0]["step"] == 0 and evals[-1]["selector_loss"] < evals[0]["selector_loss"]
    model, tokenizer = load_target(target_dir, device="cpu")
    trained = load_drafter(result["final"], target=model)
    assert trained.config.is_dflash2 and trained.config.selector_top_k == 4
    assert json.load(open(os.path.join(result["final"], "config.json")))["architectures"] == ["DFlash2DraftModel"]
    before = load_drafter(drafter_dir, target=model)
    backbone_same = torch.equal(trained.layers[0].mlp.gate_proj.weight, before.layers[0].mlp.gate_proj.weight)
    assert backbone_same == (trains != "everything")
    identity = copy.deepcopy(trained.layers[0].mlp_conv)
    identity.make_identity()
    convs_as_added = torch.equal(trained.layers[0].mlp_conv.base_kernel, identity.base_kernel)
    assert convs_as_added == (trains == "selector-only")
    assert not torch.equal(trained.candidate_selector.successor_codebook,
                           torch.zeros_like(trained.candidate_selector.successor_codebook))
    ids = tokenizer("t5 t6 t7")["input_ids"]
    expected = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, eos_token_id=None,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
    out = SpeculativeDecoder(model, trained).generate(ids, SamplingParams(0.0), max_new_tokens=16)
    assert out.token_ids == expected[0, len(ids):].tolist()


def test_the_added_dflash2_parts_draft_what_the_dflash_drafter_drafted(world):
    from dblast_ext.training.objective import greedy_drafts, selector_drafts

    _, target_dir, drafter_dir, _ = world
    model, _ = load_target(target_dir, device="cpu")
    drafter = load_drafter(drafter_dir, target=model)
    from dblast_ext.target.adapter import TargetAdapter

    hidden = block_hidden(drafter)
    blocks = hidden.view(4, drafter.config.block_size, -1)[:, 1:]   # 2 rows x 2 blocks, the draft positions
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    plain = greedy_drafts(drafter, target, blocks, torch.zeros(4, 1))
    drafter.add_dflash2(**DFLASH2)
    assert torch.equal(block_hidden(drafter), hidden)  # identity convolutions
    chain = selector_drafts(drafter, target, blocks, torch.zeros(4, dtype=torch.long))
    assert torch.equal(chain, plain)  # a zero pair term: each position's top logit


def test_the_selectors_candidates_always_hold_the_label():
    from dblast_ext.training.selector_loss import selector_candidates

    g = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(30, 8, generator=g), torch.randn(50, 8, generator=g)
    labels = torch.randint(0, 50, (30,), generator=g)
    candidates, unary, slot = selector_candidates(hidden, head, 50, 4, labels, chunk_size=7)
    logits = hidden @ head.T
    assert torch.equal(candidates.gather(1, slot[:, None].long())[:, 0], labels)
    torch.testing.assert_close(unary, logits.gather(1, candidates))
    top = logits.topk(4).indices
    inside = (top == labels[:, None]).any(-1)
    assert torch.equal(candidates[inside], top[inside])
    assert torch.equal(candidates[~inside, :3], top[~inside, :3]) and (slot[~inside] == 3).all()
