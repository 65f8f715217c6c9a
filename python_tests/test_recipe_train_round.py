"""recipes/smollm2/train_drafters/train_round.py: what each round trains (chunks, stages, where each run starts)
and what it ships, decided from the round's held-out measurements."""
import copy
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2", "train_drafters"))
from train_round import (DEFAULT_SETTINGS, amend_settings, conclude, data_sh_shards,  # noqa: E402
                         how_the_arms_ended, measured as measured_run, round_plan, run_config)

SHIP = "ship"


def ledger(**settings):
    shards = [f"math-{i:03d}.jsonl.gz" for i in range(5)] + ["code-000.jsonl.gz", "chat-000.jsonl.gz"]
    return {"settings": {**DEFAULT_SETTINGS, "chunks": 3, **settings}, "shards": shards, "heldout": "heldout.jsonl.gz",
            "choice": None, "stage": "pilots", "baseline": None, "shipped": {"dflash-k1": None, "dblast-k4": None},
            "arms_from_round": None, "done": [], "rounds": []}


def measured(start_loss, best_loss, tau=1.0, start_tau=0.1):
    return {"start": {"step": 0, "loss": start_loss, "estimated_tau": start_tau},
            "best": {"step": 150, "loss": best_loss, "estimated_tau": tau}}


def finish(book, runs, pilots=None):
    """Concludes the next round with the given measurements, as main() does."""
    plan = round_plan(book, SHIP)
    record = {"round": plan["round"], "stage": plan["stage"], "runs": copy.deepcopy(runs)}
    shipped = conclude(book, plan, record, pilots or {})
    book["rounds"].append(record)
    return plan, shipped


def test_rounds_take_every_chunks_th_shard_in_turn():
    book = ledger()
    pilots = round_plan(book, SHIP)["shards"]
    book["rounds"].append({"stage": "pilots", "runs": {}})
    chunks = []
    for _ in range(4):
        plan = round_plan(book, SHIP)
        chunks.append(plan["shards"])
        book["rounds"].append({"stage": "base", "runs": {}})
    assert chunks[0] == ["math-000.jsonl.gz", "math-003.jsonl.gz", "chat-000.jsonl.gz"]
    assert chunks[1] == ["math-001.jsonl.gz", "math-004.jsonl.gz"]
    assert chunks[2] == ["math-002.jsonl.gz", "code-000.jsonl.gz"]
    assert chunks[3] == chunks[0]  # then round again
    assert pilots == chunks[0]      # the first base round reuses the pilots' features
    assert sorted(sum(chunks[:3], [])) == sorted(book["shards"])


def test_the_pilot_round_trains_each_size_and_block_and_measures_the_shipped_drafter():
    plan = round_plan(ledger(layers_choices=[2, 3], block_choices=[8, 16]), SHIP)
    assert sorted(plan["runs"]) == ["baseline-dflash-k1", "pilot-L2-B16", "pilot-L2-B8", "pilot-L3-B16",
                                    "pilot-L3-B8"]


def test_a_full_course_pilots_base_then_both_arms_to_their_plateaus():
    book = ledger(min_gain=0.01)
    pilots = {"L2-B8": {"estimated_tau": 1.00}, "L3-B8": {"estimated_tau": 1.01}, "L2-B16": {"estimated_tau": 0.9}}
    _, shipped = finish(book, {"baseline-dflash-k1": measured(9.0, 9.0)}, pilots)
    # within 2% the cheaper pilot wins; nothing is shipped by the pilots
    assert book["choice"]["layers"] == 2 and book["choice"]["block"] == 8 and shipped == []
    assert book["stage"] == "base" and book["baseline"]["estimated_tau"] == 0.1

    plan = round_plan(book, SHIP)
    assert plan["runs"]["base"]["init"] is None  # the first base round starts from scratch
    # from scratch, it replaces the first recipe's drafter only where it beats its estimated tau
    _, shipped = finish(book, {"base": measured(12.0, 6.0, tau=0.05)})
    assert shipped == [] and book["stage"] == "base"
    _, shipped = finish(book, {"base": measured(12.0, 6.0, tau=0.8)})
    assert shipped == [("base", "dflash-k1")] and book["shipped"]["dflash-k1"] == 2

    plan = round_plan(book, SHIP)
    assert plan["runs"]["base"]["init"] == os.path.join(SHIP, "dflash-k1")
    _, shipped = finish(book, {"base": measured(6.0, 5.0)})      # 17% better: shipped, go on
    assert shipped == [("base", "dflash-k1")] and book["stage"] == "base"
    _, shipped = finish(book, {"base": measured(5.0, 4.98)})     # 0.4% better: shipped, the base is done
    assert shipped == [("base", "dflash-k1")] and book["stage"] == "arms" and book["arms_from_round"] == 5

    plan = round_plan(book, SHIP)
    # both arms start from the base, which the shipped dflash-k1 is until an arm round ships
    assert {arm: run["init"] for arm, run in plan["runs"].items()} == \
        {"dflash-k1": os.path.join(SHIP, "dflash-k1"), "dblast-k4": os.path.join(SHIP, "dflash-k1")}
    _, shipped = finish(book, {"dflash-k1": measured(5.0, 4.99), "dblast-k4": measured(3.0, 2.0)})
    assert sorted(shipped) == [("dblast-k4", "dblast-k4"), ("dflash-k1", "dflash-k1")]
    assert book["done"] == ["dflash-k1"] and book["stage"] == "arms"

    plan = round_plan(book, SHIP)
    assert {arm: run["init"] for arm, run in plan["runs"].items()} == {"dblast-k4": os.path.join(SHIP, "dblast-k4")}
    _, shipped = finish(book, {"dblast-k4": measured(2.0, 2.01)})  # worse: kept as it was, and done
    assert shipped == [] and book["stage"] == "done"
    assert [r["runs"][name]["shipped"] for r in book["rounds"][1:] for name in r["runs"]] == \
        [False, True, True, True, True, True, False]


def test_a_base_that_never_beats_the_shipped_drafter_stops_after_max_rounds():
    book = ledger(max_rounds=2)
    finish(book, {"baseline-dflash-k1": measured(9.0, 9.0, start_tau=2.0)}, {"L2-B8": {"estimated_tau": 1.0}})
    for _ in range(2):
        assert round_plan(book, SHIP)["runs"]["base"]["init"] is None
        finish(book, {"base": measured(12.0, 6.0, tau=1.0)})
    assert book["stage"] == "done" and "did not beat" in book["note"]


def test_an_arm_stops_after_max_rounds_even_while_improving():
    book = ledger(max_rounds=1)
    book.update(stage="arms", arms_from_round=0, shipped={"dflash-k1": 0, "dblast-k4": None})
    book["rounds"].append({"stage": "base", "runs": {"base": {}}})
    finish(book, {"dflash-k1": measured(5.0, 4.0), "dblast-k4": measured(3.0, 2.0)})
    assert book["stage"] == "done" and sorted(book["done"]) == ["dblast-k4", "dflash-k1"]


@pytest.mark.parametrize("stage", ["base", "arms"])
def test_a_round_that_made_it_worse_ships_nothing(stage):
    book = ledger()
    book.update(stage=stage, choice={"layers": 2, "block": 8}, arms_from_round=1,
                shipped={"dflash-k1": 0, "dblast-k4": None})
    book["rounds"].append({"stage": "base", "runs": {"base": {}}})
    runs = {"base": measured(5.0, 5.5)} if stage == "base" else \
        {"dflash-k1": measured(5.0, 5.5), "dblast-k4": measured(3.0, 3.1)}
    _, shipped = finish(book, runs)
    assert shipped == []


def test_the_surrogate_arm_is_judged_by_its_accepted_length_proxy_not_its_loss():
    """dblast-k4's held-out surrogate loss can rise while it gets better (round 5 of the recipe):
    its run selects, stops and ships by the proxy; dflash-k1 stays on the loss."""
    book = ledger()
    book.update(stage="arms", choice={"layers": 2, "block": 8}, arms_from_round=1,
                shipped={"dflash-k1": 0, "dblast-k4": None})
    book["rounds"].append({"stage": "base", "runs": {"base": {}}})
    plan = round_plan(book, SHIP)
    configs = {arm: run_config(book, plan, arm, run, "work", "store", "features", SHIP)
               for arm, run in plan["runs"].items()}
    assert {arm: c["select_by"] for arm, c in configs.items()} == {"dflash-k1": "loss", "dblast-k4": "accepted_proxy"}
    log = [{"step": 0, "loss": 4.74, "accepted_proxy": 0.44}, {"step": 150, "loss": 5.15, "accepted_proxy": 0.47},
           {"step": 300, "loss": 5.17, "accepted_proxy": 0.51}, {"step": 450, "loss": 5.20, "accepted_proxy": 0.50}]
    k4 = measured_run(log, 7, "accepted_proxy")
    assert k4["best"]["step"] == 300 and k4["select_by"] == "accepted_proxy"
    k1 = measured_run([dict(e, loss=5.0 - e["step"] / 1000) for e in log], 7, "loss")  # 5.0 -> 4.55
    assert k1["best"]["step"] == 450
    _, shipped = finish(book, {"dflash-k1": k1, "dblast-k4": k4})
    assert sorted(shipped) == [("dblast-k4", "dblast-k4"), ("dflash-k1", "dflash-k1")]
    gains = {arm: run["gain"] for arm, run in book["rounds"][-1]["runs"].items()}
    assert gains["dblast-k4"] == pytest.approx((0.51 - 0.44) / 0.44, abs=1e-5)
    assert gains["dflash-k1"] == pytest.approx((5.0 - 4.55) / 5.0, abs=1e-5)


def test_the_ledger_names_every_shard_data_sh_makes_from_its_prompt_lists(tmp_path):
    (tmp_path / "prompts").mkdir()
    for kind, count in (("math", 401), ("code", 68), ("chat", 200)):
        (tmp_path / "prompts" / f"{kind}.jsonl").write_text("{}\n" * count)
    # 200 sequences a shard: 3 math shards; code, 3 samples a prompt: 67 prompts a shard
    assert data_sh_shards(str(tmp_path)) == ["math-000.jsonl.gz", "math-001.jsonl.gz", "math-002.jsonl.gz",
                                             "code-000.jsonl.gz", "code-001.jsonl.gz", "chat-000.jsonl.gz"]


def test_amended_settings_rule_the_next_rounds_and_the_ledger_keeps_what_changed_and_why():
    book = ledger(base_steps=1200)
    finish(book, {"baseline-dflash-k1": measured(9.0, 9.0)}, {"L2-B8": {"estimated_tau": 1.0}})
    record = amend_settings(book, {"base_steps": 3000}, "the held-out loss still fell at the round's end")
    assert record == {"from_round": 1, "date": record["date"], "why": "the held-out loss still fell at the round's end",
                      "changes": {"base_steps": {"old": 1200, "new": 3000}}}
    assert book["amended"] == [record] and book["settings"]["base_steps"] == 3000
    from train_round import run_config
    plan = round_plan(book, SHIP)
    config = run_config(book, plan, "base", plan["runs"]["base"], "work", "store", "features", SHIP)
    assert config["max_steps"] == 3000


def test_the_base_ends_after_max_base_rounds_even_while_improving():
    book = ledger(max_base_rounds=2)
    finish(book, {"baseline-dflash-k1": measured(9.0, 9.0)}, {"L2-B8": {"estimated_tau": 1.0}})
    finish(book, {"base": measured(12.0, 6.0, tau=0.8)})
    assert book["stage"] == "base"
    finish(book, {"base": measured(6.0, 5.0)})  # 17% better, but the base had its 2 rounds
    assert book["stage"] == "arms" and book["arms_from_round"] == 3


def test_amending_max_base_rounds_to_the_rounds_run_starts_the_arms_at_once():
    book = ledger()
    finish(book, {"baseline-dflash-k1": measured(9.0, 9.0)}, {"L2-B8": {"estimated_tau": 1.0}})
    for _ in range(3):
        finish(book, {"base": measured(12.0, 6.0, tau=0.8)})
    assert book["stage"] == "base"
    record = amend_settings(book, {"max_base_rounds": 3}, "give dblast-k4 the remaining rounds")
    assert record["stage"] == {"old": "base", "new": "arms"}
    assert book["stage"] == "arms" and book["arms_from_round"] == 4
    plan = round_plan(book, SHIP)
    assert plan["stage"] == "arms" and {arm: run["init"] for arm, run in plan["runs"].items()} == \
        {"dflash-k1": os.path.join(SHIP, "dflash-k1"), "dblast-k4": os.path.join(SHIP, "dflash-k1")}


def test_an_amendment_that_leaves_the_base_its_rounds_keeps_the_stage():
    book = ledger()
    finish(book, {"baseline-dflash-k1": measured(9.0, 9.0)}, {"L2-B8": {"estimated_tau": 1.0}})
    finish(book, {"base": measured(12.0, 6.0, tau=0.8)})
    record = amend_settings(book, {"max_base_rounds": 3}, "a cap above the rounds run")
    assert "stage" not in record and book["stage"] == "base"


def test_raising_max_rounds_reopens_an_arm_the_cap_stopped_while_it_still_gained():
    book = ledger(max_rounds=2)
    finish(book, {"baseline-dflash-k1": measured(9.0, 9.0)}, {"L2-B8": {"estimated_tau": 1.0}})
    for _ in range(2):
        finish(book, {"base": measured(12.0, 6.0, tau=0.8)})  # the base had its 2 rounds
    assert book["stage"] == "arms"
    k4 = {"dblast-k4": {"select_by": "accepted_proxy", "start": {"step": 0, "loss": 5.0, "accepted_proxy": 1.0},
                        "best": {"step": 150, "loss": 4.0, "accepted_proxy": 1.05}}}  # +5% by its proxy
    finish(book, {"dflash-k1": measured(6.0, 5.0), **k4})
    finish(book, {"dflash-k1": measured(5.0, 4.99), **k4})  # dflash-k1 at its plateau, dblast-k4 capped
    assert book["stage"] == "done" and sorted(book["done"]) == ["dblast-k4", "dflash-k1"]
    assert how_the_arms_ended(book).startswith("dflash-k1 at its plateau (0.20% in its last round); "
                                               "dblast-k4 at the cap of 2 rounds, still gaining 5.00%")

    record = amend_settings(book, {"max_rounds": 4}, "dblast-k4 still gained 5% in its last round")
    assert record["reopened"] == ["dblast-k4"]
    assert book["stage"] == "arms" and book["done"] == ["dflash-k1"]
    plan = round_plan(book, SHIP)
    assert {arm: run["init"] for arm, run in plan["runs"].items()} == {"dblast-k4": os.path.join(SHIP, "dblast-k4")}
    finish(book, {"dblast-k4": {**k4["dblast-k4"], "best": {"step": 150, "loss": 4.0, "accepted_proxy": 1.005}}})
    assert book["stage"] == "done" and "dblast-k4" in book["done"]  # +0.5%: its plateau


def test_raising_max_rounds_leaves_an_arm_at_its_plateau_done():
    book = ledger(max_rounds=1, max_base_rounds=1)
    finish(book, {"baseline-dflash-k1": measured(9.0, 9.0)}, {"L2-B8": {"estimated_tau": 1.0}})
    finish(book, {"base": measured(12.0, 6.0, tau=0.8)})
    finish(book, {"dflash-k1": measured(5.0, 4.99), "dblast-k4": measured(5.0, 4.999)})
    assert book["stage"] == "done"
    record = amend_settings(book, {"max_rounds": 3}, "more rounds")
    assert "reopened" not in record and book["stage"] == "done"


@pytest.mark.parametrize("changes, why, message", [({"base_step": 1}, "typo", "unknown settings"),
                                                   ({"base_steps": 3000}, " ", "needs --why")])
def test_a_bad_amendment_is_refused_and_changes_nothing(changes, why, message):
    book = ledger()
    before = copy.deepcopy(book)
    with pytest.raises(ValueError, match=message):
        amend_settings(book, changes, why)
    assert book == before
