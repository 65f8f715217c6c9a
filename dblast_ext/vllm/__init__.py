"""DBLast drafters in vLLM, through vLLM's plugin system (no fork).

vLLM calls `register` in every process it starts (entry point `vllm.general_plugins`, name
`dblast`); it adds the architecture `DFlashDBLastDraftModel`, which `save_pretrained` writes for
drafters with K > 1 branches, as a subclass of vLLM's DFlash draft model. K = 1 drafters are
written as `DFlashDraftModel` and run on vLLM's own class. Serve with vLLM's DFlash method:

    vllm serve TARGET --speculative-config '{"method": "dflash", "model": DRAFTER,
                                             "num_speculative_tokens": 15}'

(`dblast serve` builds that line). Importing this package does not import vLLM.
`serving_schedule` measures the batch-size schedule the plugin drafts by.

May import: the package's face and shared vocabulary (the top-level modules), `target`,
`drafting` and `decoding`.
"""
from ..drafting.drafter_io import DBLAST_ARCHITECTURE as ARCHITECTURE

_MODEL = "dblast_ext.vllm.drafter_model:DBlastDFlashForCausalLM"


def register() -> None:
    """Registers the DBLast drafter architecture with vLLM's model registry (idempotent; the
    class is imported only when vLLM builds a model of that architecture), and on vLLM's CPU
    backend mends its fallback of the rejection sampler's expand kernel where it loses floats
    (cpu_expand_fix: without it no draft is accepted at temperature > 0)."""
    from vllm import ModelRegistry

    from . import cpu_expand_fix

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, _MODEL)
    cpu_expand_fix.apply()
