"""Training at scale on a tiny target: data as a folder of shards streamed a window at a time,
online and cached features giving the same loss, a feature cache that stays under its bound,
a run resumed from any checkpoint (another folder, another machine's paths) ending where an
uninterrupted one ends, a resume refused when what is trained differs, and progress bars with
an ETA."""
import gzip
import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from dblast_ext import load_drafter  # noqa: E402
from dblast_ext.cli import main  # noqa: E402
from dblast_ext.target.loading import load_target  # noqa: E402
from dblast_ext.training import feature_cache as feature_cache_module  # noqa: E402
from dblast_ext.training.config import TrainConfig, validate  # noqa: E402
from dblast_ext.training.data import read_training_data  # noqa: E402
from dblast_ext.training.shard_cache import GB, bytes_per_token, folder_bytes  # noqa: E402
from dblast_ext.training.shards import ShardedData, resolve_data, seed_of  # noqa: E402
from dblast_ext.training.trainer import STATE_FILE, train  # noqa: E402
from test_training_feature_cache import write_tiny_world  # noqa: E402

SHARDS, PER_SHARD = 4, 6


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(root, target dir, shard folder with 4 shards of 6 records (two gzipped), held-out file)."""
    root = tmp_path_factory.mktemp("shards")
    target_dir, everything = write_tiny_world(root, prompts=SHARDS * PER_SHARD + 4, seed=5, longest_prompt=6,
                                              max_new_tokens=16)
    records = open(everything).readlines()
    (root / "shards").mkdir()
    for i in range(SHARDS):
        part = records[i * PER_SHARD:(i + 1) * PER_SHARD]
        if i % 2:
            with gzip.open(root / "shards" / f"{i:05d}-x.jsonl.gz", "wt") as f:
                f.writelines(part)
        else:
            (root / "shards" / f"{i:05d}-x.jsonl").write_text("".join(part))
    (root / "shards" / "notes.txt").write_text("not data\n")
    (root / "heldout.jsonl").write_text("".join(records[SHARDS * PER_SHARD:]))
    return root, target_dir, str(root / "shards"), str(root / "heldout.jsonl")


def config(world, out, **overrides):
    root, target_dir, shards, heldout = world
    fields = dict(target=target_dir, data=shards, eval_data=heldout, out=str(root / out), init_from=None,
                  drafter={"num_hidden_layers": 1, "mask_token_id": 2}, num_branches=1, block_size=4,
                  objective="nll", num_anchors=4, batch_size=3, lr=3e-3, max_steps=8, save_every=4, log_every=1,
                  device="cpu", autocast="off")
    fields.update(overrides)
    return validate(TrainConfig(**fields))


def same_weights(a: str, b: str) -> bool:
    x, y = load_drafter(a).state_dict(), load_drafter(b).state_dict()
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# ---------------------------------------------------------------------------------------------
# shards


def test_a_folder_or_glob_is_its_data_files_in_name_order(world):
    root, _, shards, _ = world
    files = resolve_data(shards)
    assert [os.path.basename(p) for p in files] == ["00000-x.jsonl", "00001-x.jsonl.gz", "00002-x.jsonl",
                                                    "00003-x.jsonl.gz"]   # notes.txt is not data
    assert resolve_data(os.path.join(shards, "*.gz")) == files[1::2]
    empty = root / "empty"
    empty.mkdir(exist_ok=True)
    with pytest.raises(FileNotFoundError, match="training config: data folder .*empty.* holds no .jsonl"):
        config(world, "x", data=str(empty))
    with pytest.raises(FileNotFoundError, match="training config: eval_data pattern .*matches no"):
        config(world, "x", eval_data=os.path.join(shards, "*.parquet"))


def test_without_a_window_the_order_is_one_permutation_over_every_record(world):
    data = ShardedData(resolve_data(world[2]), seed=3)
    for epoch in (0, 1):
        perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed_of(3, "epoch", epoch)))
        assert [data.index_at(epoch * len(data) + p) for p in range(len(data))] == perm.tolist()


def test_a_window_reads_each_record_once_per_epoch_from_its_own_shards_only(world):
    data = ShardedData(resolve_data(world[2]), seed=0, window=2)
    assert len(data) == SHARDS * PER_SHARD and data.windowed
    epochs = []
    for epoch in (0, 1):
        order = [data.index_at(epoch * len(data) + p) for p in range(len(data))]
        assert sorted(order) == list(range(len(data)))
        for p in range(len(data)):   # each position's record lies in its window's shards
            shard, _ = data.locate(order[p])
            assert shard in data.window_shards(epoch * len(data) + p)
            data.records([order[p]])
            assert len(data._loaded) <= 2   # never more than the window in memory
        epochs.append(order)
    assert epochs[0] != epochs[1]
    assert data.records([7])[0] == read_training_data(data.paths[1])[1]


def test_training_on_a_folder_equals_training_on_the_list_of_its_files(world):
    folder = train(config(world, "folder"), progress=False)
    listed = train(config(world, "listed", data=resolve_data(world[2])), progress=False)
    assert [h["loss"] for h in folder["history"]] == [h["loss"] for h in listed["history"]]


# ---------------------------------------------------------------------------------------------
# features: online, cached, bounded


def test_online_and_cached_features_give_the_same_loss(world, tmp_path):
    online = train(config(world, "online", shard_window=2), progress=False)
    cached = train(config(world, "cached", shard_window=2, features="cached", feature_cache=str(tmp_path / "c")),
                   progress=False)
    assert online["feature_cache"] is None and cached["feature_cache"]["shards_built"] == SHARDS
    for a, b in zip(online["history"], cached["history"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5)


def test_auto_features_are_online_on_cuda_and_cached_elsewhere(world):
    from dblast_ext.training.trainer import uses_feature_cache

    c = config(world, "x", feature_cache="somewhere")
    assert uses_feature_cache(c, "cpu") and not uses_feature_cache(c, "cuda:0")
    assert not uses_feature_cache(config(world, "x"), "cpu")
    assert not uses_feature_cache(config(world, "x", feature_cache="somewhere", features="online"), "cpu")
    assert uses_feature_cache(config(world, "x", feature_cache="somewhere", features="cached"), "cuda")


def test_the_bounded_cache_stays_under_its_bound_and_rebuilds_what_it_evicted(world, tmp_path, monkeypatch):
    folder = tmp_path / "bounded"
    one_shard = max(os.path.getsize(p) for p in _unbounded_caches(world, tmp_path / "free"))
    bound = 3.2 * one_shard   # the held-out cache, one window of one shard, and a little: never all four shards
    sizes, real = [], feature_cache_module.FeatureCache.open_or_build

    def watched(*args, **kwargs):
        cache = real(*args, **kwargs)
        sizes.append(folder_bytes(str(folder)))
        return cache
    monkeypatch.setattr(feature_cache_module.FeatureCache, "open_or_build", watched)
    result = train(config(world, "bounded", shard_window=1, feature_cache=str(folder), feature_cache_max_gb=bound / GB,
                          max_steps=16, save_every=8, batch_size=2), progress=False)
    assert len(sizes) > SHARDS and max(sizes) <= bound   # evictions happened, and the folder stayed bounded
    assert result["feature_cache"]["shards_built"] > SHARDS   # two epochs: evicted shards were built again
    assert folder_bytes(str(folder)) <= bound < SHARDS * one_shard


def test_a_bound_too_small_for_one_window_is_refused_naming_it(world, tmp_path):
    one_shard = max(os.path.getsize(p) for p in _unbounded_caches(world, tmp_path / "free"))
    c = config(world, "too-small", shard_window=2, feature_cache=str(tmp_path / "small"),
               feature_cache_max_gb=2.5 * one_shard / GB)
    with pytest.raises(ValueError, match="feature_cache_max_gb .* is too small.*shard_window"):
        train(c, progress=False)


def test_a_cached_token_takes_its_features_and_top_k(world, tmp_path):
    caches = _unbounded_caches(world, tmp_path / "free")
    records = read_training_data(resolve_data(world[2])[0])
    tokens = sum(len(r["input_ids"]) for r in records)
    per_token = bytes_per_token(64, 32)   # one target layer of 64 channels
    assert per_token == 64 * 2 + 32 * 8 + 4
    assert tokens * per_token < os.path.getsize(caches[0]) < tokens * per_token + 4096 + 16 * (len(records) + 70)


def _unbounded_caches(world, folder):
    """The cache files of the four shards, built without a bound (before a run's first step)."""
    train(config(world, f"build-{folder.name}", feature_cache=str(folder), eval_data=None, max_steps=1,
                 save_every=1), progress=False)
    return sorted(str(p) for p in folder.glob("0000*.safetensors"))


@pytest.mark.parametrize("key,value,message", [("shard_window", 0, "shard_window must be a positive integer"),
                                               ("features", "disk", "features must be one of"),
                                               ("feature_cache_max_gb", -1, "feature_cache_max_gb must be a number"),
                                               ("feature_scale_shards", 1.5, "feature_scale_shards must be")])
def test_bad_scale_settings_are_refused_naming_the_field(world, key, value, message):
    with pytest.raises(ValueError, match=f"training config: {message}"):
        config(world, "x", **{key: value}, feature_cache="somewhere")
    with pytest.raises(ValueError, match="features 'cached' needs feature_cache"):
        config(world, "x", features="cached")


def test_the_feature_scale_is_measured_on_the_first_shards_when_asked(world):
    train(config(world, "scale-all", max_steps=4), progress=False)
    train(config(world, "scale-one", max_steps=4, feature_scale_shards=1), progress=False)
    state = lambda name: torch.load(os.path.join(world[0], name, "checkpoint-0000004", STATE_FILE),  # noqa: E731
                                    weights_only=False)
    everything, first = state("scale-all")["feature_scale"], state("scale-one")["feature_scale"]
    assert not torch.allclose(everything, first)
    model, _ = load_target(world[1], device="cpu")
    from dblast_ext.target.adapter import TargetAdapter
    from dblast_ext.training.feature_cache import response_feature_stats, rms_feature_scale

    target = TargetAdapter(model, load_drafter(os.path.join(world[0], "scale-one", "final")).config.target_layer_ids)
    expected = rms_feature_scale(*response_feature_stats(read_training_data(resolve_data(world[2])[0]), target,
                                                         progress=False))
    torch.testing.assert_close(first, expected)


# ---------------------------------------------------------------------------------------------
# resuming


def test_a_run_resumed_elsewhere_from_a_copied_checkpoint_ends_like_an_uninterrupted_one(world, tmp_path):
    root = world[0]
    whole = train(config(world, "whole", shard_window=2, max_steps=12, grad_accum=2), progress=False)
    cut = config(world, "cut", shard_window=2, max_steps=12, grad_accum=2)
    assert train(cut, progress=False, stop_at_step=4)["final"] is None
    # "another machine": the shards in another folder, the checkpoint copied into a new out directory
    moved = shutil.copytree(world[2], tmp_path / "elsewhere" / "shards")
    copied = shutil.copytree(root / "cut" / "checkpoint-0000004", tmp_path / "carried" / "checkpoint-0000004")
    state = torch.load(copied / STATE_FILE, weights_only=False)
    assert state["data_position"]["position"] == 4 * 3 * 2 and state["data_position"]["epoch"] == 1   # 24 records
    assert "optimizer" in state and "scheduler" in state and "rng" in state and "drafter" in state
    there = config(world, "there", shard_window=2, max_steps=12, grad_accum=2, data=str(moved), log_every=2)
    resumed = train(there, progress=False, resume_from=str(copied))
    assert [h["step"] for h in resumed["history"]] == list(range(5, 13))
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in whole["history"][4:]]
    assert same_weights(whole["final"], resumed["final"])


@pytest.mark.parametrize("change,message", [({"lr": 1e-3}, r"another config \(lr 0.003 -> 0.001\)"),
                                            ({"shard_window": 1}, r"shard_window 2 -> 1"),
                                            ({"seed": 1}, r"seed 0 -> 1")])
def test_a_resume_with_a_config_that_changes_the_training_is_refused(world, change, message):
    c = config(world, f"refuse-{next(iter(change))}", shard_window=2)
    train(c, progress=False, stop_at_step=4)
    with pytest.raises(ValueError, match=message):
        train(config(world, f"refuse-{next(iter(change))}", **{"shard_window": 2, **change}), progress=False)
    # machine fields may differ: another log interval and chunk size resume
    assert train(config(world, f"refuse-{next(iter(change))}", shard_window=2, log_every=3, chunk_size=64),
                 progress=False)["steps"] == 8


def test_a_resume_refuses_other_shards_and_a_checkpoint_behind_later_ones(world, tmp_path):
    root = world[0]
    changed = shutil.copytree(world[2], tmp_path / "changed")
    os.remove(changed / "00003-x.jsonl.gz")
    c = config(world, "resume-checks")
    train(c, progress=False)
    with pytest.raises(ValueError, match="another data_sha256"):
        train(config(world, "resume-checks", data=str(changed)), progress=False)
    with pytest.raises(ValueError, match="--resume-from .*is step 4, but .* holds later checkpoints "
                                         r"\(checkpoint-0000008\)"):
        train(c, progress=False, resume_from=str(root / "resume-checks" / "checkpoint-0000004"))
    with pytest.raises(FileNotFoundError, match="--resume-from .* is not a training checkpoint"):
        train(c, progress=False, resume_from=str(root / "resume-checks" / "final"))


# ---------------------------------------------------------------------------------------------
# the command and its progress


def test_the_command_trains_on_a_folder_with_a_bounded_cache_and_resumes_from_a_checkpoint(world, tmp_path, capsys):
    root, target_dir, shards, heldout = world
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"target": target_dir, "data": "unused.jsonl", "out": str(tmp_path / "out"),
                                "drafter": {"num_hidden_layers": 1, "mask_token_id": 2}, "block_size": 4,
                                "num_anchors": 4, "batch_size": 3, "max_steps": 8, "save_every": 4,
                                "device": "cpu", "autocast": "off"}))
    flags = ["train", "--config", str(path), "--data", shards, "--shard-window", "2", "--features", "cached",
             "--feature-cache", str(tmp_path / "cache"), "--feature-cache-max-gb", "1"]
    assert main(flags) == 0
    capsys.readouterr()
    again = ["--out", str(tmp_path / "again"), "--resume-from", str(tmp_path / "out" / "checkpoint-0000004")]
    assert main(flags + again) == 0
    out, err = capsys.readouterr()
    assert "trained 8 / 8 steps" in err and out.strip() == f"drafter: {tmp_path / 'again' / 'final'}"
    assert same_weights(str(tmp_path / "out" / "final"), str(tmp_path / "again" / "final"))
    assert main(flags + ["--feature-cache-max-gb", "0"]) == 2
    assert "--feature-cache-max-gb must be a number > 0" in capsys.readouterr().err


def test_progress_bars_show_the_steps_and_an_eta(world, tmp_path, capsys):
    pytest.importorskip("tqdm")
    train(config(world, "progress", shard_window=2, features="cached", feature_cache=str(tmp_path / "c"),
                 eval_data=None, feature_scaling="none", max_steps=4), progress=True)
    err = capsys.readouterr().err
    assert "target features" in err and "training" in err
    final = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("training")][-1]
    # tqdm's "done/total [elapsed<remaining": the ETA, and the postfix with the loss and the epoch
    assert "4/4 [" in final and "<00:00" in final and "loss=" in final and "epoch=" in final, final
