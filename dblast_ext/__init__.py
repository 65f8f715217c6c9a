"""dblast_ext: stochastic speculative decoding with dependent block drafters.

Importing the package loads the compiled op library (`dblast_ext._C`), which registers
the `torch.ops.dblast.*` ops; `dblast_ext.ops` holds their Python wrappers and
`dblast_ext.reference` their pure-PyTorch specification.
"""
from ._loader import build_info, load_extension

load_extension()

from . import ops, reference  # noqa: E402  (ops need the library loaded first)
from .results import BranchArgmax, VerifyResult  # noqa: E402
from .drafting.drafter import DBlastDrafter, DrafterCache, DrafterConfig  # noqa: E402
from .drafting.drafter_io import load_drafter, save_pretrained  # noqa: E402

__all__ = ["build_info", "ops", "reference", "BranchArgmax", "VerifyResult", "DBlastDrafter", "DrafterCache",
           "DrafterConfig", "load_drafter", "save_pretrained"]
__version__ = "0.1.0"
