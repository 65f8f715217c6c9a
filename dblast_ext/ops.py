"""Python entry points of the dblast ops (thin wrappers over torch.ops.dblast.*).

Each op has a fake (meta) implementation registered here, so that
torch.library.opcheck passes and torch.compile(fullgraph=True) can trace it; the fakes check
the arguments' ranks, shapes, dtypes and devices as the C++ bindings do, so tracing bad input
fails with the kernels' ValueError naming the argument. The user-facing contract of every op
is docs/ops.md.
Randomness comes from caller-supplied uniforms (when none are given, they are drawn from
`generator` on the logits' device); given the same uniforms, CPU and CUDA decide alike (a
uniform within rounding, ~1e-6, of an acceptance probability may go either way).
"""
import contextlib
import math
from typing import Iterator, Optional, Tuple

import torch

from .results import BranchArgmax, SampledTokens, VerifyResult, draw_uniforms
from .sampling import check_temperature, check_top_k, check_top_p

__all__ = ["branch_verify", "mixture_verify", "sparse_verify", "sample_tokens", "branch_argmax", "drafter_attention", "VerifyResult",
           "BranchArgmax", "SampledTokens", "CPU_ONLY_OPS", "cuda_kernels", "using_cuda_kernels", "cuda_kernel_for"]

# Ops with a CPU kernel only, not yet run on a GPU (no CUDA kernel lands untested): on CUDA
# tensors their wrapper runs the CPU kernel on host copies and returns the results on the
# device (exact, same checks, one round trip).
CPU_ONLY_OPS = ("sparse_verify",)

CUDA_KERNEL_VARIANTS = ("verified", "staged")


def cuda_kernels(variant: Optional[str] = None) -> str:
    """Which CUDA kernels serve the ops: "verified" (default: the ones that last passed on a
    GPU) or "staged" (written ahead of a device run; docs/ops.md lists both per op). Sets the
    variant when given and returns the one in force. The environment variable
    DBLAST_CUDA_KERNELS sets the starting value. CPU kernels are the same either way."""
    if variant is not None and variant not in CUDA_KERNEL_VARIANTS:
        raise ValueError(f"variant must be one of {CUDA_KERNEL_VARIANTS}, got {variant!r}")
    return torch.ops.dblast.cuda_kernels(variant)


@contextlib.contextmanager
def using_cuda_kernels(variant: str) -> Iterator[None]:
    """Runs the block with the CUDA kernels of `variant`, then restores the previous one."""
    previous = cuda_kernels()
    cuda_kernels(variant)
    try:
        yield
    finally:
        cuda_kernels(previous)


def cuda_kernel_for(op: str, device: Optional[torch.device] = None, *, capability: Optional[Tuple[int, int]] = None,
                    shared_per_block: Optional[int] = None, variant: Optional[str] = None) -> str:
    """Which CUDA kernel serves `op` (an op with a staged kernel, e.g. "branch_verify"): "staged",
    "verified", or "verified (...)" when a staged kernel was asked for but the device cannot run
    it (the reason in the brackets; the op then also warns once). Staged kernels are asked for
    by `variant` (default: the one in force, cuda_kernels()) or by a promotion. The device is
    `device` (default: the current CUDA device), or one of the given compute `capability` and
    opt-in shared memory per block in bytes, with no GPU needed. The rule itself is C++
    (dblast/kernel_variant.h), the one the CUDA launchers apply."""
    if capability is None or shared_per_block is None:
        properties = torch.cuda.get_device_properties(device)
        capability = capability if capability is not None else (properties.major, properties.minor)
        if shared_per_block is None:
            shared_per_block = properties.shared_memory_per_block_optin
    return torch.ops.dblast_rules.cuda_kernel_for(op, capability[0], capability[1], shared_per_block, variant)


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
    _check_wrapper_filter(temperature, top_k, top_p)
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
        draft_tokens: [N, b] int64, sampled from the mixture (see
            dblast_ext.reference.sample_mixture_draft).
        uniforms, temperature, top_k, top_p, generator, validate: as in branch_verify.

    With K = 1 this is standard speculative sampling.
    """
    _check_wrapper_filter(temperature, top_k, top_p)
    uniforms = draw_uniforms(target_logits, uniforms, generator)
    return VerifyResult(*torch.ops.dblast.mixture_verify(
        target_logits, draft_logits, branch_prior, draft_tokens, uniforms,
        float(temperature), int(top_k), float(top_p), float(draft_temperature), bool(validate)))


def sparse_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, proposal_tokens: torch.Tensor,
                  proposal_probs: torch.Tensor, uniforms: Optional[torch.Tensor] = None, *,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  generator: Optional[torch.Generator] = None, validate: bool = True) -> VerifyResult:
    """Verification of a sampled chain whose proposal at each position is sparse: C candidate
    ids and their probabilities (DFlash2's candidate selector at T > 0).

    Args:
        target_logits: [N, b+1, V] float32/bfloat16/float16 target logits on the draft.
        draft_tokens: [N, b] int64, the drafted chain.
        proposal_tokens: [N, b, C] int64, 1 <= C <= 64: the candidates q drew position i from
            (given the chain before it); an id may repeat, its probability is then the sum.
        proposal_probs: [N, b, C] float32, their probabilities (summing to 1 per position).
        uniforms, temperature, top_k, top_p, generator, validate: as in branch_verify.

    Accepts draft x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the
    final token is drawn from [p_i - q_i]+ renormalised, after b acceptances from p_{b+1}.
    Not yet run on a GPU (CPU_ONLY_OPS): CUDA inputs are verified by the CPU kernel.
    """
    _check_wrapper_filter(temperature, top_k, top_p)
    uniforms = draw_uniforms(target_logits, uniforms, generator)
    args = (target_logits, draft_tokens, proposal_tokens, proposal_probs, uniforms)
    scalars = (float(temperature), int(top_k), float(top_p), bool(validate))
    if target_logits.device.type == "cpu" or torch.compiler.is_compiling():
        return VerifyResult(*torch.ops.dblast.sparse_verify(*args, *scalars))
    _sparse_verify_fake(*args, *scalars)  # shapes and devices named before the copies
    outputs = torch.ops.dblast.sparse_verify(*(t.cpu() for t in args), *scalars)
    return VerifyResult(*(t.to(target_logits.device) for t in outputs))


def sample_tokens(logits: torch.Tensor, uniforms: Optional[torch.Tensor] = None, *, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, query_tokens: Optional[torch.Tensor] = None,
                  generator: Optional[torch.Generator] = None, validate: bool = True) -> SampledTokens:
    """Many rows' tokens from the target's filtered distribution, one launch: the verifiers'
    filter and inverse-CDF rule (docs/ops.md), plus the filtered probability of each row's
    query tokens from the same filter (trie verification: a node's draw and its children).

    Args:
        logits: [R, V] float32/bfloat16/float16, raw target logits.
        uniforms: [R] float32/float64 in [0, 1), row r's draw; drawn from `generator` when
            None. Ignored at T = 0 (the argmax, lowest id on ties).
        temperature, top_k, top_p: the target's sampling filter.
        query_tokens: [R, C] int64 token ids whose filtered probabilities to return, -1 for
            none; None: C = 0.
        validate: check the values (finite logits, uniforms in [0, 1), query ids in range)
            before the kernel runs.

    Returns SampledTokens(tokens [R] int64, query_probs [R, C] float32).
    """
    _check_wrapper_filter(temperature, top_k, top_p)
    if uniforms is None:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [R, V], got shape {tuple(logits.shape)}")
        uniforms = torch.rand(logits.shape[0], device=logits.device, dtype=torch.float64, generator=generator)
    if query_tokens is None:
        query_tokens = torch.empty(logits.shape[0] if logits.dim() else 0, 0, dtype=torch.int64,
                                   device=logits.device)
    return SampledTokens(*torch.ops.dblast.sample_tokens(logits, uniforms, float(temperature), int(top_k),
                                                         float(top_p), query_tokens, bool(validate)))


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


# --- fake (meta) implementations ----------------------------------------------------------------
#
# What torch.compile and FakeTensorMode run instead of the kernels: output shapes and dtypes
# from the inputs' metadata, after the same argument checks as the C++ bindings
# (csrc/checks/*.cpp), with the same ValueError naming the offending argument
# (torch._check_value is TORCH_CHECK_VALUE's Python twin; on symbolic sizes it adds a guard or
# a runtime assert instead of failing). The value checks (`validate`, context_lens in range)
# read data and so run in the kernels only.

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_BRANCHES = 64  # kMaxBranches, csrc/include/dblast/common.h
_CUDA_HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # kCudaHeadDims, csrc/include/dblast/attention_checks.h
_CUDA_MAX_ROW_HEAD_PAIRS = 65535  # one grid dimension of the CUDA attention launch


def _sizes(t: torch.Tensor) -> list:
    return list(t.shape)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_same_device(t: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str) -> None:
    torch._check_value(t.device == ref.device,
                       lambda: f"{name} must be on {ref.device} like {ref_name}, got {t.device}")


def _check_logits_dtype(t: torch.Tensor, name: str) -> None:
    torch._check_value(t.dtype in _LOGIT_DTYPES,
                       lambda: f"{name} must be float32, bfloat16 or float16, got {_dtype_name(t.dtype)}")


def _check_finite(value: float, condition: bool, message: str) -> None:
    # scalars reach a fake kernel as Python numbers (torch.compile specialises them)
    torch._check_value(math.isfinite(value) and condition, lambda: message)


def _check_target_logits(target_logits: torch.Tensor) -> None:
    _check_logits_dtype(target_logits, "target_logits")
    torch._check_value(target_logits.dim() == 3,
                       lambda: f"target_logits must be [N, b+1, V], got {_sizes(target_logits)}")
    torch._check_value(target_logits.size(1) >= 2,
                       lambda: "target_logits must cover at least one draft and the bonus position (b+1 >= 2), "
                               f"got {target_logits.size(1)}")
    torch._check_value(target_logits.size(2) >= 1,
                       lambda: f"target_logits must have a vocabulary of at least 1, got {target_logits.size(2)}")


def _check_prior(prior: torch.Tensor, rows, num_branches, target_logits: torch.Tensor) -> None:
    _check_same_device(prior, target_logits, "branch_prior", "target_logits")
    torch._check_value(prior.dtype == torch.float32,
                       lambda: f"branch_prior must be float32, got {_dtype_name(prior.dtype)}")
    torch._check_value(prior.dim() == 2 and prior.size(0) == rows and prior.size(1) == num_branches,
                       lambda: f"branch_prior must have shape [{rows}, {num_branches}] (K from the branch tensor), "
                               f"got {_sizes(prior)}")
    torch._check_value(1 <= num_branches and num_branches <= _MAX_BRANCHES,
                       lambda: f"the number of branches K must be in [1, {_MAX_BRANCHES}], got {num_branches}")


def _check_uniforms(uniforms: torch.Tensor, rows, num_draft, target_logits: torch.Tensor) -> None:
    _check_same_device(uniforms, target_logits, "uniforms", "target_logits")
    torch._check_value(uniforms.dtype in (torch.float32, torch.float64),
                       lambda: f"uniforms must be float32 or float64, got {_dtype_name(uniforms.dtype)}")
    torch._check_value(uniforms.dim() == 2 and uniforms.size(0) == rows and uniforms.size(1) == num_draft + 1,
                       lambda: f"uniforms must have shape [{rows}, {num_draft + 1}], got {_sizes(uniforms)}")


def _check_filter(temperature: float, top_k: int, top_p: float) -> None:
    # the sampling settings' one rule (dblast_ext.sampling; the C++ host checks repeat it)
    check_temperature(temperature)
    check_top_k(top_k)
    check_top_p(top_p)


def _check_wrapper_filter(temperature, top_k, top_p) -> None:
    """The wrappers' check, before int() / float() would turn a top_k of 2.5 into 2. Under
    torch.compile the scalars may be symbolic: the fake kernel checks them then, as traced."""
    if not torch.compiler.is_compiling():
        _check_filter(temperature, top_k, top_p)


def _verify_outputs(target_logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, positions = target_logits.shape[0], target_logits.shape[1]
    return (target_logits.new_empty((rows,), dtype=torch.int32),
            target_logits.new_empty((rows, positions), dtype=torch.int64),
            target_logits.new_empty((rows, positions - 1), dtype=torch.float32))


@torch.library.register_fake("dblast::branch_verify")
def _branch_verify_fake(target_logits, branch_tokens, branch_prior, branch, uniforms, temperature, top_k, top_p,
                        validate):
    _check_target_logits(target_logits)
    rows, num_draft = target_logits.size(0), target_logits.size(1) - 1
    _check_same_device(branch_tokens, target_logits, "branch_tokens", "target_logits")
    torch._check_value(branch_tokens.dtype == torch.int64,
                       lambda: f"branch_tokens must be int64, got {_dtype_name(branch_tokens.dtype)}")
    torch._check_value(branch_tokens.dim() == 3 and branch_tokens.size(0) == rows
                       and branch_tokens.size(2) == num_draft,
                       lambda: f"branch_tokens must have shape [{rows}, K, {num_draft}], got {_sizes(branch_tokens)}")
    _check_prior(branch_prior, rows, branch_tokens.size(1), target_logits)
    _check_same_device(branch, target_logits, "branch", "target_logits")
    torch._check_value(branch.dtype == torch.int64, lambda: f"branch must be int64, got {_dtype_name(branch.dtype)}")
    torch._check_value(branch.dim() == 1 and branch.size(0) == rows,
                       lambda: f"branch must have shape [{rows}], got {_sizes(branch)}")
    _check_uniforms(uniforms, rows, num_draft, target_logits)
    _check_filter(temperature, top_k, top_p)
    return _verify_outputs(target_logits)


@torch.library.register_fake("dblast::mixture_verify")
def _mixture_verify_fake(target_logits, draft_logits, branch_prior, draft_tokens, uniforms, temperature, top_k,
                         top_p, draft_temperature, validate):
    _check_target_logits(target_logits)
    rows, num_draft, vocab = target_logits.size(0), target_logits.size(1) - 1, target_logits.size(2)
    _check_same_device(draft_logits, target_logits, "draft_logits", "target_logits")
    _check_logits_dtype(draft_logits, "draft_logits")
    torch._check_value(draft_logits.dim() == 4 and draft_logits.size(0) == rows and draft_logits.size(2) == num_draft
                       and draft_logits.size(3) == vocab,
                       lambda: f"draft_logits must have shape [{rows}, K, {num_draft}, {vocab}], "
                               f"got {_sizes(draft_logits)}")
    _check_prior(branch_prior, rows, draft_logits.size(1), target_logits)
    _check_same_device(draft_tokens, target_logits, "draft_tokens", "target_logits")
    torch._check_value(draft_tokens.dtype == torch.int64,
                       lambda: f"draft_tokens must be int64, got {_dtype_name(draft_tokens.dtype)}")
    torch._check_value(draft_tokens.dim() == 2 and draft_tokens.size(0) == rows and draft_tokens.size(1) == num_draft,
                       lambda: f"draft_tokens must have shape [{rows}, {num_draft}], got {_sizes(draft_tokens)}")
    _check_uniforms(uniforms, rows, num_draft, target_logits)
    _check_filter(temperature, top_k, top_p)
    _check_finite(draft_temperature, draft_temperature > 0.0,
                  f"draft_temperature must be finite and > 0, got {draft_temperature}")
    return _verify_outputs(target_logits)


@torch.library.register_fake("dblast::sparse_verify")
def _sparse_verify_fake(target_logits, draft_tokens, proposal_tokens, proposal_probs, uniforms, temperature, top_k,
                        top_p, validate):
    _check_target_logits(target_logits)
    rows, num_draft = target_logits.size(0), target_logits.size(1) - 1
    _check_same_device(draft_tokens, target_logits, "draft_tokens", "target_logits")
    torch._check_value(draft_tokens.dtype == torch.int64,
                       lambda: f"draft_tokens must be int64, got {_dtype_name(draft_tokens.dtype)}")
    torch._check_value(draft_tokens.dim() == 2 and draft_tokens.size(0) == rows and draft_tokens.size(1) == num_draft,
                       lambda: f"draft_tokens must have shape [{rows}, {num_draft}], got {_sizes(draft_tokens)}")
    _check_same_device(proposal_tokens, target_logits, "proposal_tokens", "target_logits")
    torch._check_value(proposal_tokens.dtype == torch.int64,
                       lambda: f"proposal_tokens must be int64, got {_dtype_name(proposal_tokens.dtype)}")
    torch._check_value(proposal_tokens.dim() == 3 and proposal_tokens.size(0) == rows
                       and proposal_tokens.size(1) == num_draft,
                       lambda: f"proposal_tokens must have shape [{rows}, {num_draft}, C], got "
                               f"{_sizes(proposal_tokens)}")
    candidates = proposal_tokens.size(2)
    torch._check_value(1 <= candidates and candidates <= _MAX_BRANCHES,
                       lambda: f"the number of candidates C (proposal_tokens.shape[2]) must be in "
                               f"[1, {_MAX_BRANCHES}], got {candidates}")
    _check_same_device(proposal_probs, target_logits, "proposal_probs", "target_logits")
    torch._check_value(proposal_probs.dtype == torch.float32,
                       lambda: f"proposal_probs must be float32, got {_dtype_name(proposal_probs.dtype)}")
    torch._check_value(proposal_probs.shape == proposal_tokens.shape,
                       lambda: f"proposal_probs must have shape [{rows}, {num_draft}, {candidates}] like "
                               f"proposal_tokens, got {_sizes(proposal_probs)}")
    _check_uniforms(uniforms, rows, num_draft, target_logits)
    _check_filter(temperature, top_k, top_p)
    return _verify_outputs(target_logits)


@torch.library.register_fake("dblast::sample_tokens")
def _sample_tokens_fake(logits, uniforms, temperature, top_k, top_p, query_tokens, validate):
    _check_logits_dtype(logits, "logits")
    torch._check_value(logits.dim() == 2, lambda: f"logits must be [R, V], got {_sizes(logits)}")
    torch._check_value(logits.size(1) >= 1,
                       lambda: f"logits must have a vocabulary of at least 1, got {logits.size(1)}")
    rows = logits.size(0)
    _check_same_device(uniforms, logits, "uniforms", "logits")
    torch._check_value(uniforms.dtype in (torch.float32, torch.float64),
                       lambda: f"uniforms must be float32 or float64, got {_dtype_name(uniforms.dtype)}")
    torch._check_value(uniforms.dim() == 1 and uniforms.size(0) == rows,
                       lambda: f"uniforms must have shape [{rows}], got {_sizes(uniforms)}")
    _check_same_device(query_tokens, logits, "query_tokens", "logits")
    torch._check_value(query_tokens.dtype == torch.int64,
                       lambda: f"query_tokens must be int64, got {_dtype_name(query_tokens.dtype)}")
    torch._check_value(query_tokens.dim() == 2 and query_tokens.size(0) == rows,
                       lambda: f"query_tokens must have shape [{rows}, C], got {_sizes(query_tokens)}")
    _check_filter(temperature, top_k, top_p)
    return (logits.new_empty((rows,), dtype=torch.int64),
            logits.new_empty(tuple(query_tokens.shape), dtype=torch.float32))


@torch.library.register_fake("dblast::branch_argmax")
def _branch_argmax_fake(hidden, lm_head_weight, expander_weight, expander_bias, vocab_size, tile_bytes):
    torch._check_value(hidden.dim() == 2, lambda: f"hidden must be [N, H], got {_sizes(hidden)}")
    _check_logits_dtype(hidden, "hidden")
    rows, width = hidden.size(0), hidden.size(1)
    torch._check_value(width >= 1, lambda: f"hidden must have H >= 1, got {_sizes(hidden)}")
    torch._check_value(lm_head_weight.dim() == 2 and lm_head_weight.size(1) == width,
                       lambda: f"lm_head_weight must be [V, {width}] (H from hidden), got {_sizes(lm_head_weight)}")
    torch._check_value(lm_head_weight.dtype == hidden.dtype,
                       lambda: f"lm_head_weight must have hidden's dtype {_dtype_name(hidden.dtype)}, "
                               f"got {_dtype_name(lm_head_weight.dtype)}")
    _check_same_device(lm_head_weight, hidden, "lm_head_weight", "hidden")
    torch._check_value(1 <= vocab_size and vocab_size <= lm_head_weight.size(0),
                       lambda: f"vocab_size must be in [1, {lm_head_weight.size(0)}] (the LM head's rows), "
                               f"got {vocab_size}")
    torch._check_value((expander_weight is None) == (expander_bias is None),
                       lambda: "expander_weight and expander_bias must be given together")
    branches = 1
    if expander_weight is not None:
        torch._check_value(expander_weight.dim() == 2 and expander_weight.size(1) == width,
                           lambda: f"expander_weight must be [K*H, {width}], got {_sizes(expander_weight)}")
        outputs = expander_weight.size(0)
        torch._check_value(outputs % width == 0 and outputs >= width,
                           lambda: f"expander_weight rows must be a multiple K*H of H = {width}, got {outputs}")
        torch._check_value(expander_bias.dim() == 1 and expander_bias.size(0) == outputs,
                           lambda: f"expander_bias must be [{outputs}], got {_sizes(expander_bias)}")
        for t, name in ((expander_weight, "expander_weight"), (expander_bias, "expander_bias")):
            torch._check_value(t.dtype == hidden.dtype,
                               lambda: f"{name} must have hidden's dtype {_dtype_name(hidden.dtype)}, "
                                       f"got {_dtype_name(t.dtype)}")
            _check_same_device(t, hidden, name, "hidden")
        branches = outputs // width
    return (hidden.new_empty((rows, branches), dtype=torch.int64),
            hidden.new_empty((rows, branches), dtype=torch.float32),
            hidden.new_empty((rows, branches), dtype=torch.float32))


@torch.library.register_fake("dblast::drafter_attention")
def _drafter_attention_fake(q, k_cache, v_cache, k_block, v_block, context_lens, scale, window, causal):
    torch._check_value(q.dim() == 4, lambda: f"q must be [N, Hq, B, D], got {_sizes(q)}")
    _check_logits_dtype(q, "q")
    rows, heads, block, dim = q.size(0), q.size(1), q.size(2), q.size(3)
    torch._check_value(block >= 1 and dim >= 1, lambda: f"q must have B >= 1 and D >= 1, got {_sizes(q)}")
    torch._check_value(k_cache.dim() == 4 and k_cache.size(0) == rows and k_cache.size(3) == dim,
                       lambda: f"k_cache must be [{rows}, Hkv, L_max, {dim}], got {_sizes(k_cache)}")
    kv_heads = k_cache.size(1)
    torch._check_value(kv_heads >= 1 and heads % kv_heads == 0,
                       lambda: f"q's heads ({heads}) must be a multiple of k_cache's heads ({kv_heads})")
    torch._check_value(v_cache.shape == k_cache.shape,
                       lambda: f"v_cache must have k_cache's shape {_sizes(k_cache)}, got {_sizes(v_cache)}")
    block_shape = [rows, kv_heads, block, dim]
    for t, name in ((k_block, "k_block"), (v_block, "v_block")):
        torch._check_value(t.dim() == 4 and _sizes(t) == block_shape,
                           lambda: f"{name} must be {block_shape}, got {_sizes(t)}")
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache"), (k_block, "k_block"), (v_block, "v_block")):
        torch._check_value(t.dtype == q.dtype,
                           lambda: f"{name} must have q's dtype {_dtype_name(q.dtype)}, got {_dtype_name(t.dtype)}")
        torch._check_value(t.device == q.device, lambda: f"{name} must be on {q.device} like q, got {t.device}")
    torch._check_value(context_lens.dim() == 1 and context_lens.size(0) == rows,
                       lambda: f"context_lens must be [{rows}], got {_sizes(context_lens)}")
    torch._check_value(context_lens.dtype == torch.int32,
                       lambda: f"context_lens must be int32, got {_dtype_name(context_lens.dtype)}")
    torch._check_value(context_lens.device == q.device,
                       lambda: f"context_lens must be on {q.device}, got {context_lens.device}")
    _check_finite(scale, scale > 0, f"scale must be finite and > 0, got {scale}")
    torch._check_value(window == -1 or window > 0, lambda: f"window must be -1 (off) or > 0, got {window}")
    if q.device.type == "cuda":  # the CUDA binding's launch limits (csrc/checks/attention_checks.cpp)
        torch._check_value(dim in _CUDA_HEAD_DIMS,
                           lambda: f"q's head dim D must be one of {', '.join(map(str, _CUDA_HEAD_DIMS))} on CUDA, "
                                   f"got {dim}")
        torch._check_value(rows * kv_heads <= _CUDA_MAX_ROW_HEAD_PAIRS,
                           lambda: f"q's N ({rows}) x k_cache's KV heads ({kv_heads}) = {rows * kv_heads} exceeds "
                                   f"the 65,535 one CUDA launch takes; split the batch")
    return q.new_empty(q.shape)  # contiguous, like both kernels' output (q itself may be strided)
