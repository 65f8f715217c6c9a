"""The drafter trainer: the frozen target gives each batch's context features (online, in
inference mode, or from the feature cache: `features`), the drafter trains on `num_anchors`
blocks per sequence. The data is a set of shards streamed a window at a time (`shards.py`).

Everything a step uses is a function of (seed, step): the data order (a seeded permutation
per epoch, within windows of shards) and the anchors (a generator seeded per micro-batch), so
a run resumed from a checkpoint (drafter weights + optimizer + scheduler; `resume.py`)
continues exactly as if it had never stopped, on this machine or another. Checkpoints are
DFlash-compatible drafter directories (`load_drafter` reads them; a feature scale is folded
into `fc`) with the trainer state beside the weights, which holds the drafter as trained
(unfolded) for the resume. Under `torchrun`, every process takes its own
share of each step's batch and gradients are averaged across processes before the update.
"""
import functools
import json
import math
import os
import re
import shutil
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from ..target.adapter import TargetAdapter
from ..drafting.drafter import DBlastDrafter, DrafterConfig
from ..drafting.drafter_io import check_against_target, load_drafter, save_pretrained, set_feature_scale
from ..jsonl import read_jsonl
from ..progress import progress_bar
from ..target.loading import default_device, load_target
from .config import LEGACY_VALUES, SELECTION_MEASURES, TrainConfig, data_paths
from .data import read_training_data
from .feature_cache import FeatureCache, open_feature_caches, response_feature_stats, rms_feature_scale
from .losses import decay_weights, flat_step_weights
from .objective import batch_loss, collate
from .resume import (STATE_FILE, check_resume_from, latest_checkpoint, restore_rng_states, resume_state,
                     rng_states, run_identity, trim_logs)
from .shard_cache import GB, ShardFeatureCaches
from .shards import ShardedData, seed_of

# a DFlash2 drafter's own parts, the ones freeze_backbone trains, and the selector (selector_only)
DFLASH2_PART = re.compile(r"(^|\.)(attention_conv|mlp_conv|candidate_selector)\.")
SELECTOR_PART = re.compile(r"(^|\.)candidate_selector\.")


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """Evenly spread target layers from the second to the fourth-from-last (the DFlash layout)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, max(1, num_target_layers - 3)
    return [round(first + i * (last - first) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


_seed = seed_of


def target_rope_theta(target_config) -> float:
    """The target's RoPE base: a config field in transformers 4, inside `rope_parameters` in 5."""
    theta = getattr(target_config, "rope_theta", None)
    if theta is None:
        theta = (getattr(target_config, "rope_parameters", None) or {}).get("rope_theta")
    return float(theta or 1e6)


def build_drafter(config: TrainConfig, target) -> (DBlastDrafter, Optional[int]):
    """The drafter to train and the block size its checkpoint was trained at (None from scratch)."""
    generator = torch.Generator().manual_seed(_seed(config.seed, "branch-head"))
    if config.init_from is not None:
        drafter = load_drafter(config.init_from, target=target)
        trained_block = drafter.config.block_size
        if config.num_branches is not None and config.num_branches != drafter.num_branches:
            if drafter.num_branches != 1:
                raise ValueError(f"init_from has {drafter.num_branches} branches; num_branches "
                                 f"{config.num_branches} needs a K = 1 (DFlash) checkpoint to add a head to")
            drafter.add_branch_head(config.num_branches, generator=generator)
        if config.dflash2 is not None and not drafter.config.is_dflash2:
            drafter.add_dflash2(**config.dflash2, generator=generator)
        if drafter.config.is_dflash2 and (drafter.config.output_multiplier != 1.0
                                          or drafter.config.final_logit_softcapping):
            raise ValueError("training a DFlash2 drafter whose draft logits are scaled or soft-capped is not "
                             "supported: the losses read the LM head's own logits")
        if config.block_size is not None:
            if config.block_size < trained_block and not config.allow_smaller_block:
                raise ValueError(f"block_size {config.block_size} is below the checkpoint's {trained_block}: "
                                 "set allow_smaller_block to train a shorter block on purpose")
            drafter.config.block_size = config.block_size
        return drafter.float(), trained_block
    tc = target.config
    spec = dict(config.drafter)
    layers = spec.pop("num_hidden_layers", 1)
    heads = spec.pop("num_attention_heads", tc.num_attention_heads)
    drafter_config = DrafterConfig(
        hidden_size=tc.hidden_size, intermediate_size=spec.pop("intermediate_size", tc.intermediate_size),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=spec.pop("num_key_value_heads", getattr(tc, "num_key_value_heads", heads)),
        head_dim=spec.pop("head_dim", getattr(tc, "head_dim", None) or tc.hidden_size // heads),
        block_size=config.block_size or 16, num_target_layers=tc.num_hidden_layers,
        target_layer_ids=spec.pop("target_layer_ids", default_target_layers(tc.num_hidden_layers, layers)),
        mask_token_id=spec.pop("mask_token_id"), vocab_size=tc.vocab_size, rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_theta=spec.pop("rope_theta", target_rope_theta(tc)))
    if spec:
        raise ValueError(f"training config: unknown drafter fields {sorted(spec)}")
    check_against_target(drafter_config, tc)
    torch.manual_seed(_seed(config.seed, "init"))
    drafter = DBlastDrafter(drafter_config)
    if config.num_branches and config.num_branches > 1:
        drafter.add_branch_head(config.num_branches, generator=generator)
    return drafter, None


def position_weights(config: TrainConfig, num_draft: int, trained_block: Optional[int]) -> Optional[torch.Tensor]:
    """The weight of each draft position k = 1..b in every loss term: DFlash's decay
    exp(-(k-1)/decay) (none when decay is null or 0) times DBloom's flat step
    (new_position_weight at the positions a block expansion adds, 1 elsewhere)."""
    weights = torch.ones(num_draft)
    if trained_block is not None and trained_block - 1 < num_draft and config.new_position_weight != 1.0:
        weights = weights * flat_step_weights(num_draft, trained_block, config.new_position_weight)
    if config.decay:
        weights = weights * decay_weights(num_draft, config.decay)
    return None if torch.all(weights == 1) else weights


def feature_scale(config: TrainConfig, data: ShardedData, target: TargetAdapter,
                  cache: Optional[ShardFeatureCaches], progress: bool) -> Optional[torch.Tensor]:
    """The per-channel scale of the target features (`feature_scaling`), from the response
    tokens of the training data's first `feature_scale_shards` shards (all by default): the
    cache's statistics, else one target pass over them, a shard at a time."""
    if config.feature_scaling == "none":
        return None
    shards = range(min(len(data.paths), config.feature_scale_shards or len(data.paths)))
    if cache is not None:
        return rms_feature_scale(*cache.response_feature_stats(shards))
    if len(shards) == 1:
        return rms_feature_scale(*response_feature_stats(data.shard_records(0), target, progress=progress))
    bar = progress_bar(len(shards), desc="feature statistics", unit="shard", enabled=progress)
    total, count = None, 0
    for shard in shards:
        part_sum, part_count = response_feature_stats(data.shard_records(shard), target, progress=False)
        total, count = (part_sum if total is None else total + part_sum), count + part_count
        bar.update(1)
    bar.close()
    return rms_feature_scale(total, count)


def resumed_plateau(config: TrainConfig, state: Optional[Dict]) -> "Plateau":
    """The plateau of a run (resumed or not): as saved, or, where the run selected by another
    measure before (`select_by` changed), replayed from its held-out log up to the resumed step."""
    saved = ((state or {}).get("plateau") or {}).get("select_by", LEGACY_VALUES["select_by"])
    if not state or saved == config.select_by:
        return Plateau(config.patience, state, config.select_by)
    plateau = Plateau(config.patience, None, config.select_by)
    for entry in read_eval_log(config.out):
        if 0 < entry["step"] <= state["step"]:  # step 0 (eval_at_start) is the start, never a candidate
            if config.select_by not in entry:   # a measure added after the run's checkpoints were taken
                raise ValueError(f"select_by {config.select_by!r}: {config.out}/eval_log.jsonl has no "
                                 f"{config.select_by} at step {entry['step']} (logged before it was measured); "
                                 f"resume with select_by {saved!r}, as the run was started")
            plateau.update(entry["step"], entry)
    return plateau


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to zero."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class _Distributed:
    """torchrun: rank / world size from the environment, gradient averaging; one process otherwise."""

    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.owns_group = self.world > 1 and not dist.is_initialized()
        if self.owns_group:
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")

    def close(self, finished: bool) -> None:
        """Destroys the process group this object created: one left to the interpreter's exit can
        abort the process ("terminate called without an active exception") after training succeeded.
        A finished run first waits for every rank (rank 0 may still be writing `final`); a failed
        one does not, as its peers may never arrive."""
        if not self.owns_group or not dist.is_initialized():
            return
        if finished:
            dist.barrier()
        dist.destroy_process_group()
        self.owns_group = False

    def average_gradients(self, parameters, blocks: int) -> int:
        """Turns gradients of per-block loss sums into the gradient of the mean over every block
        of the step, on every rank (micro-batches and ranks holding different numbers of blocks
        weigh by their blocks, as one large batch would). Returns the step's block count."""
        parameters = [p for p in parameters if p.requires_grad]
        total = blocks
        if self.world > 1:
            count = torch.tensor([float(blocks)], device=parameters[0].device)
            dist.all_reduce(count)
            total = int(count.item())
        for p in parameters:
            if p.grad is None:  # no valid block on this rank this step: every rank reduces the same tensors
                p.grad = torch.zeros_like(p)
            if self.world > 1:
                dist.all_reduce(p.grad)
            p.grad /= max(1, total)
        return total

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


@functools.lru_cache(maxsize=1)
def _warn_emulated_bf16() -> None:   # once per process, not at every held-out evaluation
    print("training: autocast bfloat16 on a CPU without bf16 matmul instructions emulates them (a step took "
          "26x as long as in float32 on an AVX2 CPU); \"autocast\": \"auto\" picks float32 here", file=sys.stderr)


def autocast_dtype(config: TrainConfig, device: str) -> Optional[torch.dtype]:
    """bfloat16 when the drafter's matmuls autocast, None when they run in float32: `auto` is
    bfloat16 on CUDA unless the run asks for float32, and on a CPU with bf16 matmul
    instructions (AVX-512 BF16 or AMX), where it about halves a step. A CPU without them
    emulates bf16 matmuls (measured on a 2-core AVX2 machine: a step took 26x as long as in
    float32), so `auto` is float32 there and an explicit `bfloat16` is warned about."""
    from ..decoding.fastest_settings import cpu_has_native_bf16

    on_cuda = device.startswith("cuda")
    if config.autocast == "off":
        return None
    if config.autocast == "auto":
        native = on_cuda or cpu_has_native_bf16()
        return torch.bfloat16 if native and config.dtype != "float32" else None
    if not on_cuda and not cpu_has_native_bf16():
        _warn_emulated_bf16()
    return torch.bfloat16


def training_autocast(config: TrainConfig, device: str):
    """The autocast context of the drafter's matmuls (the [rows, K, V] label logits above all);
    master weights stay float32."""
    dtype = autocast_dtype(config, device)
    if dtype is None:
        return torch.autocast("cpu", enabled=False)
    return torch.autocast(device.split(":")[0], dtype=dtype)


def _batch_positions(step: int, micro: int, config: TrainConfig, rank: int, world: int) -> range:
    """The data stream positions of one micro-batch (`ShardedData.index_at` gives their records)."""
    per_step = config.batch_size * config.grad_accum * world
    start = step * per_step + (micro * world + rank) * config.batch_size
    return range(start, start + config.batch_size)


def _config_loss(drafter, target, batch, config: TrainConfig, weights, generator, cache: Optional[FeatureCache],
                 indices: List[int], agreement: bool = False, per_block: bool = False):
    """batch_loss with the run's objective settings (training steps and held-out evaluation
    alike), on the cache's target outputs when there is one."""
    length = batch.input_ids.shape[1]
    features = cache.batch(indices, length, batch.input_ids.device) if cache else None
    teacher = (cache.batch_topk(indices, length, batch.input_ids.device)
               if cache and (config.distill_weight > 0 or agreement) else None)
    return batch_loss(drafter, target, batch, objective=config.objective, num_anchors=config.num_anchors,
                      generator=generator, tau=config.tau, al_variant=config.al_variant, position_weights=weights,
                      chunk_size=config.chunk_size, features=features, recompute_logits=config.recompute_logits,
                      distill_weight=config.distill_weight, teacher=teacher, agreement=agreement,
                      selector_weight=config.selector_weight, per_block=per_block)


ANCHOR_LOG = "eval_anchors.jsonl"


def evaluate(drafter, target, records, config, weights, device, cache: Optional[FeatureCache] = None,
             anchors: Optional[Dict[str, list]] = None) -> Dict[str, float]:
    """Mean loss, acceptance proxy and greedy-chain accepted length (`greedy_accepted`: what the
    decode loop's greedy drafts would commit, objective.greedy_chain_accepted) over held-out
    records (fixed anchors), and per block position the top-1 agreement: how often the greedy
    draft is the target's most likely token. `anchors` (a dict) receives every held-out block's
    own estimates: "record" (its record's index), "anchor" (its anchor position),
    "accepted_proxy", "greedy_accepted", lists in the same order.
    The anchors follow from the records, `seed`, `num_anchors` and `batch_size` alone, so runs
    that share those are measured on the same blocks, pair by pair."""
    totals, blocks = {"loss": 0.0, "accepted_proxy": 0.0, "greedy_accepted": 0.0}, 0
    hits = positions = 0
    if anchors is not None:
        anchors.update({"record": [], "anchor": [], "accepted_proxy": [], "greedy_accepted": []})
    with torch.no_grad(), training_autocast(config, device):  # the same precision as the training loss
        for start in range(0, len(records), config.batch_size):
            indices = list(range(start, min(start + config.batch_size, len(records))))
            batch = collate([records[i] for i in indices], device)
            out = _config_loss(drafter, target, batch, config, weights,
                               torch.Generator().manual_seed(_seed(config.seed, "eval", start)), cache, indices,
                               agreement=True, per_block=anchors is not None)
            n = int(out["blocks"])
            if anchors is not None:
                anchors["record"] += [indices[row] for row in out["block_rows"].tolist()]
                anchors["anchor"] += out["block_anchors"].tolist()
                anchors["accepted_proxy"] += [round(value, 6) for value in out["block_proxy"].tolist()]
                anchors["greedy_accepted"] += [int(value) for value in out["block_greedy"].tolist()]
            totals["loss"] += float(out["loss"]) * n
            totals["accepted_proxy"] += float(out["accepted_proxy"]) * n
            totals["greedy_accepted"] += float(out["greedy_accepted"]) * n
            if "selector_loss" in out:  # DFlash2: the selector's share of the loss
                totals["selector_loss"] = totals.get("selector_loss", 0.0) + float(out["selector_loss"]) * n
            hits, positions = hits + out["agreement_hits"], positions + out["agreement_positions"]
            blocks += n
    result = {k: v / max(1, blocks) for k, v in totals.items()}
    counted = zip(hits.tolist(), positions.tolist()) if torch.is_tensor(hits) else ()
    result["top1_agreement"] = [round(h / p, 4) if p else None for h, p in counted]
    return result


class Plateau:
    """The best held-out value of the selection measure so far (`select_by`: the loss, lower is
    better, or the accepted-length proxy, higher), its step, and how many checkpoints since it:
    training stops once that count reaches `patience` (None: never)."""

    def __init__(self, patience: Optional[int], state: Optional[Dict] = None, select_by: str = "loss"):
        self.patience, self.select_by = patience, select_by
        self.higher_is_better = SELECTION_MEASURES[select_by]
        saved = (state or {}).get("plateau") or {}
        self.best_step, self.stale = saved.get("best_step"), saved.get("stale", 0)
        self.best_value = saved.get("best_value", saved.get("best_loss"))  # runs before select_by saved best_loss

    def update(self, step: int, held_out: Optional[Dict]) -> None:
        if held_out is None:
            return
        value = held_out[self.select_by]
        better = self.best_value is None or (value > self.best_value if self.higher_is_better
                                             else value < self.best_value)
        if better:
            self.best_step, self.best_value, self.stale = step, value, 0
        else:
            self.stale += 1

    @property
    def reached(self) -> bool:
        return self.patience is not None and self.stale >= self.patience

    def to_json(self) -> Dict:
        return {"best_step": self.best_step, "best_value": self.best_value, "stale": self.stale,
                "select_by": self.select_by}


def train(config: TrainConfig, *, progress: bool = True, stop_at_step: Optional[int] = None,
          resume_from: Optional[str] = None) -> Dict:
    """Trains (or resumes training of) a drafter; returns the run's summary. `stop_at_step`
    ends the run early after that step's checkpoint, as an interruption would. A run resumes
    from the newest checkpoint in `config.out`, or from `resume_from` (a checkpoint folder,
    e.g. one copied from another machine)."""
    device = config.device or default_device()
    if resume_from is not None:
        check_resume_from(resume_from, config.out)
    parallel = _Distributed(device)
    finished = False
    try:
        summary = _train(config, device, parallel, progress, stop_at_step, resume_from)
        finished = True
        return summary
    finally:
        parallel.close(finished)


def uses_feature_cache(config: TrainConfig, device: str) -> bool:
    """Whether the run reads the target's features from the cache (`features`): `auto` computes
    them online on CUDA, where a target forward is cheap beside the disk a cache would take,
    and reads the cache elsewhere when `feature_cache` names one."""
    if config.features == "auto":
        return bool(config.feature_cache) and not device.startswith("cuda")
    return config.features == "cached"


def open_caches(config: TrainConfig, data: ShardedData, eval_files, target, progress: bool):
    """(the training shards' caches, the held-out set's cache or None). The held-out cache comes
    first and is never evicted; without a bound, every shard's cache is built up front (a run
    of no steps then prepares them), with one, a window's at a time as training reaches it."""
    eval_cache = (open_feature_caches(config.feature_cache, eval_files, config.target, target, progress=progress)
                  if eval_files else None)
    pinned = [] if eval_cache is None else [p.path for p in getattr(eval_cache, "parts", [eval_cache])]
    max_bytes = None if config.feature_cache_max_gb is None else int(config.feature_cache_max_gb * GB)
    cache = ShardFeatureCaches(config.feature_cache, data, config.target, target, max_bytes=max_bytes,
                               pinned=pinned, progress=progress)
    if max_bytes is None:
        cache.ensure(range(len(data.paths)))
    return cache, eval_cache


def _train(config: TrainConfig, device: str, parallel: _Distributed, progress: bool,
           stop_at_step: Optional[int], resume_from: Optional[str]) -> Dict:
    if parallel.world > 1 and device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    os.makedirs(config.out, exist_ok=True)
    target_model, _ = load_target(config.target, device=device, dtype=config.dtype, progress=progress)
    target_model.requires_grad_(False)
    drafter, trained_block = build_drafter(config, target_model)
    drafter = drafter.to(device).float().train()
    target = TargetAdapter(target_model, drafter.config.target_layer_ids)
    train_paths, eval_paths = data_paths(config.data, "data"), data_paths(config.eval_data, "eval_data")
    data = ShardedData(train_paths, config.seed, config.shard_window)
    eval_files = [(path, read_training_data(path)) for path in eval_paths]
    eval_records = [r for _, file_records in eval_files for r in file_records] or None
    cache = eval_cache = None
    if uses_feature_cache(config, device):
        cache, eval_cache = open_caches(config, data, eval_files, target, progress and parallel.rank == 0)
    weights = position_weights(config, drafter.config.block_size - 1, trained_block)
    if (trained_block is not None and drafter.config.block_size > trained_block and config.new_position_weight == 1.0
            and parallel.rank == 0):
        print(f"training: block {trained_block} -> {drafter.config.block_size} with the new positions weighted like "
              "the others (new_position_weight 1.0); DBloom weights them 3x (new_position_weight: 3.0)",
              file=sys.stderr)
    if weights is not None:
        weights = weights.to(device)
    per_step = config.batch_size * config.grad_accum * parallel.world
    total = (config.max_steps if config.max_steps is not None
             else config.epochs * math.ceil(len(data) / per_step))
    warmup = int(config.warmup_ratio * total)
    # the data order and anchors follow from the records and the world size as well as the config
    identity = run_identity(config, train_paths, eval_paths, parallel.world)
    resume_from = resume_from or latest_checkpoint(config.out)
    state = resume_state(resume_from, config, identity, device) if resume_from else None
    # the scale goes in before the optimizer sees fc; a resumed run reads it back, not recomputed
    scale = (state.get("feature_scale") if state else
             feature_scale(config, data, target, cache, progress and parallel.rank == 0))
    if scale is not None:
        set_feature_scale(drafter, scale.to(device), keep_function=trained_block is not None)
    if config.freeze_backbone or config.selector_only:
        field = "selector_only" if config.selector_only else "freeze_backbone"
        if not drafter.config.is_dflash2:
            raise ValueError(f"{field} trains a DFlash2 drafter's own parts: the drafter has none (set dflash2)")
        part = SELECTOR_PART if config.selector_only else DFLASH2_PART
        for name, parameter in drafter.named_parameters():
            parameter.requires_grad_(part.search(name) is not None)
    trained = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, warmup))
    start = 0
    if state:
        # the drafter as trained; model.safetensors has fc folded (and is all a run before this field had)
        drafter.load_state_dict(state["drafter"] if "drafter" in state else
                                load_file(os.path.join(resume_from, "model.safetensors"), device=str(device)))
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        restore_rng_states(state.get("rng"), device)
        start = state["step"]
        if parallel.rank == 0:
            trim_logs(config.out, start)
    initial = None
    if config.eval_at_start and eval_records and not state and parallel.rank == 0:
        # the drafter as it starts (init_from, or fresh weights): what the run has to improve on
        anchors = {}
        initial = evaluate(drafter, target, eval_records, config, weights, device, eval_cache, anchors=anchors)
        append_eval_log(config.out, 0, initial)
        append_anchor_log(config.out, 0, anchors)
    plateau = resumed_plateau(config, state)
    autocast = training_autocast(config, device)
    bar = progress_bar(total, initial=start, desc="training", unit="step", enabled=progress and parallel.rank == 0)
    log_path = os.path.join(config.out, "train_log.jsonl")
    history = []
    for step in range(start, total):
        if plateau.reached:  # a resumed run that had already stopped
            break
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_sum = proxy_sum = 0.0
        blocks = 0  # this rank's blocks this step: the loss is a mean over blocks, backpropagated as a sum
        for micro in range(config.grad_accum):
            positions = _batch_positions(step, micro, config, parallel.rank, parallel.world)
            indices = [data.index_at(p) for p in positions]
            if cache is not None:   # the caches of the window(s) the batch reads, built if missing
                cache.ensure(sorted({s for p in positions for s in data.window_shards(p)}))
            batch = collate(data.records(indices), device)
            with autocast:
                out = _config_loss(drafter, target, batch, config, weights, torch.Generator().manual_seed(
                    _seed(config.seed, step, micro * parallel.world + parallel.rank)), cache, indices)
            n = int(out["blocks"])
            (out["loss"] * n).backward()
            loss_sum += float(out["loss"].detach()) * n
            proxy_sum += float(out["accepted_proxy"]) * n
            blocks += n
        parallel.average_gradients(drafter.parameters(), blocks)
        loss_sum, proxy_sum = loss_sum / max(1, blocks), proxy_sum / max(1, blocks)  # this rank's block means
        grad_norm = float(torch.nn.utils.clip_grad_norm_(drafter.parameters(), config.max_grad_norm))
        lr = scheduler.get_last_lr()[0]  # the rate this step uses (scheduler.step() moves to the next)
        optimizer.step()
        scheduler.step()
        entry = {"step": step + 1, "loss": loss_sum, "accepted_proxy": proxy_sum, "grad_norm": grad_norm,
                 "lr": lr, "seconds": time.perf_counter() - started}
        history.append(entry)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_sum:.3f}", accept=f"{proxy_sum:.2f}", lr=f"{entry['lr']:.1e}",
                        epoch=f"{(step + 1) * per_step / len(data):.2f}")
        last = step + 1 == total or (stop_at_step is not None and step + 1 == stop_at_step)
        if parallel.rank == 0 and ((step + 1) % config.log_every == 0 or last):
            with open(log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")
        if (step + 1) % config.save_every == 0 or last:
            if parallel.rank == 0:
                anchors = {}
                held_out = (evaluate(drafter, target, eval_records, config, weights, device, eval_cache,
                                     anchors=anchors) if eval_records else None)
                if held_out is not None:
                    append_anchor_log(config.out, step + 1, anchors)
                plateau.update(step + 1, held_out)
                save_checkpoint(drafter, optimizer, scheduler, config, step + 1, held_out, identity, plateau,
                                extra={"data_position": data.position_info((step + 1) * per_step),
                                       "rng": rng_states(device)})
            parallel.barrier()
            if parallel.world > 1:  # every rank stops at the same step
                plateau.stale = int(_broadcast(plateau.stale, device))
            if plateau.reached:
                if parallel.rank == 0:
                    print(f"training: held-out {config.select_by} has not improved for {plateau.stale} "
                          f"checkpoints (patience {config.patience}); stopping at step {step + 1}, "
                          f"final = step {plateau.best_step}",
                          file=sys.stderr)
                break
        if stop_at_step is not None and step + 1 == stop_at_step:
            break
    bar.close()
    finished = history[-1]["step"] if history else start
    done = finished == total or plateau.reached
    if parallel.rank == 0 and done:
        final = os.path.join(config.out, "final")
        if config.patience is not None and plateau.best_step is not None:  # the best held-out checkpoint
            copy_checkpoint(os.path.join(config.out, f"checkpoint-{plateau.best_step:07d}"), final)
        else:
            save_pretrained(drafter, final)
    return {"steps": finished, "total_steps": total, "history": history,
            "final": os.path.join(config.out, "final") if done else None, "stopped_early": plateau.reached,
            "best_step": plateau.best_step, "initial_held_out": initial,
            "feature_cache": cache.stats() if cache is not None else None}


def _broadcast(value: int, device) -> int:
    """Rank 0's value on every rank."""
    tensor = torch.tensor([value], device=device)
    dist.broadcast(tensor, 0)
    return int(tensor.item())


def copy_checkpoint(checkpoint: str, out: str) -> None:
    """A checkpoint's drafter (config.json, model.safetensors; not the trainer state) into `out`."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(checkpoint):
        if name != STATE_FILE and os.path.isfile(os.path.join(checkpoint, name)):
            shutil.copyfile(os.path.join(checkpoint, name), os.path.join(out, name))


def save_checkpoint(drafter, optimizer, scheduler, config, step, held_out, identity: Dict,
                    plateau: Optional[Plateau] = None, extra: Optional[Dict] = None) -> str:
    """`identity`: what else a resume must match (the data by content, the world size, ...).
    model.safetensors is the drafter to use (fc folded); the state file keeps the drafter as
    trained and its feature scale, which a resume continues from bit for bit; `extra`: more
    of the run's state (the data position, the RNG states)."""
    path = os.path.join(config.out, f"checkpoint-{step:07d}")
    save_pretrained(drafter, path)
    # the state file marks a complete checkpoint (latest_checkpoint looks for it): written whole or not at all
    partial = os.path.join(path, STATE_FILE + ".partial")
    scale = getattr(drafter.fc, "feature_scale", None)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "drafter": drafter.state_dict(), "feature_scale": None if scale is None else scale.detach().cpu(),
                "config": config.to_json(), "held_out": held_out,
                "plateau": plateau.to_json() if plateau else None, **identity, **(extra or {})}, partial)
    os.replace(partial, os.path.join(path, STATE_FILE))
    if held_out is not None:
        append_eval_log(config.out, step, held_out)
    return path


def read_eval_log(out: str) -> List[Dict]:
    """out/eval_log.jsonl's held-out measurements, in order; none when the run has not logged one."""
    path = os.path.join(out, "eval_log.jsonl")
    return [entry for _, entry in read_jsonl(path, "held-out log")] if os.path.isfile(path) else []


def append_eval_log(out: str, step: int, held_out: Dict) -> None:
    """One line of out/eval_log.jsonl: the held-out measurement at `step`."""
    with open(os.path.join(out, "eval_log.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, **held_out}) + "\n")


def append_anchor_log(out: str, step: int, anchors: Dict[str, list]) -> None:
    """One line of out/eval_anchors.jsonl: every held-out block's acceptance estimate at `step`
    (`evaluate`'s `anchors`), beside eval_log.jsonl's means."""
    with open(os.path.join(out, ANCHOR_LOG), "a") as f:
        f.write(json.dumps({"step": step, **anchors}) + "\n")


def read_anchor_log(out: str) -> List[Dict]:
    """out/eval_anchors.jsonl's lines, in order (none when the run has not logged one)."""
    path = os.path.join(out, ANCHOR_LOG)
    return [entry for _, entry in read_jsonl(path, "held-out anchor log")] if os.path.isfile(path) else []


__all__ = ["train", "build_drafter", "default_target_layers", "latest_checkpoint", "lr_factor", "read_anchor_log"]
