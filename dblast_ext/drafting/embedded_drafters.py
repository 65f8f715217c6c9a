"""The drafters shipped inside the package for the embedded default target (SmolLM2-135M-
Instruct, `--target default`): `dflash-k1` (K = 1, NLL) and `dblast-k4` (K = 4, accepted-
length surrogate), both block 16, bf16 safetensors in DFlash format, made by
`recipes/smollm2/train_drafters/run.sh`. Wherever a drafter directory is expected, one of these names
selects the embedded checkpoint (a local directory of the same name wins)."""
import os
from typing import Dict

EMBEDDED_DRAFTERS: Dict[str, str] = {
    "dflash-k1": "K = 1 DFlash-style drafter trained with NLL",
    "dblast-k4": "K = 4 DBLast drafter trained with the accepted-length surrogate (tau 0.1)",
}
# the shipped weights sit at the package root (dblast_ext/drafters), where the wheel's package data lists them
_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "drafters", "smollm2-135m-instruct")


def embedded_drafter_dir(name: str) -> str:
    """The directory of an embedded drafter, by name."""
    if name not in EMBEDDED_DRAFTERS:
        raise ValueError(f"no embedded drafter {name!r}; the embedded ones are {sorted(EMBEDDED_DRAFTERS)}")
    return os.path.join(_ROOT, name)


def resolve_drafter(path: str) -> str:
    """A drafter argument to a directory: an embedded name unless a directory of that name exists.
    A bare name that is neither (a mistyped embedded name, most likely) is refused with the
    embedded names listed; a missing path is left to the caller's file check."""
    if path in EMBEDDED_DRAFTERS and not os.path.isdir(path):
        return embedded_drafter_dir(path)
    if not os.path.exists(path) and os.sep not in path and not (os.altsep and os.altsep in path):
        raise FileNotFoundError(f"no drafter {path!r}: neither a local directory nor an embedded drafter "
                                f"(embedded: {', '.join(sorted(EMBEDDED_DRAFTERS))})")
    return path
