"""Loads the compiled op library and checks it was built against the running torch."""
import functools
import json
import os

import torch

REBUILD_COMMAND = "pip install --no-build-isolation --force-reinstall --no-deps ."


def load_extension() -> None:
    try:
        from . import _C  # noqa: F401  (registers torch.ops.dblast.*)
    except (ImportError, OSError) as exc:
        package_dir = os.path.dirname(os.path.abspath(__file__))
        hint = ""
        if os.path.exists(os.path.join(package_dir, os.pardir, "setup.py")):
            hint = (" (this is the source tree: import the installed package from another directory, "
                    "or build in place with `pip install --no-build-isolation -e .`)")
        raise ImportError(
            f"dblast_ext's compiled library could not be loaded ({exc}){hint}. It is missing or was built "
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
