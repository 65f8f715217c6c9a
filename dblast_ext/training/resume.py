"""Resuming a run from a checkpoint, on this machine or another one.

A checkpoint's trainer state holds the drafter as trained, the optimizer, the schedule, the
step (the data position follows from it: the order is a function of the seed and the step,
`shards.ShardedData`), the RNG states, the run's config and its identity: what the run
trained on, by content. A resume must be the same run, so a config that differs in a field
that changes what is trained is refused, naming the fields. Paths are not what is trained: a
run copied to another machine finds its target, data and starting checkpoint elsewhere, so
those fields are compared by their content (`run_identity`) and the fields that only say how
this machine carries the run out (`MACHINE_FIELDS`) may differ.
"""
import glob
import hashlib
import json
import os
import re
from typing import Dict, List, Optional

import torch

from ..jsonl import read_jsonl
from .config import LEGACY_VALUES, TrainConfig
from .feature_cache import file_digest

__all__ = ["STATE_FILE", "RESELECTABLE", "MACHINE_FIELDS", "CONTENT_FIELDS", "config_changes", "data_digest",
           "run_identity", "resume_state", "latest_checkpoint", "checkpoint_step", "check_resume_from",
           "trim_logs", "rng_states", "restore_rng_states"]

STATE_FILE = "trainer_state.pt"

# Fields that only choose among the checkpoints (which is best, when to stop), not what is
# trained: a resumed run may change them, and its plateau is then replayed from eval_log.jsonl.
RESELECTABLE = ("select_by",)
# Fields that say where this machine keeps things and how it computes, not what is trained.
MACHINE_FIELDS = ("out", "device", "feature_cache", "feature_cache_max_gb", "features", "log_every", "chunk_size",
                  "recompute_logits")
# Path fields compared by content instead (the identity key that holds it): a state made before
# that key existed compares the path as before.
CONTENT_FIELDS = {"target": "target_identity", "data": "data_sha256", "eval_data": "eval_sha256",
                  "init_from": "init_identity"}


def config_changes(saved: Dict, config: TrainConfig, state: Optional[Dict] = None) -> List[str]:
    """The fields in which a checkpoint's config differs from this run's, RESELECTABLE and
    MACHINE_FIELDS aside, and the CONTENT_FIELDS whose content the checkpoint's `state`
    identifies; a field the saved config predates counts as its LEGACY_VALUES value."""
    now = config.to_json()
    free = set(RESELECTABLE) | set(MACHINE_FIELDS) | {k for k, v in CONTENT_FIELDS.items() if v in (state or {})}
    before = {key: saved.get(key, LEGACY_VALUES.get(key)) for key in now}
    return [f"{key} {before[key]!r} -> {now[key]!r}" for key in now
            if before[key] != now[key] and key not in free] + \
        [f"{key} (gone)" for key in saved if key not in now]


def data_digest(paths: List[str]) -> str:
    """sha256 of the training data: the file's bytes for one file; for a list, of its files'
    digests in order (so a run resumes only on the same shards in the same order)."""
    digests = [file_digest(p) for p in paths]
    return digests[0] if len(digests) == 1 else hashlib.sha256("\n".join(digests).encode()).hexdigest()


def target_identity(target: str) -> str:
    """A target as its content: for a local directory, its config.json and the names and sizes
    of its other files (hashing gigabytes of weights per resume would not pay); a name as is."""
    if not os.path.isdir(target):
        return target
    digest = hashlib.sha256()
    config = os.path.join(target, "config.json")
    if os.path.isfile(config):
        digest.update(open(config, "rb").read())
    for name in sorted(os.listdir(target)):
        path = os.path.join(target, name)
        if name != "config.json" and os.path.isfile(path):
            digest.update(f"\n{name}:{os.path.getsize(path)}".encode())
    return digest.hexdigest()


def drafter_identity(init_from: Optional[str]) -> Optional[str]:
    """sha256 of a starting checkpoint's config.json and weights (an embedded name included)."""
    if init_from is None:
        return None
    from ..drafting.drafter_io import checkpoint_files

    return hashlib.sha256("\n".join(file_digest(p) for p in checkpoint_files(init_from)).encode()).hexdigest()


def run_identity(config: TrainConfig, train_paths: List[str], eval_paths: List[str], world: int) -> Dict:
    """What a resume must match besides the config: the data, held-out data, target and
    starting checkpoint by content, and the number of processes (the data order follows it)."""
    return {"data_sha256": data_digest(train_paths), "world_size": world,
            "eval_sha256": data_digest(eval_paths) if eval_paths else None,
            "target_identity": target_identity(config.target), "init_identity": drafter_identity(config.init_from)}


def resume_state(checkpoint: str, config: TrainConfig, identity: Dict, device) -> Dict:
    """The trainer state of `checkpoint`, when it was made by this very run (config, data,
    target, world size); an error naming what differs otherwise."""
    state = torch.load(os.path.join(checkpoint, STATE_FILE), map_location=device, weights_only=False)
    differences = config_changes(state["config"], config, state)
    if differences:
        raise ValueError(f"{checkpoint} was made by a run with another config ({'; '.join(differences)}); "
                         "use another out directory")
    changed = [k for k, v in identity.items() if k in state and state[k] != v]
    if changed:
        raise ValueError(f"{checkpoint} was made by a run with another {' and '.join(changed)} "
                         f"({', '.join(f'{k} {state[k]} -> {identity[k]}' for k in changed)}); "
                         "use another out directory")
    return state


def checkpoint_step(checkpoint: str) -> int:
    match = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(os.path.normpath(checkpoint)))
    return int(match.group(1)) if match else -1


def latest_checkpoint(out: str) -> Optional[str]:
    found = sorted(glob.glob(os.path.join(out, "checkpoint-*", STATE_FILE)))
    return os.path.dirname(found[-1]) if found else None


def check_resume_from(checkpoint: str, out: str) -> None:
    """A checkpoint to resume from (`--resume-from`): a whole one, and none past it in `out`
    (a run goes on from its newest checkpoint: later ones would be trained over)."""
    if not os.path.isfile(os.path.join(checkpoint, STATE_FILE)):
        raise FileNotFoundError(f"--resume-from {checkpoint!r} is not a training checkpoint (no {STATE_FILE}; "
                                "a checkpoint-NNNNNNN folder of a run's out directory is)")
    step = torch.load(os.path.join(checkpoint, STATE_FILE), map_location="cpu", weights_only=False)["step"]
    later = sorted(p for p in glob.glob(os.path.join(out, "checkpoint-*", STATE_FILE))
                   if checkpoint_step(os.path.dirname(p)) > step)
    if later:
        raise ValueError(f"--resume-from {checkpoint!r} is step {step}, but {out} holds later checkpoints "
                         f"({', '.join(os.path.basename(os.path.dirname(p)) for p in later)}): delete them or "
                         "use another out directory")


def trim_logs(out: str, step: int) -> None:
    """Drops the log entries past `step`, the checkpoint a run resumes from: a run stopped
    between checkpoints has logged steps it will train again (and may have cut its last line
    short, which is dropped too)."""
    for name in ("train_log.jsonl", "eval_log.jsonl", "eval_anchors.jsonl"):
        path = os.path.join(out, name)
        if os.path.isfile(path):
            kept = [entry for _, entry in read_jsonl(path, name, live=True) if entry["step"] <= step]
            with open(path, "w") as f:
                f.writelines(json.dumps(entry) + "\n" for entry in kept)


def rng_states(device: str) -> Dict:
    """The global generators' states. A step draws from its own seeded generators, so nothing
    depends on these; kept so that code that does use them (a dropout) resumes as well."""
    states = {"torch": torch.get_rng_state()}
    if device.startswith("cuda") and torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state(torch.device(device))
    return states


def restore_rng_states(states: Optional[Dict], device: str) -> None:
    """Sets what `rng_states` saved; a CUDA state only on a CUDA run (another machine's CPU
    run has none to set)."""
    if not states:
        return
    torch.set_rng_state(states["torch"].cpu())
    if "cuda" in states and device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"].cpu(), torch.device(device))
