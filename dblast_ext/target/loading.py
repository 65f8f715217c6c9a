"""Loading a target: a local Hugging Face causal LM and its tokenizer, nothing downloaded and
no code from the checkpoint executed. Also the small pieces every front end needs around
it: device and dtype choice, prompt encoding (plain or through the chat template), and the
stop tokens."""
import contextlib
import os
from typing import List, Optional

import torch

from ..checkpoint_files import check_weights_file, read_json_object

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """'auto' is bfloat16 on GPUs and float32 on CPUs (16-bit matmuls are slow on most CPUs)."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def check_target_path(path: str, name: str = "--target") -> None:
    """A clear error for a target that is neither "default" nor a local directory."""
    from .default import DEFAULT_TARGET

    if path != DEFAULT_TARGET and not os.path.isdir(path):
        raise FileNotFoundError(f"{name} {path!r} is not a local directory (nothing is downloaded: give a directory "
                                f"with config.json, the weights and the tokenizer files, or {DEFAULT_TARGET!r} for "
                                "the embedded SmolLM2-135M-Instruct)")


@contextlib.contextmanager
def _transformers_progress_bars(enabled: bool):
    """transformers' own bars (weight loading) on or off for the block, as they were after."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled and not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


# the JSON files of a transformers model directory that from_pretrained reads when present
_TARGET_JSON_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                      "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "added_tokens.json")


def check_target_files(path: str) -> None:
    """Every file of a local target that loading reads, checked before anything loads: a damaged
    one (not JSON, a truncated safetensors) is named with what is wrong, where transformers and
    tokenizers would fail with an error naming neither."""
    for name in _TARGET_JSON_FILES:
        if os.path.isfile(os.path.join(path, name)):
            read_json_object(os.path.join(path, name))
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            check_weights_file(os.path.join(path, name))


def load_target(path: str, *, device: Optional[str] = None, dtype: str = "auto", progress: bool = True):
    """(model, tokenizer) from a local directory holding a transformers causal LM
    (config.json, weights, tokenizer files), or "default" for the embedded SmolLM2.
    `progress=False` also silences transformers' weight-loading bar (a command's --no-progress)."""
    from .default import resolve_target

    check_target_path(path)
    path = resolve_target(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"target {path!r} is not a local directory (nothing is downloaded: give a "
                                "directory with config.json, the weights and the tokenizer files)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"target directory {path!r} has no config.json: not a transformers model")
    check_target_files(path)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # the kernels need no transformers; the decode loop does
        raise ImportError("loading a target needs transformers: pip install 'dblast_ext[hf]'") from e
    device = device or default_device()
    with _transformers_progress_bars(progress):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, device), local_files_only=True,
                                                     trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    return model.to(device).eval(), tokenizer


def encode_prompt(tokenizer, prompt: str, chat: bool, system: Optional[str] = None) -> List[int]:
    """Token ids of a prompt. With `chat`, the text goes through the tokenizer's chat template
    as one user turn (plus an optional system turn) and is encoded without adding special
    tokens again, since the template already frames it."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if not chat:
        return tokenizer(prompt)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target's tokenizer has no chat template; run without --chat")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return encode_messages(tokenizer, messages)


def encode_messages(tokenizer, messages: List[dict]) -> List[int]:
    """Token ids of a conversation ending in a user turn, ready for the assistant's answer:
    through the chat template (special tokens not added again, the template frames the
    text), or for a tokenizer without one (a base model) the turns' text joined plainly."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]


def declared_eos_ids(*holders) -> set:
    """The `eos_token_id` values (an id, a list of ids or None) that configs, generation
    configs or tokenizers declare, as one set."""
    ids = set()
    for holder in holders:
        value = getattr(holder, "eos_token_id", None)
        if value is not None:
            ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return ids


def stop_token_ids(model, tokenizer) -> List[int]:
    """The end-of-sequence ids of the model's generation config and of its tokenizer."""
    return sorted(declared_eos_ids(getattr(model, "generation_config", None), tokenizer))


class TextStream:
    """Turns token ids arriving in pieces into printable text pieces: decodes everything so
    far and hands out only the new characters, holding back a trailing partial character."""

    def __init__(self, tokenizer, write):
        self.tokenizer, self.write = tokenizer, write
        self.ids: List[int] = []
        self.shown = 0

    def __call__(self, new_ids: List[int]) -> None:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            return
        if len(text) > self.shown:
            self.write(text[self.shown:])
            self.shown = len(text)
