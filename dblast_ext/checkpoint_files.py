"""Reading the files of a checkpoint (a drafter's or a local target's) so that a damaged one is
named with what is wrong with it: a config that is not JSON, a safetensors file that is truncated
or not safetensors at all. json and safetensors raise errors that name neither the file nor the
fix, and a target's loader (transformers, tokenizers) fails far from the cause."""
import json

from safetensors import SafetensorError, safe_open

__all__ = ["read_json_object", "check_weights_file"]


def read_json_object(path: str) -> dict:
    """The JSON object in `path`, or a ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    return data


def check_weights_file(path: str) -> None:
    """A safetensors file's header, read without its tensors: it records every tensor's extent,
    so a truncated or foreign file fails here, before anything large loads."""
    try:
        with safe_open(path, framework="pt"):
            pass
    except SafetensorError as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error}); is it truncated or still "
                         "downloading?") from None
