"""recipes/smollm2/train_drafters/train_scaled.py: the scaled campaign's shards (a growing store,
re-listed every round), the paired bootstrap of per-anchor proxies, the capacity choice rule,
and a tiny end-to-end pilot stage (two depths, two steps each) on a tiny target, with
capacity_report.py's page of it."""
import argparse
import gzip
import json
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2", "train_drafters"))
from train_scaled import (DEFAULT_SETTINGS, amend_settings, choose_depth, conclude, list_shards,  # noqa: E402
                          new_ledger, paired_anchors, paired_bootstrap, pick_chunk, round_plan, run_config,
                          run_round, target_dtype)


def write_shard(path, records):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with gzip.open(path, "wt") as f:
        f.writelines(records)


def stores(tmp_path, records=None, scaled=("00000-chat", "00001-code")):
    records = records or ['{"input_ids": [1], "loss_mask": [0]}\n']
    store, grown = tmp_path / "store", tmp_path / "scaled"
    for name in ("math-000", "code-000", "chat-000", "heldout"):
        write_shard(str(store / "responses" / f"{name}.jsonl.gz"), records)
    for name in scaled:
        write_shard(str(grown / "responses" / f"{name}.jsonl.gz"), records)
    return str(store), str(grown)


def test_every_round_lists_the_store_again_and_takes_the_least_used_shards_new_ones_included(tmp_path):
    store, scaled = stores(tmp_path)
    (tmp_path / "scaled" / "responses" / "00002-math.jsonl.gz.partial").write_text("being written")
    names = list_shards(store, scaled)
    assert names == ["5x/math-000.jsonl.gz", "5x/code-000.jsonl.gz", "5x/chat-000.jsonl.gz",
                     "scaled/00000-chat.jsonl.gz", "scaled/00001-code.jsonl.gz"]   # no held-out, no partial
    book = new_ledger(store, {**DEFAULT_SETTINGS, "round_shards": 3, "layers_choices": [2]})
    book.update(stage="base", choice={"layers": 2})
    first = round_plan(book, names, "keep")
    assert len(first["shards"]) == 3 and set(first["shards"]) <= set(names)
    conclude(book, first, {"stage": "base", "shards": first["shards"],
                           "runs": {"base": {"start": {"loss": 5.0}, "best": {"loss": 4.0}}}}, {})
    write_shard(os.path.join(scaled, "responses", "00002-math.jsonl.gz"), ['{"input_ids": [1]}\n'])
    names = list_shards(store, scaled)
    assert names[-1] == "scaled/00002-math.jsonl.gz"
    second = round_plan(book, names, "keep")
    unused = sorted(set(names) - set(first["shards"]))
    assert sorted(second["shards"]) == unused   # the two never used and the new one, before any used again
    assert second["runs"]["base"]["init"] == os.path.join("keep", "dflash-k1")   # the kept base goes on


def test_a_chunk_prefers_unused_shards_in_a_fixed_mixed_order():
    names = [f"5x/math-{i:03d}.jsonl.gz" for i in range(6)] + [f"scaled/{i:05d}-chat.jsonl.gz" for i in range(6)]
    chunk = pick_chunk(names, {}, 6)
    assert pick_chunk(list(reversed(names)), {}, 6) == chunk               # the order listed does not matter
    assert any(n.startswith("5x/") for n in chunk) and any(n.startswith("scaled/") for n in chunk)
    assert set(pick_chunk(names, {n: 1 for n in chunk}, 6)) == set(names) - set(chunk)


def test_a_chunk_takes_the_kinds_in_their_proportions_however_the_uses_fall():
    from train_scaled import shard_kind

    names = ([f"scaled/{i:05d}-chat.jsonl.gz" for i in range(0, 40, 2)] + [f"scaled/{i:05d}-code.jsonl.gz" for i in
             range(1, 40, 4)] + [f"scaled/{i:05d}-math.jsonl.gz" for i in range(3, 40, 4)] + ["5x/math-000.jsonl.gz"])
    uses = {n: 1 for n in names if shard_kind(n) == "math"}   # math used more: by use alone a chunk would have none
    chunk = pick_chunk(names, uses, 16)
    kinds = [shard_kind(n) for n in chunk]
    # 20 chat, 10 code, 11 math of 41: quotas 7.8, 3.9, 4.3 -> 7 + 3 + 4 = 14, the two largest remainders
    # (chat .80, code .90) one more each
    assert (kinds.count("chat"), kinds.count("code"), kinds.count("math")) == (8, 4, 4) and len(set(chunk)) == 16
    assert pick_chunk(names, uses, 3) != [] and len(pick_chunk(names[:2], {}, 16)) == 2


def test_the_paired_bootstrap_of_a_constant_difference_is_that_difference():
    a = np.array([0.1, 0.5, 1.0, 2.0, 0.0])
    result = paired_bootstrap(a, a + 0.25, samples=500, seed=3)
    assert result["mean"] == pytest.approx(0.25) and result["low"] == pytest.approx(0.25)
    assert result["high"] == pytest.approx(0.25) and result["anchors"] == 5


def test_the_paired_bootstrap_has_the_interval_of_known_inputs_and_is_seeded():
    # differences 0 and 1, half each: resampled means ~ Binomial(n, 1/2) / n, interval ~ 1/2 -+ 1.96 / (2 sqrt n)
    n = 400
    a, b = np.zeros(n), np.tile([0.0, 1.0], n // 2)
    result = paired_bootstrap(a, b, samples=4000, seed=0)
    assert result["mean"] == 0.5
    assert result["low"] == pytest.approx(0.5 - 0.049, abs=0.006) and result["high"] == pytest.approx(0.5 + 0.049,
                                                                                                        abs=0.006)
    assert paired_bootstrap(a, b, samples=4000, seed=0) == result
    assert paired_bootstrap(a, b, samples=4000, seed=1) != result


def test_a_planted_difference_is_detected_and_none_when_the_pilots_are_equal():
    rng = np.random.default_rng(0)
    a = rng.gamma(1.0, 0.5, size=2000)          # per-anchor proxies, skewed like accepted lengths
    noise = rng.normal(0, 0.3, size=1000)
    same = a + np.concatenate([noise, -noise])  # equal in mean, noisy pair by pair
    planted = a + 0.05 + rng.normal(0, 0.3, size=2000)
    equal = paired_bootstrap(a, same, samples=2000, seed=0)
    assert equal["low"] < 0 < equal["high"]
    found = paired_bootstrap(a, planted, samples=2000, seed=0)
    assert found["low"] > 0 and found["mean"] == pytest.approx(0.05, abs=0.02)


def pilots(gains, n=1500, seed=0, noise=0.1):
    """Per-anchor proxies of pilots 2, 3, 4: a shared base plus each depth's planted gain, with
    pair-by-pair noise of mean exactly 0 (so each mean gain is exactly the planted one)."""
    rng = np.random.default_rng(seed)
    base = rng.gamma(1.0, 0.5, size=n)
    out = {}
    for depth, gain in zip((2, 3, 4), gains):
        e = rng.normal(0, noise, size=n // 2)
        out[depth] = base + gain + np.concatenate([e, -e])
    return out


CYCLE = {"2": 165.0, "3": 168.0, "4": 171.0}   # break-even gains about 0.027 (3 over 2) and 0.026 (4 over 3)


@pytest.mark.parametrize("gains, chosen, noise", [
    ((0.0, 0.10, 0.20), 4, 0.1),      # each step gains well above its cost
    ((0.0, 0.10, 0.10), 3, 0.1),      # 4 is no better than 3
    ((0.0, 0.01, 0.02), 2, 0.1),      # separated, but too small to pay for the longer cycle
    ((0.0, 0.0, 0.0), 2, 0.1),        # nothing to tell them apart
    ((0.0, -0.10, 0.08), 4, 0.1),     # 3 is worse; 4 beats both 2 and 3 and pays over each
    ((0.0, -0.10, -0.02), 2, 0.1),    # 4 beats 3 but not 2: the deeper pilot must beat every shallower one
    ((0.0, 0.06, 0.12), 2, 3.0),      # gains that would pay, but the intervals (noisy anchors) include 0
])
def test_the_choice_is_the_deepest_pilot_that_beats_each_shallower_one_and_pays_for_it(gains, chosen, noise):
    choice = choose_depth(pilots(gains, noise=noise), CYCLE, samples=1000, seed=0)
    assert choice["layers"] == chosen
    assert {(p["deeper"], p["shallower"]) for p in choice["pairs"]} == {(3, 2), (4, 2), (4, 3)}
    three = next(p for p in choice["pairs"] if (p["deeper"], p["shallower"]) == (3, 2))
    assert three["break_even"] == pytest.approx((1 + choice["pilots"]["2"]["proxy"]) * (168 / 165 - 1), abs=1e-4)


def test_a_choice_needs_every_pilot_s_cycle_time_and_the_same_anchors():
    with pytest.raises(ValueError, match=r"no cycle time for \[4\]"):
        choose_depth(pilots((0, 0, 0)), {"2": 165.0, "3": 168.0})
    one = {"record": [0, 0, 1], "anchor": [3, 5, 2], "accepted_proxy": [1.0, 0.5, 0.0]}
    other = {"record": [1, 0, 0], "anchor": [2, 5, 3], "accepted_proxy": [0.25, 0.5, 2.0]}
    first, second = paired_anchors(one, other)
    assert first.tolist() == [1.0, 0.5, 0.0] and second.tolist() == [2.0, 0.5, 0.25]   # aligned by (record, anchor)
    with pytest.raises(ValueError, match="not on the same anchors"):
        paired_anchors(one, dict(other, anchor=[2, 5, 4]))


def test_a_round_that_goes_on_from_a_kept_drafter_this_machine_lacks_stops_and_names_it(tmp_path):
    store, scaled = stores(tmp_path)
    book = new_ledger(store, {**DEFAULT_SETTINGS, "round_shards": 2})
    book.update(stage="base", choice={"layers": 2}, kept={"dflash-k1": 3, "dblast-k4": None})
    (tmp_path / "scaled.json").write_text(json.dumps(book))
    args = argparse.Namespace(store=store, scaled=scaled, ledger=str(tmp_path / "scaled.json"),
                              logs=str(tmp_path / "logs"), work=str(tmp_path / "work"),
                              keep_dir=str(tmp_path / "kept"), plan=False)
    with pytest.raises(SystemExit, match=r"kept drafter .*kept/dflash-k1 .*not on this machine .*in round 3"):
        run_round(args, {})
    assert not (tmp_path / "work").exists()   # stopped before it wrote anything


def test_the_target_dtype_setting_reaches_every_run_and_an_older_ledger_keeps_auto(tmp_path):
    store, scaled = stores(tmp_path)
    book = new_ledger(store, {**DEFAULT_SETTINGS, "round_shards": 2})
    plan = round_plan(book, list_shards(store, scaled), str(tmp_path / "kept"))
    paths = {"data": ["a.jsonl.gz", "b.jsonl.gz"], "heldout": "heldout.jsonl.gz"}

    def dtypes():
        return {run_config(book, plan, name, run, paths, "work", "features")["dtype"] for name, run in plan["runs"].items()}

    assert len(plan["runs"]) == 2 and dtypes() == {"auto"}
    record = amend_settings(book, {"target_dtype": "bfloat16"}, "a feature pass 2x as fast")
    assert record["changes"] == {"target_dtype": {"old": "auto", "new": "bfloat16"}} and dtypes() == {"bfloat16"}
    del book["settings"]["target_dtype"]   # a ledger written before the setting existed
    assert dtypes() == {"auto"}


@pytest.mark.parametrize("native", [True, False])
def test_a_native_target_dtype_is_bfloat16_only_where_the_cpu_computes_it(monkeypatch, native):
    from dblast_ext.decoding import fastest_settings

    monkeypatch.setattr(fastest_settings, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert target_dtype({"target_dtype": "native"}) == ("bfloat16" if native else "float32")
    assert target_dtype({"target_dtype": "bfloat16"}) == "bfloat16" and target_dtype({}) == "auto"


def test_a_base_restarted_from_the_shipped_drafter_reads_the_scaled_shards_first(tmp_path):
    store, scaled = stores(tmp_path)
    book = new_ledger(store, {**DEFAULT_SETTINGS, "round_shards": 2, "base_start": "shipped"})
    book.update(stage="base", choice={"layers": 2}, kept={"dflash-k1": 3, "dblast-k4": None})
    plan = round_plan(book, list_shards(store, scaled), str(tmp_path / "kept"))
    assert plan["runs"]["base"]["keep_first"]["shipped"] and plan["runs"]["base"]["keep_first"]["round"] == 0
    assert sorted(plan["shards"]) == ["scaled/00000-chat.jsonl.gz", "scaled/00001-code.jsonl.gz"]
    book["settings"]["base_start"] = "pilot"   # as before: the 5x shards are as unused as the others
    plan = round_plan(book, list_shards(store, scaled), str(tmp_path / "kept"))
    assert "keep_first" not in plan["runs"]["base"] and any(n.startswith("5x/") for n in plan["shards"])


# ---------------------------------------------------------------------------------------------
# a tiny end-to-end pilot stage


def report(args, out) -> str:
    """capacity_report.py's page for the campaign in `args`, written to `out`."""
    import subprocess
    script = os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2", "train_drafters", "capacity_report.py")
    subprocess.run([sys.executable, script, "--ledger", args.ledger, "--logs", args.logs, "--out", str(out)],
                   check=True, cwd=out.parent)
    assert (out / "proxy_over_steps.png").stat().st_size > 0
    return (out / "README.md").read_text()


def test_a_tiny_pilot_stage_trains_measures_and_chooses_with_its_table(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from test_training_feature_cache import write_tiny_world

    target_dir, data = write_tiny_world(tmp_path, prompts=16, seed=11, longest_prompt=6, max_new_tokens=16)
    lines = open(data).readlines()
    store, scaled = stores(tmp_path, scaled=())
    for i, name in enumerate(("math-000", "code-000", "chat-000")):
        write_shard(os.path.join(store, "responses", f"{name}.jsonl.gz"), lines[4 * i:4 * i + 4])
    write_shard(os.path.join(store, "responses", "heldout.jsonl.gz"), lines[12:])
    write_shard(os.path.join(scaled, "responses", "00000-chat.jsonl.gz"), lines[:4])
    settings = {"target": target_dir, "mask_token_id": 2, "target_layer_ids": [1, 2], "block": 4,
                "layers_choices": [1, 2], "pilot_steps": 2, "round_shards": 2, "batch_size": 2, "num_anchors": 4,
                "eval_anchors": 6, "save_every": 2, "feature_cache_gb": 1, "bootstrap_samples": 200, "base_steps": 2,
                "cycle_ms": {"1": 100.0, "2": 104.0}}
    args = argparse.Namespace(store=store, scaled=scaled, ledger=str(tmp_path / "scaled.json"),
                              logs=str(tmp_path / "logs"), work=str(tmp_path / "work"), keep_dir=str(tmp_path / "keep"),
                              plan=False)
    said = []
    assert run_round(args, settings, log=said.append)
    book = json.loads(open(args.ledger).read())
    assert book["stage"] == "pilots" and list(book["pilots"]) == ["1"] and book["choice"] is None
    one = report(args, tmp_path / "page-1")
    assert "| 1 | 2 | 0." in one and "100.0 ms" in one and "proxy_over_steps.png" in one and "## " not in one
    assert run_round(args, settings, log=said.append)
    book = json.loads(open(args.ledger).read())
    assert book["stage"] == "base" and sorted(book["pilots"]) == ["1", "2"]
    assert [r["shards"] for r in book["rounds"]] == [book["pilot_shards"]] * 2   # the same data for each depth
    assert all(book["rounds"][i]["runs"][f"pilot-L{i + 1}"]["steps"] == 2 for i in range(2))
    logs = [json.loads(open(os.path.join(args.logs, p["anchors_log"])).readline()) for p in book["pilots"].values()]
    assert len(logs[0]["record"]) > 6 and logs[0]["anchor"] == logs[1]["anchor"]   # paired
    choice = book["choice"]
    assert choice["layers"] in (1, 2) and [(p["deeper"], p["shallower"]) for p in choice["pairs"]] == [(2, 1)]
    assert choice["table"][0].startswith("| pilot |") and any("L2 vs L1" in line for line in choice["table"])
    assert any("chosen" in message for message in said)
    page = report(args, tmp_path / "page-2")
    assert "## The campaign's choice" in page and f"**Chosen: {choice['layers']} layer" in page
    assert all(line in page for line in choice["table"]) and "| 2 | 2 | 0." in page and "1.000x" in page
    assert (tmp_path / "page-2" / "pair_gains.png").stat().st_size > 0
    plan = round_plan(book, list_shards(store, scaled), args.keep_dir)
    assert plan["stage"] == "base" and plan["runs"]["base"]["init"] is None   # no pilot at hand: from scratch
    assert plan["shards"] == book["pilot_shards"]   # pilots use no shard up: the first base reads their features
    # where the pilots ran, the chosen one is kept as the first base, and the base goes on from it
    plan = round_plan(book, list_shards(store, scaled), args.keep_dir, args.work)
    pilot_round = [r["round"] for r in book["rounds"] if f"pilot-L{choice['layers']}" in r["runs"]][0]
    assert plan["runs"]["base"] == {"kind": "base", "init": os.path.join(args.keep_dir, "dflash-k1"), "keep_first": {
        "drafter": os.path.join(args.work, f"round-{pilot_round:02d}", f"pilot-L{choice['layers']}", "final"),
        "round": pilot_round}}
    assert set(plan["shards"]).isdisjoint(book["pilot_shards"])   # it goes on from the pilot on new data
    assert run_round(args, settings, log=said.append)
    book = json.loads(open(args.ledger).read())
    base = book["rounds"][-1]
    assert base["stage"] == "base" and base["base_from_pilot"] == f"pilot-L{choice['layers']} of round {pilot_round}"
    assert base["runs"]["base"]["init"] == "dflash-k1" and base["runs"]["base"]["steps"] == 2
    assert book["kept"]["dflash-k1"] in (pilot_round, base["round"])   # the pilot, or the base where it improved
    assert os.path.isfile(os.path.join(args.keep_dir, "dflash-k1", "config.json"))
    # the kept drafter against another (here the other pilot, standing in for the shipped one)
    import subprocess
    other = os.path.join(args.work, "round-00", "pilot-L1", "final")
    script = os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2", "train_drafters",
                          "against_shipped.py")
    done = subprocess.run([sys.executable, script, "--ledger", args.ledger, "--store", store, "--keep-dir",
                           args.keep_dir, "--work", str(tmp_path / "against"), "--shipped", other, "--features",
                           os.path.join(args.work, "features")], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["arm"] == "dflash-k1" and result["kept_round"] == book["kept"]["dflash-k1"]
    assert result["gain"]["anchors"] > 6 and result["gain"]["low"] <= result["gain"]["mean"] <= result["gain"]["high"]
    assert "| shipped dflash-k1 |" in done.stdout and "paired blocks" in done.stdout
    greedy = result["greedy_gain"]   # the greedy chain's accepted length, paired on the same blocks
    assert greedy["anchors"] == result["gain"]["anchors"] and greedy["low"] <= greedy["mean"] <= greedy["high"]
    assert "kept - shipped, greedy chain accepted:" in done.stdout
    # base_start "shipped": the next base round restarts the lineage from the shipped drafter, once
    import train_scaled
    amend_settings(book, {"base_start": "shipped"}, "the shipped drafter is far ahead")
    (tmp_path / "scaled.json").write_text(json.dumps(book))
    stand_in = other.replace("pilot-L1", f"pilot-L{choice['layers']}").replace(
        "round-00", f"round-{pilot_round:02d}")
    monkeypatch.setattr(train_scaled, "shipped_drafter", lambda arm: stand_in)
    before = book["kept"]["dflash-k1"]
    grown = open(os.path.join(args.keep_dir, "dflash-k1", "model.safetensors"), "rb").read()
    with monkeypatch.context() as interrupted:   # a first try stops in its training run: the round resumes
        interrupted.setattr(train_scaled, "train", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            run_round(args, settings, log=said.append)
    assert run_round(args, settings, log=said.append)
    book = json.loads(open(args.ledger).read())
    rebased = book["rounds"][-1]
    assert rebased["base_from_shipped"] == "dflash-k1" and rebased["runs"]["base"]["init"] == "dflash-k1"
    assert rebased["earlier_base"].endswith(f"dflash-k1-until-round-{before:02d}")
    assert open(os.path.join(rebased["earlier_base"], "model.safetensors"), "rb").read() == grown   # not the copy
    assert book["kept"]["dflash-k1"] == rebased["round"]
    assert any("shipped dflash-k1 is kept as the base" in message for message in said)
    plan = round_plan(book, list_shards(store, scaled), args.keep_dir, args.work)
    assert "keep_first" not in plan["runs"]["base"]   # once
    # on a machine without the kept base, --replay trains its lineage since the restart again:
    # the same chunk, seed and settings give the same drafter
    kept = os.path.join(args.keep_dir, "dflash-k1")
    os.replace(kept, kept + "-elsewhere")
    with pytest.raises(SystemExit, match="--replay"):
        run_round(args, settings, log=said.append)
    train_scaled.replay(args, log=said.append)
    assert (open(os.path.join(kept, "model.safetensors"), "rb").read()
            == open(os.path.join(kept + "-elsewhere", "model.safetensors"), "rb").read())
    assert any(m.startswith(f"== replaying round {rebased['round']} (base") for m in said)
    assert any("recorded" in m and "greedy chain" in m for m in said)
    assert json.loads(open(args.ledger).read()) == book   # the ledger's rounds stay as recorded
    with pytest.raises(SystemExit, match="already"):
        train_scaled.replay(args, log=said.append)


def test_the_temperatures_setting_keeps_the_shards_sampled_at_them():
    from train_scaled import at_temperatures

    names = ["5x/math-000.jsonl.gz", "scaled/00000-chat.jsonl.gz", "scaled/00004-chat.jsonl.gz",
             "scaled/00009-code.jsonl.gz", "scaled/00015-math.jsonl.gz"]
    # the 5x store is T 0.7; scaled shards 0-3 T 0.7, 4-7 T 1.0, 8-11 T 0.7, 12-15 T 1.0
    assert at_temperatures(names, None) == names
    assert at_temperatures(names, [0.7]) == ["5x/math-000.jsonl.gz", "scaled/00000-chat.jsonl.gz",
                                             "scaled/00009-code.jsonl.gz"]
    assert at_temperatures(names, [1.0]) == ["scaled/00004-chat.jsonl.gz", "scaled/00015-math.jsonl.gz"]


def test_each_amendment_to_base_start_shipped_restarts_the_base_once(tmp_path):
    from train_scaled import restart_pending

    store, _ = stores(tmp_path)
    book = new_ledger(store, dict(DEFAULT_SETTINGS))
    book.update(stage="base", rounds=[{"round": i, "stage": "base"} for i in range(3)])
    assert not restart_pending(book)                           # base_start "pilot"
    amend_settings(book, {"base_start": "shipped"}, "the shipped drafter is ahead")   # from round 3
    assert restart_pending(book)
    book["rounds"].append({"round": 3, "stage": "base", "base_from_shipped": "dflash-k1"})
    book["rounds"].append({"round": 4, "stage": "base"})
    assert not restart_pending(book)                           # once
    amend_settings(book, {"base_start": "shipped"}, "round 3's lineage lost to it again")   # from round 5
    assert restart_pending(book)
    book["rounds"].append({"round": 5, "stage": "base", "base_from_shipped": "dflash-k1"})
    assert not restart_pending(book)


def test_settings_at_a_round_undo_the_amendments_made_after_it(tmp_path):
    from train_scaled import settings_at

    store, _ = stores(tmp_path)
    book = new_ledger(store, dict(DEFAULT_SETTINGS))
    book["rounds"] = [{"round": i} for i in range(3)]
    amend_settings(book, {"base_steps": 1200}, "shorter")                 # from round 3
    book["rounds"].append({"round": 3})
    amend_settings(book, {"base_steps": 600, "select_by": "greedy_accepted"}, "shorter still")   # from round 4
    assert settings_at(book, 2)["base_steps"] == DEFAULT_SETTINGS["base_steps"]
    assert settings_at(book, 3)["base_steps"] == 1200 and settings_at(book, 3)["select_by"] is None
    assert settings_at(book, 4) == book["settings"]


def test_the_select_by_setting_picks_every_run_s_measure_from_its_amendment_on(tmp_path):
    store, scaled = stores(tmp_path)
    book = new_ledger(store, {**DEFAULT_SETTINGS, "round_shards": 2})
    book.update(stage="arms", choice={"layers": 2}, kept={"dflash-k1": 3, "dblast-k4": None}, arms_from_round=0)
    plan = round_plan(book, list_shards(store, scaled), str(tmp_path / "kept"))
    paths = {"data": ["a.jsonl.gz"], "heldout": "heldout.jsonl.gz"}

    def measures():
        return {name: run_config(book, plan, name, run, paths, "work", "features")["select_by"]
                for name, run in plan["runs"].items()}

    assert measures() == {"dflash-k1": "loss", "dblast-k4": "accepted_proxy"}   # by objective
    amend_settings(book, {"select_by": "greedy_accepted"}, "what the decode loop drafts")
    assert measures() == {"dflash-k1": "greedy_accepted", "dblast-k4": "greedy_accepted"}
