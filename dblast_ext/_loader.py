"""Loads the compiled op library and checks it was built against the running torch."""
import json
import functools

import torch

REBUILD_COMMAND = "pip install --no-build-isolation --force-reinstall --no-deps ."


def load_extension() -> None:
    try:
        from . import _C  # noqa: F401  (registers torch.ops.dblast.*)
    except (ImportError, OSError) as exc:
        raise ImportError(
            f"dblast_ext's compiled library could not be loaded ({exc}). It is missing or was built "
            f"against another torch than the installed {torch.__version__}; rebuild it from the "
            f"source tree with: {REBUILD_COMMAND}"
        ) from exc
    built = build_info()["torch_version"]
    if built != torch.__version__:
        raise ImportError(
            f"dblast_ext was built against torch {built} but torch {torch.__version__} is installed; "
            f"rebuild it from the source tree with: {REBUILD_COMMAND}"
        )


@functools.lru_cache(maxsize=None)
def build_info() -> dict:
    """Facts fixed when the extension was built.

    Returns a dict with ``cuda_compiled`` (bool), ``cuda_archs`` (str, e.g. "9.0") and
    ``torch_version`` (the torch the library was compiled against).
    """
    return json.loads(torch.ops.dblast.build_info())
