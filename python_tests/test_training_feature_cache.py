"""The target-feature cache: it holds exactly the features the online trainer computes (both
bfloat16), the target's top-32 next-token log-probabilities and log-sum-exp as a direct
log_softmax gives them, and the response tokens' feature statistics; a run that reads it
follows the online run (with distillation too), it is rebuilt when its data file changes or
was written in an earlier format, and the bf16 autocast option trains on the CPU."""
import gzip
import json
import os
import random
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from dblast_ext.sampling import SamplingParams  # noqa: E402
from dblast_ext.target.adapter import TargetAdapter  # noqa: E402
from dblast_ext.eval.datasets import load_prompts  # noqa: E402
from dblast_ext.target.loading import load_target  # noqa: E402
from dblast_ext.training.config import TrainConfig, validate  # noqa: E402
from dblast_ext.training.data import generate_training_data, read_training_data  # noqa: E402
from dblast_ext.training.feature_cache import FeatureCache, FeatureCacheSet, response_feature_stats  # noqa: E402
from dblast_ext.training.objective import collate, target_features  # noqa: E402
from dblast_ext.training.trainer import train  # noqa: E402
from tiny_models import write_tiny_target_dir  # noqa: E402


def write_tiny_world(root, prompts: int, seed: int, longest_prompt: int, max_new_tokens: int):
    """A tiny target with a peaked LM head under root/target and `prompts` responses of it in
    root/train.jsonl: (target dir, data file)."""
    target_dir = write_tiny_target_dir(root / "target", logit_scale=10.0, eos_id=1)
    rng = random.Random(seed)
    words = lambda: " ".join(f"t{rng.randrange(3, 96)}" for _ in range(rng.randrange(2, longest_prompt)))  # noqa: E731
    lines = [json.dumps({"prompt": words()}) for _ in range(prompts)]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    model, tokenizer = load_target(target_dir, device="cpu")
    generate_training_data(model, tokenizer, load_prompts(str(root / "prompts.jsonl")), str(root / "train.jsonl"),
                           sampling=SamplingParams(0.7, 20, 0.8), max_new_tokens=max_new_tokens, batch_size=8,
                           seed=0, progress=False)
    return target_dir, str(root / "train.jsonl")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    return (root, *write_tiny_world(root, prompts=20, seed=3, longest_prompt=8, max_new_tokens=20))


@pytest.fixture
def cached(world):
    """(the target, its adapter over layers 0 and 1, the records, their feature cache)."""
    root, target_dir, data = world
    model, _ = load_target(target_dir, device="cpu")
    target = TargetAdapter(model, [0, 1])
    records = read_training_data(data)
    cache = FeatureCache.open_or_build(str(root / "cache"), records, data, target_dir, target, batch_size=3,
                                       progress=False)
    return model, target, records, cache


def test_cached_features_equal_the_online_features(cached):
    model, target, records, cache = cached
    assert len(cache) == len(records)
    indices = [5, 0, 17, 9]
    batch = collate([records[i] for i in indices], "cpu")
    online = target_features(target, batch)
    cached = cache.batch(indices, batch.input_ids.shape[1], "cpu")
    assert cached.shape == online.shape == (4, batch.input_ids.shape[1], 2 * model.config.hidden_size)
    assert cached.dtype == online.dtype == torch.bfloat16
    for n, i in enumerate(indices):
        length = len(records[i]["input_ids"])
        # one bf16 step at most: other batches move the float32 values by ~1e-7, which can round either way
        torch.testing.assert_close(cached[n, :length], online[n, :length], rtol=8e-3, atol=1e-5)
        assert torch.all(cached[n, length:] == 0)


def test_top32_and_logsumexp_equal_a_direct_log_softmax(cached):
    model, _, records, cache = cached
    assert cache.top_k == 32
    indices = [4, 11]
    length = max(len(records[i]["input_ids"]) for i in indices) + 2
    ids, logprobs = cache.batch_topk(indices, length, "cpu")
    lse = cache.batch_logsumexp(indices, length, "cpu")
    assert ids.shape == logprobs.shape == (2, length, 32) and ids.dtype == torch.long
    assert logprobs.dtype == lse.dtype == torch.float32
    for n, i in enumerate(indices):
        tokens = records[i]["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].float()   # position t: the prediction of token t + 1
        direct = torch.log_softmax(logits, -1)
        top = direct.topk(32, -1)
        count = len(tokens)
        torch.testing.assert_close(logprobs[n, :count], top.values, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(direct.gather(-1, ids[n, :count]), top.values, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[n, :count], torch.logsumexp(logits, -1), rtol=1e-5, atol=1e-5)
        assert torch.all(ids[n, count:] == 0) and torch.all(logprobs[n, count:] == 0) and torch.all(lse[n, count:] == 0)


def test_the_response_feature_statistics_are_the_cached_features_squared(cached):
    _, target, records, cache = cached
    sq_sum, count = cache.response_feature_stats()
    want, tokens = torch.zeros_like(sq_sum), 0
    for i, r in enumerate(records):
        response = cache.record(i)[torch.tensor(r["loss_mask"]).bool()].double()
        want += response.pow(2).sum(0)
        tokens += response.shape[0]
    assert count == tokens == sum(sum(r["loss_mask"]) for r in records)
    torch.testing.assert_close(sq_sum, want, rtol=1e-10, atol=0)
    online_sum, online_count = response_feature_stats(records, target, batch_size=3, progress=False)
    assert online_count == count
    torch.testing.assert_close(online_sum, sq_sum, rtol=1e-3, atol=0)


def fresh_cache(world, folder):
    """(the target, its adapter over layer 1, the records, their cache built anew in `folder`)."""
    _, target_dir, data = world
    model, _ = load_target(target_dir, device="cpu")
    target = TargetAdapter(model, [1])
    records = read_training_data(data)
    return model, target, records, FeatureCache.open_or_build(str(folder), records, data, target_dir, target,
                                                              progress=False)


def test_a_cache_of_the_earlier_format_is_rebuilt_not_read(world, tmp_path):
    model, target, records, first = fresh_cache(world, tmp_path)
    _, target_dir, data = world
    with safe_open(first.path, framework="pt") as f:
        key = f.metadata()
    old_key = {k: v for k, v in key.items() if k not in ("format", "feature_dtype", "top_k")}
    old = load_file(first.path)
    save_file({"features": old["features"].float(), "offsets": old["offsets"]}, first.path, metadata=old_key)
    stamp = os.stat(first.path).st_mtime_ns
    again = FeatureCache.open_or_build(str(tmp_path), records, data, target_dir, target, progress=False)
    assert os.stat(again.path).st_mtime_ns != stamp
    with safe_open(again.path, framework="pt") as f:
        assert f.metadata() == key and f.get_slice("features").get_dtype() == "BF16"
    length = len(records[0]["input_ids"])
    assert again.batch_topk([0], length, "cpu")[0].shape == (1, length, 32)


def test_cache_is_reused_and_rebuilt_when_the_data_changes(world, tmp_path):
    model, target, records, first = fresh_cache(world, tmp_path)
    _, target_dir, data = world
    stamp = os.stat(first.path).st_mtime_ns
    again = FeatureCache.open_or_build(str(tmp_path), records, data, target_dir, target, progress=False)
    assert again.path == first.path and os.stat(again.path).st_mtime_ns == stamp   # read, not rebuilt
    changed = tmp_path / "fewer.jsonl"
    changed.write_text("".join(line for line in open(data).readlines()[:7]))
    fewer = FeatureCache.open_or_build(str(tmp_path), read_training_data(str(changed)), str(changed), target_dir,
                                       target, progress=False)
    assert fewer.path != first.path and len(fewer) == 7
    torch.testing.assert_close(fewer.record(6), first.record(6))
    # other target layers make another cache
    other = FeatureCache.open_or_build(str(tmp_path), records, data, target_dir, TargetAdapter(model, [0]),
                                       progress=False)
    assert other.path != first.path
    assert not torch.allclose(other.record(0), first.record(0))


def test_a_bfloat16_target_has_its_own_cache_beside_the_float32_one(world, tmp_path):
    model, target, records, first = fresh_cache(world, tmp_path)
    _, target_dir, data = world
    stamp = os.stat(first.path).st_mtime_ns
    half = TargetAdapter(load_target(target_dir, device="cpu", dtype="bfloat16")[0], [1])
    second = FeatureCache.open_or_build(str(tmp_path), records, data, target_dir, half, progress=False)
    assert second.path == first.path.replace(".safetensors", "-bfloat16.safetensors")
    with safe_open(second.path, framework="pt") as f:
        assert f.metadata()["dtype"] == "bfloat16"
    again = FeatureCache.open_or_build(str(tmp_path), records, data, target_dir, target, progress=False)
    assert again.path == first.path and os.stat(again.path).st_mtime_ns == stamp   # the float32 one, untouched
    torch.testing.assert_close(second.record(3).float(), first.record(3).float(), rtol=0.1, atol=0.1)


def test_new_target_weights_in_the_same_directory_rebuild_the_cache(world, tmp_path):
    _, target_dir, data = world
    target_copy = tmp_path / "target"
    shutil.copytree(target_dir, target_copy)
    model, _ = load_target(str(target_copy), device="cpu")
    records = read_training_data(data)
    first = FeatureCache.open_or_build(str(tmp_path / "cache"), records, data, str(target_copy),
                                       TargetAdapter(model, [1]), progress=False)
    stamp = os.stat(first.path).st_mtime_ns
    # retrained weights saved over the old ones (same path and file names)
    weights = next(f for f in os.listdir(target_copy) if f.endswith(".safetensors"))
    state = load_file(str(target_copy / weights))
    save_file({k: v * 1.5 for k, v in state.items()}, str(target_copy / weights), metadata={"format": "pt"})
    model, _ = load_target(str(target_copy), device="cpu")
    rebuilt = FeatureCache.open_or_build(str(tmp_path / "cache"), records, data, str(target_copy),
                                         TargetAdapter(model, [1]), progress=False)
    assert os.stat(rebuilt.path).st_mtime_ns != stamp
    assert not torch.allclose(rebuilt.record(0), first.record(0))


def split_shards(world, folder):
    """The world's data cut into two shards, the second gzipped: [(path, records)] in order."""
    _, _, data = world
    lines = open(data).readlines()
    first, second = folder / "part-000.jsonl", folder / "part-001.jsonl.gz"
    first.write_text("".join(lines[:12]))
    with gzip.open(second, "wt") as f:
        f.writelines(lines[12:])
    return [(str(p), read_training_data(str(p))) for p in (first, second)]


def test_a_gzipped_data_file_reads_as_the_plain_one(world, tmp_path):
    _, _, data = world
    shards = split_shards(world, tmp_path)
    assert shards[0][1] + shards[1][1] == read_training_data(data)


def test_a_set_of_shard_caches_reads_like_the_cache_of_their_concatenation(world, tmp_path):
    model, target, records, whole = fresh_cache(world, tmp_path / "whole")
    _, target_dir, _ = world
    shards = split_shards(world, tmp_path)
    caches = FeatureCacheSet.open_or_build(str(tmp_path / "shards"), shards, target_dir, target, progress=False)
    assert len(caches) == len(whole) == len(records) and caches.top_k == whole.top_k
    assert len(list((tmp_path / "shards").glob("*.safetensors"))) == 2   # one cache per shard
    indices = [13, 0, 11, 12, 19]   # both sides of the seam between the shards
    length = max(len(records[i]["input_ids"]) for i in indices) + 1
    # bf16 features: another batch composition moves float32 values by ~1e-7, which can round either way
    torch.testing.assert_close(caches.batch(indices, length, "cpu"), whole.batch(indices, length, "cpu"),
                               rtol=8e-3, atol=1e-5)
    set_ids, set_logprobs = caches.batch_topk(indices, length, "cpu")
    whole_ids, whole_logprobs = whole.batch_topk(indices, length, "cpu")
    torch.testing.assert_close(set_logprobs, whole_logprobs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches.batch_logsumexp(indices, length, "cpu"),
                               whole.batch_logsumexp(indices, length, "cpu"), rtol=1e-5, atol=1e-5)
    assert (set_ids == whole_ids).float().mean() > 0.99   # near-ties among the top 32 may swap
    set_sum, set_count = caches.response_feature_stats()
    whole_sum, whole_count = whole.response_feature_stats()
    assert set_count == whole_count
    torch.testing.assert_close(set_sum, whole_sum, rtol=1e-3, atol=0)
    with pytest.raises(IndexError):
        caches.record(len(records))


def test_a_new_shard_leaves_the_other_shards_caches_as_they_are(world, tmp_path):
    model, _ = load_target(world[1], device="cpu")
    target = TargetAdapter(model, [1])
    shards = split_shards(world, tmp_path)
    first = FeatureCacheSet.open_or_build(str(tmp_path / "cache"), shards[:1], world[1], target, progress=False)
    stamp = os.stat(first.parts[0].path).st_mtime_ns
    both = FeatureCacheSet.open_or_build(str(tmp_path / "cache"), shards, world[1], target, progress=False)
    assert both.parts[0].path == first.parts[0].path and os.stat(both.parts[0].path).st_mtime_ns == stamp
    assert len(both) == 20 and len(both.parts[1]) == 8


def test_training_on_shards_follows_training_on_their_concatenation(world, tmp_path):
    root = world[0]
    shards = [path for path, _ in split_shards(world, tmp_path)]
    whole = train(_config(world, "whole-file", feature_cache=str(tmp_path / "cache"), objective="nll",
                          distill_weight=0.5, max_steps=4, save_every=4), progress=False)
    sharded = train(_config(world, "sharded", data=shards, eval_data=shards, feature_cache=str(tmp_path / "cache"),
                            objective="nll", distill_weight=0.5, max_steps=4, save_every=4), progress=False)
    for a, b in zip(whole["history"], sharded["history"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3, abs=1e-4)
    held = [json.loads(x) for x in open(root / "sharded" / "eval_log.jsonl")]
    assert held and held[-1]["loss"] == pytest.approx(
        json.loads(open(root / "whole-file" / "eval_log.jsonl").readlines()[-1])["loss"], rel=1e-3)


@pytest.mark.parametrize("data, message", [([], "non-empty list"), (["x.jsonl", 3], "non-empty list"),
                                           ("", "non-empty list"), (None, "non-empty list")])
def test_a_bad_data_list_is_refused_naming_the_field(world, data, message):
    with pytest.raises(ValueError, match=f"training config: data must be .*{message}"):
        _config(world, "bad-data", data=data)


def test_a_data_list_with_a_missing_or_repeated_file_is_refused(world, tmp_path):
    _, _, path = world
    with pytest.raises(FileNotFoundError, match="eval_data file .*missing.jsonl.gz"):
        _config(world, "bad-data", eval_data=[path, str(tmp_path / "missing.jsonl.gz")])
    with pytest.raises(ValueError, match="lists .* more than once"):
        _config(world, "bad-data", data=[path, path])


def _config(world, out, **overrides):
    root, target_dir, data = world
    fields = dict(target=target_dir, data=data, eval_data=data, out=str(root / out), init_from=None,
                  drafter={"num_hidden_layers": 1, "mask_token_id": 2}, num_branches=4, block_size=4,
                  objective="al", num_anchors=4, batch_size=4, lr=3e-3, max_steps=6, save_every=3, log_every=1,
                  device="cpu", autocast="off")  # float32 unless a test asks: "auto" is bf16 on CPUs with bf16 matmuls
    fields.update(overrides)
    return validate(TrainConfig(**fields))


def test_training_from_the_cache_follows_the_online_run(world):
    root = world[0]
    online = train(_config(world, "online"), progress=False)
    cached = train(_config(world, "cached", feature_cache=str(root / "run-cache")), progress=False)
    for a, b in zip(online["history"], cached["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5)
    held_online = [json.loads(x) for x in open(root / "online" / "eval_log.jsonl")]
    held_cached = [json.loads(x) for x in open(root / "cached" / "eval_log.jsonl")]
    assert [h["loss"] for h in held_online] == pytest.approx([h["loss"] for h in held_cached], rel=1e-4)
    assert len(list((root / "run-cache").glob("*.safetensors"))) == 1   # train and eval data are one file here


def test_distillation_from_the_cache_follows_the_online_run(world):
    root = world[0]
    settings = dict(objective="nll", distill_weight=0.5, max_steps=4, save_every=4)
    online = train(_config(world, "online-distill", **settings), progress=False)
    cached = train(_config(world, "cached-distill", feature_cache=str(root / "run-cache"), **settings),
                   progress=False)
    hard = train(_config(world, "cached-hard", feature_cache=str(root / "run-cache"), objective="nll", max_steps=4,
                         save_every=4), progress=False)
    for a, b in zip(online["history"], cached["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5)
    assert cached["history"][0]["loss"] != pytest.approx(hard["history"][0]["loss"], rel=1e-3)  # the soft term counts


def test_bf16_autocast_trains_on_cpu_close_to_float32(world):
    # nll: the surrogate's prefix selection is a threshold, which bf16 rounding can move a block across
    full = train(_config(world, "fp32-run", max_steps=2, save_every=2, objective="nll"), progress=False)
    half = train(_config(world, "bf16-run", max_steps=2, save_every=2, objective="nll", autocast="bfloat16"),
                 progress=False)
    first_full, first_half = full["history"][0]["loss"], half["history"][0]["loss"]
    assert first_half != first_full                          # the matmuls did run in bf16
    assert first_half == pytest.approx(first_full, rel=0.05)  # ...and the loss is the same to bf16 precision


def test_auto_autocast_is_bf16_on_cuda_and_on_cpus_with_bf16_matmuls_only(world, monkeypatch, capsys):
    import dblast_ext.decoding.fastest_settings as fastest
    from dblast_ext.training import trainer

    def dtype(native, device="cpu", **fields):
        monkeypatch.setattr(fastest, "cpu_has_native_bf16", lambda: native)
        return trainer.autocast_dtype(_config(world, "auto", **{"autocast": "auto", **fields}), device)

    assert dtype(False) is None
    assert dtype(True) == torch.bfloat16
    assert dtype(True, dtype="float32") is None       # a float32 run stays float32
    assert dtype(False, device="cuda") == torch.bfloat16
    assert dtype(False, autocast="off", device="cuda") is None
    trainer._warn_emulated_bf16.cache_clear()
    capsys.readouterr()
    assert dtype(True, autocast="bfloat16") == torch.bfloat16
    assert capsys.readouterr().err == ""                       # native: no warning
    assert dtype(False, autocast="bfloat16") == torch.bfloat16  # asked for: done, with a warning
    assert "emulates" in capsys.readouterr().err


def test_bad_autocast_is_refused(world):
    with pytest.raises(ValueError, match="autocast"):
        _config(world, "bad", autocast="fp8")
