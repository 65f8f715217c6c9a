"""Reading and writing drafters in the DFlash checkpoint format (config.json +
model.safetensors), with DBLast's branch head under `dblast_config`. Loading never runs
code from the checkpoint.

Training may scale the target features channel by channel before `fc`
(`set_feature_scale`); saving folds the scale into `fc.weight`, so a checkpoint never holds
it and stays a plain DFlash one."""
import dataclasses
import hashlib
import json
import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..checkpoint_files import check_weights_file, read_json_object
from .drafter import DBlastDrafter, DrafterConfig

_KNOWN = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "block_size", "num_target_layers", "dflash_config", "dblast_config", "vocab_size",
          "rms_norm_eps", "rope_theta", "attention_bias", "layer_types", "sliding_window", "use_sliding_window",
          "is_causal"}
# config.json `architectures`: vLLM's DFlash draft model, and the DBLast one that
# dblast_ext.vllm registers with vLLM (kept here so writing a checkpoint never imports vLLM)
DFLASH_ARCHITECTURE = "DFlashDraftModel"
DBLAST_ARCHITECTURE = "DFlashDBLastDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
# DFlash settings read from `dflash_config` first, then the top level (as DFlash's own loader does).
_DRAFT_KEYS = ("mask_token_id", "target_layer_ids", "block_size", "input_embedding_scale", "conv_kernel_size",
               "conv_group_size", "selector_rank", "selector_top_k", "output_multiplier", "final_logit_softcapping")
# DFlash2's settings (dblast_ext.drafting.dflash2), written back to `dflash_config` when set
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Settings that change the drafter's math in some DFlash variant and that this drafter does not
# implement: refused rather than ignored. Value = what a checkpoint may hold and still load.
_UNSUPPORTED = {"use_swa": None, "swa_window_size": None, "causal": None}
# the candidate selector's codebooks are stored bare in the published checkpoints and with
# `.weight` by some writers (transformers' save_pretrained of an Embedding): both load
_CODEBOOK_SPELLINGS = {f"candidate_selector.{name}_codebook.weight": f"candidate_selector.{name}_codebook"
                       for name in ("predecessor", "successor")}


def _draft_value(raw: dict, name: str, default=None):
    nested = raw.get("dflash_config") or {}
    return nested[name] if name in nested else raw.get(name, default)


def _rope_theta(raw: dict) -> float:
    """The RoPE base: `rope_theta` (transformers 4) or `rope_parameters.rope_theta` (5); plain
    RoPE only (a scaled variant would move every position without an error)."""
    parameters = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in parameters.values()):
        raise ValueError(f"drafter config.json rope_parameters per layer type {parameters} are not supported by this "
                         f"drafter (one RoPE for every layer)")
    for key, rope in (("rope_scaling", scaling), ("rope_parameters", parameters)):
        kind = rope.get("rope_type", rope.get("type", "default"))
        if rope and kind != "default":
            raise ValueError(f"drafter config.json {key} {rope} is not supported by this drafter (plain RoPE only)")
    theta = raw.get("rope_theta", parameters.get("rope_theta"))
    return float(theta) if theta is not None else 1e6


def config_from_json(raw: dict) -> DrafterConfig:
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if k not in raw]
    missing += [k for k in ("mask_token_id", "target_layer_ids") if _draft_value(raw, k) is None]
    if missing:
        raise ValueError(f"drafter config.json lacks {missing} (at the top level or in dflash_config): not a "
                         f"DFlash/DBLast checkpoint")
    _check_field_types(raw)
    for key, allowed in _UNSUPPORTED.items():
        value = _draft_value(raw, key, allowed)
        if (value != allowed) if allowed is not None else bool(value):  # set to something that changes the math
            raise ValueError(f"drafter config.json {key} = {value!r}: this DFlash variant is not supported "
                             f"(the drafter implements DFlash's Qwen3-style layers only)")
    layer_types, window = _attention_layout(raw)
    dflash2 = _dflash2_fields(raw)
    heads = raw["num_attention_heads"]
    target_layer_ids = list(_draft_value(raw, "target_layer_ids"))
    is_causal = raw.get("is_causal")
    return DrafterConfig(
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads", heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        block_size=int(_draft_value(raw, "block_size", 16)),
        num_target_layers=raw.get("num_target_layers", max(target_layer_ids) + 1),
        target_layer_ids=target_layer_ids, mask_token_id=int(_draft_value(raw, "mask_token_id")),
        vocab_size=raw["vocab_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(raw),
        attention_bias=raw.get("attention_bias", False), layer_types=layer_types,
        sliding_window=window, is_causal=None if is_causal is None else bool(is_causal),
        input_embedding_scale=float(_draft_value(raw, "input_embedding_scale", 1.0)),
        num_branches=raw.get("dblast_config", {}).get("num_branches", 1),
        extra=_extra_fields(raw), **dflash2,
    )


def _dflash2_fields(raw: dict) -> dict:
    """DFlash2's settings (DrafterConfig fields), each checked: the convolution needs both its
    sizes, the selector both of its own; the logits' multiplier and soft-cap are numbers."""
    fields = {key: _draft_value(raw, key) for key in _DFLASH2_KEYS}
    for first, second in (("conv_kernel_size", "conv_group_size"), ("selector_rank", "selector_top_k")):
        if (fields[first] is None) != (fields[second] is None):
            raise ValueError(f"drafter config.json sets {first if fields[first] is not None else second} without "
                             f"{second if fields[first] is not None else first}: DFlash2 needs both")
    for key, value in fields.items():
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"drafter config.json {key} must be a positive integer, got {value!r}")
    if fields["conv_group_size"] is not None and raw["hidden_size"] % fields["conv_group_size"]:
        raise ValueError(f"drafter config.json conv_group_size {fields['conv_group_size']} does not divide "
                         f"hidden_size {raw['hidden_size']}")
    multiplier = _draft_value(raw, "output_multiplier", 1.0)
    softcap = _draft_value(raw, "final_logit_softcapping")
    if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)) or not multiplier > 0:
        raise ValueError(f"drafter config.json output_multiplier must be a number > 0, got {multiplier!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0):
        raise ValueError(f"drafter config.json final_logit_softcapping must be a number >= 0, got {softcap!r}")
    is_dflash2 = fields["conv_kernel_size"] is not None or fields["selector_rank"] is not None
    if is_dflash2 and raw.get("dblast_config", {}).get("num_branches", 1) != 1:
        raise ValueError("drafter config.json: a DFlash2 drafter with DBLast branches (dblast_config.num_branches "
                         "> 1) is not supported")
    return dict(fields, output_multiplier=float(multiplier), final_logit_softcapping=softcap or None)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_field_types(raw: dict) -> None:
    """The sizes and ids the drafter is built from, each of the kind it must be: a wrong one
    would otherwise surface as a shape error deep inside the first forward."""
    sizes = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    sizes += [k for k in ("num_key_value_heads", "head_dim") if raw.get(k) is not None]
    for key in sizes:
        if not _is_int(raw[key]) or raw[key] < 1:
            raise ValueError(f"drafter config.json {key} must be a positive integer, got {raw[key]!r}")
    block = _draft_value(raw, "block_size", 16)
    if not _is_int(block) or block < 2:
        raise ValueError(f"drafter config.json block_size must be an integer >= 2, got {block!r}")
    mask = _draft_value(raw, "mask_token_id")
    if not _is_int(mask) or not 0 <= mask < raw["vocab_size"]:
        raise ValueError(f"drafter config.json mask_token_id must be a token id in [0, {raw['vocab_size']}), "
                         f"got {mask!r}")
    layers = _draft_value(raw, "target_layer_ids")
    if not isinstance(layers, list) or not layers or not all(_is_int(i) and i >= 0 for i in layers):
        raise ValueError(f"drafter config.json target_layer_ids must be a non-empty list of layer indices >= 0, "
                         f"got {layers!r}")


def _attention_layout(raw: dict):
    """(layer_types or None, sliding window or None) as DFlash gets them from its Qwen3Config:
    the window counts only with `use_sliding_window` (default off); without `layer_types`, the
    layers from `max_window_layers` (default 28) on slide when a window is on. A sliding layer
    is causal even without a window."""
    window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
    if window is not None and not (isinstance(window, int) and window > 0):
        raise ValueError(f"drafter config.json sliding_window must be a positive integer, got {window!r}")
    layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types")
    if layer_types is None and window is not None:
        first = raw.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if layer_types is not None and (len(layer_types) != layers
                                    or set(layer_types) - {"full_attention", "sliding_attention"}):
        raise ValueError(f"drafter config.json layer_types must name full_attention or sliding_attention for "
                         f"each of the {layers} layers, got {layer_types}")
    return layer_types, window


def _extra_fields(raw: dict) -> dict:
    """config.json fields the drafter does not read, kept to be written back unchanged (other
    `dflash_config` entries included)."""
    extra = {k: v for k, v in raw.items() if k not in _KNOWN and k not in _DRAFT_KEYS}
    nested = {k: v for k, v in (raw.get("dflash_config") or {}).items() if k not in _DRAFT_KEYS}
    if nested:
        extra["dflash_config"] = nested
    return extra


def config_to_json(c: DrafterConfig) -> dict:
    raw = dict(c.extra)
    raw.update(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
               num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
               num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, block_size=c.block_size,
               num_target_layers=c.num_target_layers, vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,
               rope_theta=c.rope_theta, attention_bias=c.attention_bias,
               dflash_config={**c.extra.get("dflash_config", {}), "mask_token_id": c.mask_token_id,
                              "target_layer_ids": list(c.target_layer_ids)})
    if c.input_embedding_scale != 1.0:
        raw["dflash_config"]["input_embedding_scale"] = c.input_embedding_scale
    for key in _DFLASH2_KEYS + ("final_logit_softcapping",):
        if getattr(c, key) is not None:
            raw["dflash_config"][key] = getattr(c, key)
    if c.output_multiplier != 1.0:
        raw["dflash_config"]["output_multiplier"] = c.output_multiplier
    if c.layer_types is not None:
        raw.update(layer_types=c.layer_types, sliding_window=c.sliding_window,
                   use_sliding_window=c.sliding_window is not None)
    if c.is_causal is not None:
        raw["is_causal"] = c.is_causal
    if c.num_branches > 1:
        raw["dblast_config"] = {"num_branches": c.num_branches}
    # what vLLM (and transformers' AutoConfig) read to pick the model: DFlash's Qwen3-style
    # draft model, or this package's vLLM plugin class for a K-branch head (docs/serving.md)
    raw["architectures"] = [DFLASH2_ARCHITECTURE if c.is_dflash2 else
                            DFLASH_ARCHITECTURE if c.num_branches == 1 else DBLAST_ARCHITECTURE]
    raw.setdefault("model_type", "qwen3")
    return raw


def check_against_target(config: DrafterConfig, target_config) -> None:
    """Clear errors when a drafter cannot serve a target (a Hugging Face config object)."""
    if target_config.hidden_size != config.hidden_size:
        raise ValueError(f"drafter hidden size {config.hidden_size} != target hidden size {target_config.hidden_size}")
    if not 0 <= config.mask_token_id < target_config.vocab_size:
        raise ValueError(f"mask token id {config.mask_token_id} has no slot in the target's vocabulary "
                         f"of {target_config.vocab_size}")
    bad = [l for l in config.target_layer_ids if not 0 <= l < target_config.num_hidden_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} are out of range for a target with "
                         f"{target_config.num_hidden_layers} layers")


def checkpoint_files(path: str):
    """(config.json, model.safetensors) of a local drafter checkpoint (or an embedded drafter's
    name, see `embedded_drafters`), or a clear error."""
    from .embedded_drafters import resolve_drafter

    path = resolve_drafter(path)
    files = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    for needed in files:
        if not os.path.isfile(needed):
            raise FileNotFoundError(f"drafter checkpoint file missing: {needed} (nothing is downloaded)")
    return files


def read_config_file(config_path: str) -> DrafterConfig:
    """A drafter checkpoint's config.json as the loader reads it; every failure names the file."""
    raw = read_json_object(config_path)
    try:
        return config_from_json(raw)
    except ValueError as error:
        raise ValueError(f"{config_path}: {error}") from None
    except (TypeError, KeyError, AttributeError) as error:  # a field of the wrong kind (a number as a list, ...)
        raise ValueError(f"{config_path}: a field has the wrong type ({type(error).__name__}: {error})") from None


def read_weights(weights_path: str) -> dict:
    """A checkpoint's tensors; a damaged file (truncated, not safetensors) is named, where
    safetensors' own error names neither the file nor what to do."""
    check_weights_file(weights_path)
    return load_file(weights_path)


def _digest_fields(config: DrafterConfig) -> dict:
    """The config fields that fingerprint a drafter: every field the loader reads (not `extra`,
    kept and never read), an optional one only where it differs from its default, so a field
    added to DrafterConfig later leaves the digests of the checkpoints before it unchanged."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "extra":
            continue
        default = (f.default if f.default is not dataclasses.MISSING else
                   f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        if default is dataclasses.MISSING or value != default:
            out[f.name] = value
    return out


def checkpoint_digest(path: str) -> str:
    """A short fingerprint of what a drafter checkpoint computes: sha256 of its config as the
    loader reads it (DrafterConfig's fields) and of every tensor (name, dtype, shape, bytes).
    Evaluation runs record it, so records of a retrained drafter under the same name never mix
    with the old one's; fields of config.json the loader does not read (those added for vLLM,
    say) and the file layout leave it unchanged."""
    config_path, weights_path = checkpoint_files(path)
    config = read_config_file(config_path)
    digest = hashlib.sha256(json.dumps(_digest_fields(config), sort_keys=True).encode())
    check_weights_file(weights_path)
    with safe_open(weights_path, framework="pt") as f:
        for name in sorted(f.keys()):
            tensor = f.get_tensor(name).contiguous()
            digest.update(f"\n{name}:{str(tensor.dtype)}:{tuple(tensor.shape)}\n".encode())
            digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def load_drafter(path: str, target=None, num_branches: Optional[int] = None, *,
                 generator: Optional[torch.Generator] = None) -> DBlastDrafter:
    """Loads a DFlash or DBLast drafter from a local directory (config.json + model.safetensors).
    With num_branches = K > 1 on a DFlash (K = 1) checkpoint, adds a K-branch head whose
    branches start near the DFlash drafter but differ. `target` (a Hugging Face causal LM),
    when given, is checked for compatibility."""
    config_path, weights_path = checkpoint_files(path)
    config = read_config_file(config_path)
    if target is not None:
        check_against_target(config, target.config)
    drafter = DBlastDrafter(config)
    state = {_CODEBOOK_SPELLINGS.get(name, name): tensor for name, tensor in read_weights(weights_path).items()}
    try:
        missing, unexpected = drafter.load_state_dict(state, strict=False)
    except RuntimeError as error:  # a tensor of the wrong shape for config.json
        raise ValueError(f"{weights_path} does not match {config_path}: {error}") from None
    if missing or unexpected:
        raise ValueError(f"{weights_path} does not match the drafter architecture of {config_path}: missing "
                         f"{sorted(missing)}, unexpected {sorted(unexpected)}")
    dtype = next(iter(state.values())).dtype if state else torch.float32
    drafter = drafter.to(dtype)
    if num_branches is not None and num_branches != drafter.num_branches:
        if drafter.num_branches != 1:
            raise ValueError(f"checkpoint already has {drafter.num_branches} branches; cannot change to {num_branches}")
        drafter.add_branch_head(num_branches, generator=generator)
    return drafter


class FeatureScaledLinear(nn.Linear):
    """The drafter's `fc` with a per-channel scale on its input: fc(x * scale). The scale is a
    non-persistent buffer, so the state dict keeps DFlash's names (`fc.weight`, no bias) and
    gradients reach the weight as through a plain Linear."""

    def __init__(self, weight: nn.Parameter, scale: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = weight
        self.register_buffer("feature_scale", scale.to(weight.device, weight.dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x * self.feature_scale.to(x.dtype), self.weight)


@torch.no_grad()
def set_feature_scale(drafter: DBlastDrafter, scale: torch.Tensor, *, keep_function: bool) -> None:
    """Makes the drafter read its target features times `scale` [L*H] (one factor per input
    channel of `fc`). `keep_function` divides `fc.weight` by the scale so the drafter computes
    what it did before (for a trained checkpoint); otherwise the weights stay as they are (a
    fresh initialisation meets well-scaled features). A per-channel scale only: DFlash's `fc`
    has no bias, so a mean shift could not be folded into the checkpoint."""
    if isinstance(drafter.fc, FeatureScaledLinear):
        raise ValueError("the drafter's features are scaled already")
    weight = drafter.fc.weight
    if scale.shape != (weight.shape[1],):
        raise ValueError(f"feature scale must have shape ({weight.shape[1]},) (fc's input channels), "
                         f"got {tuple(scale.shape)}")
    if not bool(torch.all(torch.isfinite(scale) & (scale > 0))):
        raise ValueError("feature scale must be finite and > 0 in every channel")
    if keep_function:
        weight.copy_((weight.double() / scale.to(weight.device).double()).to(weight.dtype))
    drafter.fc = FeatureScaledLinear(weight, scale)


def folded_state_dict(drafter: DBlastDrafter) -> dict:
    """The drafter's state dict in the checkpoint format: with scaled features, `fc.weight *
    scale` (broadcast over the output rows), which reads raw features to the same result."""
    state = {k: v.detach() for k, v in drafter.state_dict().items()}
    scale = getattr(drafter.fc, "feature_scale", None)
    if scale is not None:
        weight = state["fc.weight"]
        state["fc.weight"] = (weight.double() * scale.to(weight.device).double()).to(weight.dtype)
    return state


def save_pretrained(drafter: DBlastDrafter, path: str) -> None:
    """Writes config.json + model.safetensors (a feature scale folded into `fc.weight`); K = 1
    drafters stay loadable as DFlash."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_json(drafter.config), f, indent=2)
    state = {k: v.contiguous() for k, v in folded_state_dict(drafter).items()}
    save_file(state, os.path.join(path, "model.safetensors"))
