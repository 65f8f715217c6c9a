"""The drafter family: the models that propose blocks, and everything about their files.

- `drafter`: `DBlastDrafter`, the block-diffusion drafter with K latent branches (DFlash
  checkpoints load as its K = 1 case); `dflash2`: the DFlash2 candidate selector;
- `drafter_io`: loading and saving drafters (DFlash / DFlash2 checkpoints as they are, ours, the
  embedded ones by name) and checking a drafter against its target; `embedded_drafters`: the
  drafters shipped in the wheel;
- `draft_vocabulary`: the token ids a drafter may propose;
- `proposer`: the interface the decode loop drafts through (`Proposer`, `Proposal`), and
  `DrafterProposer`, a drafter behind it.

May import: the package's face and shared vocabulary (the top-level modules) and `target`.
"""
from .drafter import DBlastDrafter, DrafterCache, DrafterConfig
from .drafter_io import load_drafter, save_pretrained

__all__ = ["DBlastDrafter", "DrafterCache", "DrafterConfig", "load_drafter", "save_pretrained"]
