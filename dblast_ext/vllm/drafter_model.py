"""A DBLast drafter as a vLLM model: vLLM's DFlash draft model plus the K-branch head.

vLLM's DFlash proposer runs the drafter once per step on [anchor, mask x b] for every request
(request-major, 1 + b query tokens each), then asks `compute_logits` (or `get_top_tokens`) for
the greedy token at the b mask positions. This class adds one thing to each call:

- `forward`: after the DFlash layers, reads the prior head at every request's anchor position
  and chooses that request's branch z (`branch_choice.choose_branches`), kept in a static
  buffer so the step can be captured in a CUDA graph;
- `compute_logits` / `get_top_tokens`: replace each mask position's state h by branch z's
  state h + W_z h + b_z (DBLast Eq 13) before vLLM's own LM head.

Everything else (context K/V from the target's hidden states, the shared embedding and LM head,
the KV cache, batching, the rejection sampler) is vLLM's. Importing this module imports vLLM;
`dblast_ext.vllm.register` names it lazily.
"""
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

from .branch_choice import anchor_uniforms, choose_branches, chosen_branch_states, settings_from_env

_HEAD = ("branch_expander.", "prior_head.")


class DBlastDFlashForCausalLM(DFlashQwen3ForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = self.config
        dblast = getattr(config, "dblast_config", None) or {}
        dflash = getattr(config, "dflash_config", None) or {}
        self.num_branches = int(dblast.get("num_branches", 1))
        if self.num_branches < 2:
            raise ValueError(f"drafter {vllm_config.speculative_config.model}: architecture DFlashDBLastDraftModel "
                             f"needs dblast_config.num_branches >= 2, got {self.num_branches} (a K = 1 drafter "
                             f"is plain DFlash: architecture DFlashDraftModel)")
        scale = float(dflash.get("input_embedding_scale", getattr(config, "input_embedding_scale", 1.0)))
        if scale != 1.0:
            raise ValueError(f"drafter input_embedding_scale = {scale}: vLLM's DFlash model embeds the block "
                             f"unscaled, so this drafter would run with other inputs than it was trained on")
        spec = vllm_config.speculative_config
        if getattr(spec, "num_speculative_tokens_per_batch_size", None):
            raise ValueError("num_speculative_tokens_per_batch_size is not supported with a DBLast drafter: its "
                             "branch choice reads each request's anchor at a fixed stride of "
                             "1 + num_speculative_tokens query tokens")
        self.queries_per_request = 1 + spec.num_speculative_tokens
        self.category_temperature, self.branch_seed = settings_from_env()

        hidden, dtype = config.hidden_size, vllm_config.model_config.dtype
        self.branch_expander = nn.Linear(hidden, self.num_branches * hidden, bias=True, dtype=dtype)
        self.prior_head = nn.Linear(hidden, self.num_branches, bias=True, dtype=dtype)
        for p in (*self.branch_expander.parameters(), *self.prior_head.parameters()):
            p.requires_grad_(False)
        # one chosen branch per request of the step, at a fixed address (CUDA graphs replay into it)
        compilation = vllm_config.compilation_config
        most_queries = max(vllm_config.scheduler_config.max_num_batched_tokens,
                           vllm_config.scheduler_config.max_num_seqs * self.queries_per_request,
                           getattr(compilation, "max_cudagraph_capture_size", None) or 0)
        self.register_buffer("chosen_branch", torch.zeros(most_queries // self.queries_per_request + 1,
                                                          dtype=torch.int64), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = super().forward(input_ids, positions, inputs_embeds)
        step = self.queries_per_request
        requests = hidden.shape[0] // step
        if requests:
            anchors = slice(0, requests * step, step)  # each request's first query token
            logits = self.prior_head(hidden[anchors]).float()
            uniforms = (anchor_uniforms(self.branch_seed, positions[anchors], input_ids[anchors])
                        if self.category_temperature > 0 else None)
            self.chosen_branch[:requests].copy_(choose_branches(logits, self.category_temperature, uniforms))
        return hidden

    def _branch_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The mask positions' states [requests * b, H] -> their chosen branch's states."""
        drafts = self.queries_per_request - 1
        rows = hidden_states.shape[0]
        if rows % drafts:
            raise ValueError(f"DBLast drafter: {rows} draft states are not {drafts} per request")
        branch = self.chosen_branch[: rows // drafts].repeat_interleave(drafts)
        return chosen_branch_states(hidden_states, branch, self.branch_expander.weight,
                                    self.branch_expander.bias)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return super().compute_logits(self._branch_states(hidden_states))

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().get_top_tokens(self._branch_states(hidden_states))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        head = {}

        def dflash_weights():
            for name, tensor in weights:
                if name.startswith(_HEAD):
                    head[name] = tensor
                else:
                    yield name, tensor

        super().load_weights(dflash_weights())
        expected = {f"{m}{p}" for m in _HEAD for p in ("weight", "bias")}
        if set(head) != expected:
            raise ValueError(f"DBLast drafter checkpoint: branch head tensors {sorted(head)}, expected "
                             f"{sorted(expected)}")
        for name, tensor in head.items():
            module, param = name.split(".")
            target = getattr(getattr(self, module), param)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"DBLast drafter checkpoint: {name} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(target.shape)} for K = {self.num_branches}")
            target.data.copy_(tensor.to(target.dtype))
