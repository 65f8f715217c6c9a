"""The training configuration: one JSON file, every field checked before anything loads.

    {
      "target": "path/to/target",            # local transformers causal LM
      "data": "train.jsonl",                 # `dblast data generate` output (.jsonl or .jsonl.gz), a list of
                                             # such files, a folder of them or a glob (shards: one set)
      "eval_data": "heldout.jsonl",          # optional (the same kinds): held-out loss at each checkpoint
      "shard_window": null,                  # shards in memory at once, the shuffle's span (null: all)
      "out": "runs/dblast-k4",
      "init_from": "path/to/dflash",         # DFlash/DBLast checkpoint or an embedded drafter's name
                                             # (dblast-k4, dflash-k1); null = from scratch ("drafter")
      "drafter": {"num_hidden_layers": 1, "target_layer_ids": [1, 4], "mask_token_id": 97},
      "num_branches": 4, "block_size": 16,
      "objective": "al", "tau": 0.1, "al_variant": "all_prefixes",
      "new_position_weight": 3.0,            # DBloom flat step on positions a block expansion adds
      "decay": 7,                            # DFlash position weights exp(-(k-1)/7); null or 0: uniform
      "distill_weight": 0.0,                 # nll only: (1 - w) * hard labels + w * the target's top-32
      "feature_scaling": "rms",              # target features / their RMS per channel, folded into fc on save
      "num_anchors": 8, "batch_size": 4, "grad_accum": 1,
      "lr": 6e-4, "weight_decay": 0.0, "warmup_ratio": 0.04, "max_grad_norm": 1.0,
      "epochs": 1, "max_steps": null,
      "patience": null,                      # with eval_data: stop after this many checkpoints without a
                                             # better held-out select_by; final/ is then the best checkpoint
      "select_by": "loss",                   # loss (lower is better), accepted_proxy (higher; for "al")
                                             # or greedy_accepted (higher: the greedy chain's run)
      "eval_at_start": false,                # with eval_data: the held-out loss of the drafter before
                                             # step 1 too (step 0 of eval_log.jsonl): what a run from
                                             # init_from must beat; with max_steps 0 it only measures
      "save_every": 200, "log_every": 10, "seed": 0,
      "chunk_size": null,                    # LM-head rows at a time in the loss (null: by device,
                                             # losses.auto_chunk_rows; the values do not depend on it)
      "recompute_logits": true,              # false: keep label logits for backward (faster, more memory)
      "device": null, "dtype": "auto",
      "feature_cache": "runs/features",      # optional: target features computed once per data file
      "feature_cache_max_gb": null,          # bound on that folder (least recently used shards evicted)
      "features": "auto",                    # online | cached | auto (online on CUDA, cached elsewhere
                                             # when feature_cache is set)
      "feature_scale_shards": null,          # feature_scaling's RMS over the first N shards (null: all)
      "autocast": "auto",                    # bfloat16 | off | auto (bfloat16 on CUDA, off on CPU)
      "dflash2": {"conv_kernel_size": 2, "conv_group_size": 16,   # optional: make a K = 1 init_from a
                  "selector_rank": 64, "selector_top_k": 16},     # DFlash2 drafter (identity convs, new
                                                                 # selector) or train a DFlash2 one
      "selector_weight": 1.0,                # DFlash2: weight of the selector's candidate cross-entropy
      "freeze_backbone": false,              # DFlash2: train only the convolutions and the selector
      "selector_only": false                 # DFlash2: train only the selector (the rest as it was)
    }
"""
import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, List, Optional, Union

from .losses import AL_VARIANTS
from .shards import is_pattern, resolve_data


@dataclass
class TrainConfig:
    target: str
    data: Union[str, List[str]]
    out: str
    init_from: Optional[str] = None
    eval_data: Union[str, List[str], None] = None
    shard_window: Optional[int] = None
    drafter: dict = field(default_factory=dict)
    num_branches: Optional[int] = None
    block_size: Optional[int] = None
    allow_smaller_block: bool = False
    objective: str = "nll"
    tau: float = 0.1
    al_variant: str = "all_prefixes"
    new_position_weight: float = 1.0
    decay: Optional[float] = 7.0
    distill_weight: float = 0.0
    feature_scaling: str = "rms"
    num_anchors: int = 8
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    max_grad_norm: float = 1.0
    epochs: int = 1
    max_steps: Optional[int] = None
    patience: Optional[int] = None
    select_by: str = "loss"
    eval_at_start: bool = False
    save_every: int = 200
    log_every: int = 10
    seed: int = 0
    chunk_size: Optional[int] = None
    recompute_logits: bool = True
    device: Optional[str] = None
    dtype: str = "auto"
    feature_cache: Optional[str] = None
    feature_cache_max_gb: Optional[float] = None
    features: str = "auto"
    feature_scale_shards: Optional[int] = None
    autocast: str = "auto"
    dflash2: Optional[dict] = None
    selector_weight: float = 1.0
    freeze_backbone: bool = False
    selector_only: bool = False

    def to_json(self) -> dict:
        return asdict(self)


# What runs made before a field existed trained with: a saved config without the field is
# compared as if it held this value.
LEGACY_VALUES = {"distill_weight": 0.0, "feature_scaling": "none", "patience": None, "eval_at_start": False,
                 "select_by": "loss", "dflash2": None, "selector_weight": 1.0, "freeze_backbone": False,
                 "selector_only": False, "shard_window": None, "feature_scale_shards": None,
                 "feature_cache_max_gb": None, "features": "auto"}
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# The held-out measures that can pick the best checkpoint (`select_by`), and whether higher is
# better: the loss for the NLL objectives; the accepted-length proxy for the surrogate, whose
# loss sums over a retained prefix set that grows as the drafter improves, so that a better
# drafter can show a higher loss; the greedy chain's accepted length for what the decode loop
# drafts (objective.greedy_chain_accepted), which neither of the others measures.
SELECTION_MEASURES = {"loss": False, "accepted_proxy": True, "greedy_accepted": True}
FEATURE_SCALINGS = ("rms", "none")
FEATURE_SOURCES = ("auto", "online", "cached")


def _positive(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_decay(decay) -> None:
    """`decay` is DFlash's gamma: position k weighs exp(-(k-1)/gamma). null or 0: uniform."""
    if decay is None or (_is_number(decay) and decay == 0):
        return
    if not _is_number(decay) or not decay > 1:
        # earlier versions read decay r in (0, 1] as weights r^(k-1): refused, never reinterpreted
        raise ValueError(f"training config: decay must be null or 0 (uniform position weights) or gamma > 1 "
                         f"(weights exp(-(k-1)/gamma), DFlash: 7), got {decay!r}; a weight r^(k-1) is "
                         f"gamma = -1/ln(r)")


def data_paths(value: Union[str, List[str], None], key: str = "data") -> List[str]:
    """The files of a `data` / `eval_data` field: one file, a folder's or a glob's files (sorted),
    or a list of files (none for None)."""
    return resolve_data(value, key)


def _check_data_field(key: str, value) -> None:
    """A file, a folder or glob of data files, or a non-empty list of distinct existing files."""
    if isinstance(value, list):
        if not value or not all(isinstance(p, str) and p for p in value):
            raise ValueError(f"training config: {key} must be a data file, folder or glob, or a non-empty "
                             f"list of file paths, got {value!r}")
        repeated = sorted({p for p in value if value.count(p) > 1})
        if repeated:
            raise ValueError(f"training config: {key} lists {repeated[0]!r} more than once")
    elif not isinstance(value, str) or not value:
        raise ValueError(f"training config: {key} must be a data file, folder or glob, or a non-empty "
                         f"list of file paths, got {value!r}")
    elif os.path.isdir(value) or is_pattern(value):
        data_paths(value, key)   # a folder or glob that holds no data file is an error naming it
        return
    for path in data_paths(value, key):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"training config: {key} file {path!r} does not exist "
                                    "(make it with `dblast data generate`)")


def _check_features(c: TrainConfig, name) -> None:
    """shard_window, feature_scale_shards, features and feature_cache_max_gb."""
    for key in ("shard_window", "feature_scale_shards"):
        if getattr(c, key) is not None:
            _positive(name(key), getattr(c, key))
    if c.features not in FEATURE_SOURCES:
        raise ValueError(f"{name('features')} must be one of {FEATURE_SOURCES}, got {c.features!r}")
    if c.features == "cached" and not c.feature_cache:
        raise ValueError(f"{name('features')} 'cached' needs feature_cache (the folder to keep them in)")
    if c.feature_cache_max_gb is not None:
        if not _is_number(c.feature_cache_max_gb) or not c.feature_cache_max_gb > 0:
            raise ValueError(f"{name('feature_cache_max_gb')} must be a number > 0 (gigabytes), "
                             f"got {c.feature_cache_max_gb!r}")
        if not c.feature_cache:
            raise ValueError(f"{name('feature_cache_max_gb')} bounds the feature cache: it needs feature_cache")


def validate(c: TrainConfig, flags: Optional[Dict[str, str]] = None) -> TrainConfig:
    """Checks every field; `flags` maps the fields a command-line flag set to that flag, which
    their errors name instead of the config field."""
    def name(key: str) -> str:
        return (flags or {}).get(key) or f"training config: {key}"

    for key in ("num_anchors", "batch_size", "grad_accum", "epochs", "save_every", "log_every", "chunk_size"):
        if key != "chunk_size" or c.chunk_size is not None:
            _positive(name(key), getattr(c, key))
    if not isinstance(c.eval_at_start, bool):
        raise ValueError(f"training config: eval_at_start must be true or false, got {c.eval_at_start!r}")
    if c.eval_at_start and not c.eval_data:
        raise ValueError("training config: eval_at_start measures the held-out loss: it needs eval_data")
    if c.max_steps is not None and not (c.max_steps == 0 and c.eval_at_start):
        # 0 steps with eval_at_start: only the held-out measurement of the drafter it starts from
        _positive(name("max_steps"), c.max_steps)
    if c.patience is not None:
        _positive(name("patience"), c.patience)
        if not c.eval_data:
            raise ValueError(f"{name('patience')} stops on a held-out measure: it needs eval_data")
    if c.select_by not in SELECTION_MEASURES:
        raise ValueError(f"{name('select_by')} must be one of {sorted(SELECTION_MEASURES)}, got {c.select_by!r}")
    if c.num_branches is not None:
        _positive(name("num_branches"), c.num_branches)
    if c.block_size is not None and (not isinstance(c.block_size, int) or c.block_size < 2):
        raise ValueError(f"{name('block_size')} must be an integer >= 2, got {c.block_size!r}")
    if c.objective not in ("nll", "al"):
        raise ValueError(f"{name('objective')} must be 'nll' or 'al', got {c.objective!r}")
    if c.al_variant not in AL_VARIANTS:
        raise ValueError(f"training config: al_variant must be one of {AL_VARIANTS}, got {c.al_variant!r}")
    if not c.tau >= 0:
        raise ValueError(f"training config: tau must be >= 0, got {c.tau}")
    if not c.lr > 0 or c.weight_decay < 0 or not 0 <= c.warmup_ratio < 1 or not c.max_grad_norm > 0:
        raise ValueError("training config: need lr > 0, weight_decay >= 0, 0 <= warmup_ratio < 1, max_grad_norm > 0")
    if not isinstance(c.recompute_logits, bool):
        raise ValueError(f"training config: recompute_logits must be true or false, got {c.recompute_logits!r}")
    if c.autocast not in ("auto", "bfloat16", "off"):
        raise ValueError(f"training config: autocast must be 'auto', 'bfloat16' or 'off', got {c.autocast!r}")
    if not c.new_position_weight > 0:
        raise ValueError(f"{name('new_position_weight')} must be > 0, got {c.new_position_weight}")
    _check_decay(c.decay)
    if not _is_number(c.distill_weight) or not 0 <= c.distill_weight <= 1:
        raise ValueError(f"training config: distill_weight must be a number in [0, 1], got {c.distill_weight!r}")
    if c.distill_weight > 0 and c.objective != "nll":
        raise ValueError(f"training config: distill_weight {c.distill_weight} applies to the nll objective only "
                         f"({name('objective')} is {c.objective!r}); set distill_weight to 0")
    _check_features(c, name)
    if c.feature_scaling not in FEATURE_SCALINGS:
        raise ValueError(f"training config: feature_scaling must be one of {FEATURE_SCALINGS}, "
                         f"got {c.feature_scaling!r}")
    if c.dflash2 is not None:
        if not isinstance(c.dflash2, dict) or sorted(c.dflash2) != sorted(DFLASH2_FIELDS):
            raise ValueError(f"training config: dflash2 must be an object with exactly {list(DFLASH2_FIELDS)}, "
                             f"got {c.dflash2!r}")
        for key in DFLASH2_FIELDS:
            _positive(f"training config: dflash2.{key}", c.dflash2[key])
        if c.init_from is None:
            raise ValueError("training config: dflash2 adds DFlash2's parts to a K = 1 drafter: it needs init_from")
        if c.num_branches not in (None, 1):
            raise ValueError(f"training config: a DFlash2 drafter drafts one chain: num_branches must be 1 or "
                             f"null with dflash2, got {c.num_branches}")
    if not _is_number(c.selector_weight) or not c.selector_weight >= 0:
        raise ValueError(f"training config: selector_weight must be a number >= 0, got {c.selector_weight!r}")
    if not isinstance(c.freeze_backbone, bool):
        raise ValueError(f"training config: freeze_backbone must be true or false, got {c.freeze_backbone!r}")
    if not isinstance(c.selector_only, bool):
        raise ValueError(f"training config: selector_only must be true or false, got {c.selector_only!r}")
    from ..drafting.drafter_io import checkpoint_files
    from ..target.loading import check_target_path

    check_target_path(c.target, name("target"))
    _check_data_field("data", c.data)
    if c.eval_data is not None:
        _check_data_field("eval_data", c.eval_data)
    if c.init_from is None:
        missing = [k for k in ("mask_token_id",) if k not in c.drafter]
        if missing:
            raise ValueError(f"training config: training from scratch (init_from null) needs drafter.{missing[0]}")
    else:
        try:
            checkpoint_files(c.init_from)  # a checkpoint directory or an embedded drafter's name
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{name('init_from')}: {e}") from None
    return c


def load_config(path: str, flag_names: Optional[Dict[str, str]] = None, **overrides) -> TrainConfig:
    """The config file's fields, with the `overrides` that are not None in their place;
    `flag_names` (field -> flag) lets errors in overridden fields name the flag."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no training config at {path}")
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown training config fields {unknown}; known: {sorted(known)}")
    overridden = {k: v for k, v in overrides.items() if v is not None}
    raw.update(overridden)
    missing = [k for k in ("target", "data", "out") if k not in raw]
    if missing:
        raise ValueError(f"{path}: training config lacks {missing}")
    return validate(TrainConfig(**raw), {k: v for k, v in (flag_names or {}).items() if k in overridden})
