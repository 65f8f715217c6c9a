"""Python entry points of the dblast ops (thin wrappers over torch.ops.dblast.*).

Each op has a fake (meta) implementation registered here, so that
torch.library.opcheck passes and torch.compile(fullgraph=True) can trace it.
Randomness comes from caller-supplied uniforms (when none are given, they are drawn from
`generator` on the logits' device); given the same uniforms, CPU and CUDA decide alike (a
uniform within rounding, ~1e-6, of an acceptance probability may go either way).
"""
from typing import Optional, Tuple

import torch

from .results import BranchArgmax, VerifyResult, draw_uniforms

__all__ = ["branch_verify", "mixture_verify", "sample_mixture_draft", "branch_argmax", "drafter_attention",
           "VerifyResult", "BranchArgmax"]


def branch_verify(target_logits: torch.Tensor, branch_tokens: torch.Tensor, branch_prior: torch.Tensor,
                  branch: torch.Tensor, uniforms: Optional[torch.Tensor] = None, *, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, generator: Optional[torch.Generator] = None,
                  validate: bool = True) -> VerifyResult:
    """Greedy-branch speculative verification (DBLast Eq 18-21, Algorithm 1), one launch.

    Args:
        target_logits: [N, b+1, V] float32/bfloat16/float16, the target's raw logits at the
            b drafted positions and the bonus position, computed on the selected draft.
        branch_tokens: [N, K, b] int64, greedy token of every branch at every position.
        branch_prior: [N, K] float32, the tempered category distribution (rows sum to 1).
        branch: [N] int64, the sampled category; the draft is branch_tokens[n, branch[n]].
        uniforms: [N, b+1] float32/float64 in [0, 1); column i < b decides position i+1
            (accept iff u < A), column b draws the final token by inverse CDF. Drawn from
            `generator` when None.
        temperature, top_k, top_p: the target's sampling filter (T=0 is greedy).
        validate: check the values (finite logits, token ranges, prior, uniforms) before
            the kernel runs; costs one device sync on CUDA.

    Returns:
        VerifyResult(num_accepted [N] int32, output_tokens [N, b+1] int64,
        accept_probs [N, b] float32).
    """
    uniforms = draw_uniforms(target_logits, uniforms, generator)
    return VerifyResult(*torch.ops.dblast.branch_verify(
        target_logits, branch_tokens, branch_prior, branch, uniforms,
        float(temperature), int(top_k), float(top_p), bool(validate)))


def mixture_verify(target_logits: torch.Tensor, draft_logits: torch.Tensor, branch_prior: torch.Tensor,
                   draft_tokens: torch.Tensor, uniforms: Optional[torch.Tensor] = None, *,
                   temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   draft_temperature: float = 1.0, generator: Optional[torch.Generator] = None,
                   validate: bool = True) -> VerifyResult:
    """Soft-mixture speculative verification with the category posterior update (DBLast Eq 5, 10-12).

    Args:
        target_logits: [N, b+1, V] float32/bfloat16/float16 target logits on the draft.
        draft_logits: [N, K, b, V] branch logits; q_i(. | z) = softmax(draft_logits[:, z, i] / draft_temperature).
        branch_prior: [N, K] float32 category distribution.
        draft_tokens: [N, b] int64, sampled from the mixture (see sample_mixture_draft).
        uniforms, temperature, top_k, top_p, generator, validate: as in branch_verify.

    With K = 1 this is standard speculative sampling.
    """
    uniforms = draw_uniforms(target_logits, uniforms, generator)
    return VerifyResult(*torch.ops.dblast.mixture_verify(
        target_logits, draft_logits, branch_prior, draft_tokens, uniforms,
        float(temperature), int(top_k), float(top_p), float(draft_temperature), bool(validate)))


def sample_mixture_draft(draft_logits: torch.Tensor, branch_prior: torch.Tensor, *, draft_temperature: float = 1.0,
                         generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Draws a block from the soft mixture: z ~ prior, then every position from branch z.

    Returns (draft_tokens [N, b] int64, branch [N] int64).
    """
    from .reference import sample_mixture_draft as _sample  # plain PyTorch: no kernel needed

    return _sample(draft_logits, branch_prior, draft_temperature=draft_temperature, generator=generator)


def branch_argmax(hidden: torch.Tensor, lm_head_weight: torch.Tensor, expander_weight: Optional[torch.Tensor] = None,
                  expander_bias: Optional[torch.Tensor] = None, *, vocab_size: Optional[int] = None,
                  tile_bytes: int = 0) -> BranchArgmax:
    """Fused K-branch expansion + LM-head argmax (DBLast Eq 13).

    Args:
        hidden: [N, H] float32/bfloat16/float16, the drafter's normed hidden states.
        lm_head_weight: [V_padded, H], the target's LM head (same dtype as hidden).
        expander_weight: [K*H, H] and expander_bias: [K*H] in nn.Linear(H, K*H) layout; branch
            z's state is h + W_z h + b_z with W_z = expander_weight[z*H:(z+1)*H]. None: K = 1, h_1 = h.
        vocab_size: rows of the LM head that are real tokens (default: all); padding rows
            never win and never enter the logsumexp.
        tile_bytes: CPU only: byte budget of one vocabulary tile (logits plus any float32
            weight copy); 0 picks 1/16 of the full logits tensor.

    Returns BranchArgmax(tokens int64, max_logits float32, logsumexp float32), each [N, K].
    Accumulation is in float32 whatever the input dtype.
    """
    vocab = lm_head_weight.shape[0] if vocab_size is None else int(vocab_size)
    return BranchArgmax(*torch.ops.dblast.branch_argmax(hidden, lm_head_weight, expander_weight, expander_bias,
                                                        vocab, int(tile_bytes)))


def drafter_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_block: torch.Tensor,
                      v_block: torch.Tensor, context_lens: torch.Tensor, *, scale: Optional[float] = None,
                      window: int = -1, causal: bool = False) -> torch.Tensor:
    """Block-diffusion drafter attention: the block's queries attend to the row's cached
    context keys and to the block's own keys (DFlash: both directions, no mask).

    Args:
        q: [N, Hq, B, D] block queries (already rotated), float32/bfloat16/float16.
        k_cache, v_cache: [N, Hkv, L_max, D] cached context keys/values (rotated), valid up to
            context_lens[n]. Hq must be a multiple of Hkv (grouped-query attention).
        k_block, v_block: [N, Hkv, B, D] the block's own keys/values.
        context_lens: [N] int32, cached tokens per row (0 allowed).
        scale: softmax scale, default D ** -0.5.
        window: > 0, a sliding-window layer: a query sees only keys less than `window`
            positions away (counting itself, as DFlash does; the block sits at positions
            context_lens[n] + i); -1 every key.
        causal: block query i sees block keys j <= i only (DFlash's sliding layers, or a layer
            with `is_causal`); the context stays visible either way.

    Returns [N, Hq, B, D] in q's dtype; softmax and accumulation in float32.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.dblast.drafter_attention(q, k_cache, v_cache, k_block, v_block, context_lens, scale, int(window),
                                              bool(causal))


def _verify_fake(target_logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, positions = target_logits.shape[0], target_logits.shape[1]
    return (target_logits.new_empty((rows,), dtype=torch.int32),
            target_logits.new_empty((rows, positions), dtype=torch.int64),
            target_logits.new_empty((rows, positions - 1), dtype=torch.float32))


@torch.library.register_fake("dblast::branch_verify")
def _branch_verify_fake(target_logits, branch_tokens, branch_prior, branch, uniforms, temperature, top_k, top_p,
                        validate):
    return _verify_fake(target_logits)


@torch.library.register_fake("dblast::mixture_verify")
def _mixture_verify_fake(target_logits, draft_logits, branch_prior, draft_tokens, uniforms, temperature, top_k,
                         top_p, draft_temperature, validate):
    return _verify_fake(target_logits)


@torch.library.register_fake("dblast::branch_argmax")
def _branch_argmax_fake(hidden, lm_head_weight, expander_weight, expander_bias, vocab_size, tile_bytes):
    rows, width = hidden.shape
    branches = 1 if expander_weight is None else expander_weight.shape[0] // width
    return (hidden.new_empty((rows, branches), dtype=torch.int64),
            hidden.new_empty((rows, branches), dtype=torch.float32),
            hidden.new_empty((rows, branches), dtype=torch.float32))


@torch.library.register_fake("dblast::drafter_attention")
def _drafter_attention_fake(q, k_cache, v_cache, k_block, v_block, context_lens, scale, window, causal):
    return q.new_empty(q.shape)  # contiguous, like both kernels' output (q itself may be strided)
