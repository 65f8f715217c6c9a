"""The ops under torch.compile and FakeTensorMode.

The fake (meta) implementations in dblast_ext/ops.py are what torch.compile traces instead of
the kernels: they must give the kernels' output shapes, dtypes and devices, and refuse the
arguments the C++ bindings refuse (csrc/checks/*.cpp) with the same ValueError naming the
argument. Compiled calls (aot_eager and inductor, fullgraph) must return what the eager op
returns.
"""
import os
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dblast_ext import ops


# --- inputs ------------------------------------------------------------------------------------

def _gen(seed):
    return torch.Generator().manual_seed(seed)


def branch_verify_case(seed=0, rows=3, branches=4, num_draft=5, vocab=40, dtype=torch.float32):
    g = _gen(seed)
    logits = torch.randn(rows, num_draft + 1, vocab, generator=g) * 2.0
    tokens = torch.randint(0, vocab, (rows, branches, num_draft), generator=g)
    tokens[:, 0] = logits[:, :num_draft].argmax(-1)  # a branch the target likes: some drafts pass
    prior = torch.softmax(torch.randn(rows, branches, generator=g), -1)
    branch = torch.multinomial(prior, 1, generator=g).squeeze(-1)
    uniforms = torch.rand(rows, num_draft + 1, generator=g, dtype=torch.float64)
    return dict(target_logits=logits.to(dtype), branch_tokens=tokens, branch_prior=prior, branch=branch,
                uniforms=uniforms, temperature=0.8, top_k=20, top_p=0.95, validate=True)


def mixture_verify_case(seed=0, rows=3, branches=3, num_draft=4, vocab=30, dtype=torch.float32):
    g = _gen(seed)
    logits = torch.randn(rows, num_draft + 1, vocab, generator=g) * 2.0
    draft_logits = 0.7 * logits[:, None, :num_draft] + torch.randn(rows, branches, num_draft, vocab, generator=g)
    prior = torch.softmax(torch.randn(rows, branches, generator=g), -1)
    tokens = torch.randint(0, vocab, (rows, num_draft), generator=g)
    tokens[:, :2] = draft_logits[:, 0, :2].argmax(-1)
    uniforms = torch.rand(rows, num_draft + 1, generator=g, dtype=torch.float64)
    return dict(target_logits=logits.to(dtype), draft_logits=draft_logits.to(dtype), branch_prior=prior,
                draft_tokens=tokens, uniforms=uniforms, temperature=1.0, top_k=0, top_p=0.9,
                draft_temperature=0.8, validate=True)


def sparse_verify_case(seed=0, rows=3, num_draft=4, vocab=30, candidates=5, dtype=torch.float32):
    g = _gen(seed)
    logits = torch.randn(rows, num_draft + 1, vocab, generator=g) * 2.0
    scores, tokens = (logits[:, :num_draft] + torch.randn(rows, num_draft, vocab, generator=g)).topk(candidates, -1)
    probs = scores.softmax(-1)
    draft = tokens[:, :, 0].clone()
    uniforms = torch.rand(rows, num_draft + 1, generator=g, dtype=torch.float64)
    return dict(target_logits=logits.to(dtype), draft_tokens=draft, proposal_tokens=tokens, proposal_probs=probs,
                uniforms=uniforms, temperature=0.9, top_k=20, top_p=0.95, validate=True)


def sample_tokens_case(seed=0, rows=5, vocab=40, queries=3, dtype=torch.float32):
    g = _gen(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2.0
    query = torch.randint(-1, vocab, (rows, queries), generator=g)
    uniforms = torch.rand(rows, generator=g, dtype=torch.float64)
    return dict(logits=logits.to(dtype), uniforms=uniforms, temperature=0.8, top_k=20, top_p=0.95,
                query_tokens=query, validate=True)


def branch_argmax_case(seed=0, rows=3, branches=2, width=16, vocab=100, padded=4, dtype=torch.float32):
    g = _gen(seed)
    case = dict(hidden=torch.randn(rows, width, generator=g).to(dtype),
                lm_head_weight=(torch.randn(vocab + padded, width, generator=g) / width**0.5).to(dtype),
                expander_weight=None, expander_bias=None, vocab_size=vocab, tile_bytes=0)
    if branches > 1:
        case["expander_weight"] = (torch.randn(branches * width, width, generator=g) * 0.1).to(dtype)
        case["expander_bias"] = (torch.randn(branches * width, generator=g) * 0.1).to(dtype)
    return case


def drafter_attention_case(seed=0, rows=2, kv_heads=2, group=2, block=4, dim=16, max_len=10, dtype=torch.float32):
    g = _gen(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return dict(q=rand(rows, kv_heads * group, block, dim), k_cache=rand(rows, kv_heads, max_len, dim),
                v_cache=rand(rows, kv_heads, max_len, dim), k_block=rand(rows, kv_heads, block, dim),
                v_block=rand(rows, kv_heads, block, dim),
                context_lens=torch.randint(1, max_len + 1, (rows,), generator=g, dtype=torch.int32),
                scale=dim**-0.5, window=-1, causal=False)


# Schema order of every op's arguments, to call torch.ops.dblast.* positionally.
SCHEMA = {
    "branch_verify": ["target_logits", "branch_tokens", "branch_prior", "branch", "uniforms", "temperature", "top_k",
                      "top_p", "validate"],
    "mixture_verify": ["target_logits", "draft_logits", "branch_prior", "draft_tokens", "uniforms", "temperature",
                       "top_k", "top_p", "draft_temperature", "validate"],
    "sparse_verify": ["target_logits", "draft_tokens", "proposal_tokens", "proposal_probs", "uniforms", "temperature",
                      "top_k", "top_p", "validate"],
    "sample_tokens": ["logits", "uniforms", "temperature", "top_k", "top_p", "query_tokens", "validate"],
    "branch_argmax": ["hidden", "lm_head_weight", "expander_weight", "expander_bias", "vocab_size", "tile_bytes"],
    "drafter_attention": ["q", "k_cache", "v_cache", "k_block", "v_block", "context_lens", "scale", "window",
                          "causal"],
}
CASES = {"branch_verify": branch_verify_case, "mixture_verify": mixture_verify_case, "sparse_verify": sparse_verify_case,
         "sample_tokens": sample_tokens_case, "branch_argmax": branch_argmax_case, "drafter_attention": drafter_attention_case}


def skip_without_kernel(name, device):
    """CPU_ONLY_OPS have no CUDA kernel to compare a fake with (their wrapper runs the reference)."""
    if name in ops.CPU_ONLY_OPS and torch.device(device).type != "cpu":
        pytest.skip(f"{name} has no CUDA kernel yet (dblast_ext.ops.CPU_ONLY_OPS)")


def call_op(name, case):
    out = getattr(torch.ops.dblast, name)(*(case[k] for k in SCHEMA[name]))
    return out if isinstance(out, tuple) else (out,)


def to_device(case, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def fake_case(mode, case, device=None):
    """Fake copies of the case's tensors, on `device` when given, which may be a device this
    machine lacks (fake tensors hold no data). Call inside `mode`."""
    def fake(t):
        if device is None:
            return mode.from_tensor(t)
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    return {k: (fake(v) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def call_fake(name, case, device=None):
    with FakeTensorMode() as mode:
        return call_op(name, fake_case(mode, case, device))


# --- fake kernels: good input --------------------------------------------------------------------

GOOD = [
    ("branch_verify", dict()),
    ("branch_verify", dict(branches=1, num_draft=1, dtype=torch.bfloat16)),
    ("branch_verify", dict(branches=64, dtype=torch.float16)),
    ("branch_verify", dict(rows=0)),
    ("mixture_verify", dict()),
    ("mixture_verify", dict(branches=1, num_draft=7, dtype=torch.bfloat16)),
    ("mixture_verify", dict(rows=0, dtype=torch.float16)),
    ("sparse_verify", dict()),
    ("sparse_verify", dict(num_draft=1, candidates=1, dtype=torch.bfloat16)),
    ("sparse_verify", dict(rows=0, dtype=torch.float16)),
    ("sample_tokens", dict()),
    ("sample_tokens", dict(queries=0, dtype=torch.bfloat16)),
    ("sample_tokens", dict(rows=0, dtype=torch.float16)),
    ("branch_argmax", dict()),
    ("branch_argmax", dict(branches=1, dtype=torch.bfloat16)),
    ("branch_argmax", dict(branches=5, padded=0, dtype=torch.float16)),
    ("branch_argmax", dict(rows=0)),
    ("drafter_attention", dict()),
    ("drafter_attention", dict(kv_heads=1, group=4, block=1, dtype=torch.bfloat16)),
    ("drafter_attention", dict(group=1, dim=32, dtype=torch.float16)),
]


@pytest.mark.parametrize("name,settings", GOOD, ids=[f"{i}-{n}" for i, (n, _) in enumerate(GOOD)])
def test_fake_outputs_match_the_kernels_outputs(device, name, settings):
    skip_without_kernel(name, device)
    case = to_device(CASES[name](**settings), device)
    if name == "drafter_attention":  # q as the drafter passes it: heads and positions transposed
        case["q"] = case["q"].transpose(1, 2).contiguous().transpose(1, 2)
    real = call_op(name, case)
    fake = call_fake(name, case)
    assert len(fake) == len(real)
    for f, r in zip(fake, real):
        assert (f.shape, f.dtype, f.device) == (r.shape, r.dtype, r.device)
        assert f.stride() == r.stride()


@pytest.mark.parametrize("name", list(CASES))
def test_fake_outputs_follow_the_inputs_device(name):
    """Fake CUDA inputs give fake CUDA outputs (no GPU needed: fake tensors hold no data)."""
    outputs = call_fake(name, CASES[name](), device="cuda")
    assert all(t.device.type == "cuda" for t in outputs)


# --- fake kernels: bad input ---------------------------------------------------------------------
# Each entry: (op, regex the message must match, mutation of the op's good case). The regex
# names the argument; every mutation is one the C++ argument checks refuse.

def _set(**changes):
    def mutate(case):
        return dict(case, **{k: (fn(case[k]) if callable(fn) else fn) for k, fn in changes.items()})
    return mutate


BAD = [
    # branch_verify: N = 3, K = 4, b = 5, V = 40
    ("branch_verify", "target_logits", _set(target_logits=lambda t: t[0])),
    ("branch_verify", "target_logits", _set(target_logits=lambda t: t.double())),
    ("branch_verify", "target_logits", _set(target_logits=lambda t: t.to(torch.int32))),
    ("branch_verify", "target_logits", _set(target_logits=lambda t: t[:, :1])),
    ("branch_verify", "target_logits", _set(target_logits=lambda t: t[:, :, :0])),
    ("branch_verify", "branch_tokens", _set(branch_tokens=lambda t: t[:, :, :4])),
    ("branch_verify", "branch_tokens", _set(branch_tokens=lambda t: t[:2])),
    ("branch_verify", "branch_tokens", _set(branch_tokens=lambda t: t[:, 0])),
    ("branch_verify", "branch_tokens", _set(branch_tokens=lambda t: t.int())),
    ("branch_verify", "branch_prior", _set(branch_prior=lambda t: t[:, :3])),
    ("branch_verify", "branch_prior", _set(branch_prior=lambda t: t[:2])),
    ("branch_verify", "branch_prior", _set(branch_prior=lambda t: t[0])),
    ("branch_verify", "branch_prior", _set(branch_prior=lambda t: t.double())),
    ("branch_verify", "number of branches K", lambda c: branch_verify_case(branches=65)),
    ("branch_verify", "branch must", _set(branch=lambda t: t[:2])),
    ("branch_verify", "branch must", _set(branch=lambda t: t[:, None])),
    ("branch_verify", "branch must", _set(branch=lambda t: t.int())),
    ("branch_verify", "uniforms", _set(uniforms=lambda t: t[:, :5])),
    ("branch_verify", "uniforms", _set(uniforms=lambda t: t[:2])),
    ("branch_verify", "uniforms", _set(uniforms=lambda t: t.half())),
    ("branch_verify", "temperature", _set(temperature=-1.0)),
    ("branch_verify", "temperature", _set(temperature=float("inf"))),
    ("branch_verify", "top_p", _set(top_p=0.0)),
    ("branch_verify", "top_p", _set(top_p=float("nan"))),
    # mixture_verify: N = 3, K = 3, b = 4, V = 30
    ("mixture_verify", "target_logits", _set(target_logits=lambda t: t[0])),
    ("mixture_verify", "target_logits", _set(target_logits=lambda t: t.double())),
    ("mixture_verify", "draft_logits", _set(draft_logits=lambda t: t[..., :29])),
    ("mixture_verify", "draft_logits", _set(draft_logits=lambda t: t[:, :, :3])),
    ("mixture_verify", "draft_logits", _set(draft_logits=lambda t: t[:2])),
    ("mixture_verify", "draft_logits", _set(draft_logits=lambda t: t[:, 0])),
    ("mixture_verify", "draft_logits", _set(draft_logits=lambda t: t.double())),
    ("mixture_verify", "branch_prior", _set(branch_prior=lambda t: t[:, :2])),
    ("mixture_verify", "branch_prior", _set(branch_prior=lambda t: t.half())),
    ("mixture_verify", "draft_tokens", _set(draft_tokens=lambda t: t[:, :3])),
    ("mixture_verify", "draft_tokens", _set(draft_tokens=lambda t: t[:2])),
    ("mixture_verify", "draft_tokens", _set(draft_tokens=lambda t: t.int())),
    ("mixture_verify", "uniforms", _set(uniforms=lambda t: t[:, :3])),
    ("mixture_verify", "uniforms", _set(uniforms=lambda t: t.to(torch.bfloat16))),
    ("mixture_verify", "temperature", _set(temperature=-0.5)),
    ("mixture_verify", "top_p", _set(top_p=-1.0)),
    ("mixture_verify", "draft_temperature", _set(draft_temperature=0.0)),
    ("mixture_verify", "draft_temperature", _set(draft_temperature=float("nan"))),
    # sparse_verify: N = 3, b = 4, V = 30, C = 5
    ("sparse_verify", "target_logits", _set(target_logits=lambda t: t[0])),
    ("sparse_verify", "target_logits", _set(target_logits=lambda t: t.double())),
    ("sparse_verify", "draft_tokens", _set(draft_tokens=lambda t: t[:, :3])),
    ("sparse_verify", "draft_tokens", _set(draft_tokens=lambda t: t.int())),
    ("sparse_verify", "proposal_tokens", _set(proposal_tokens=lambda t: t[:, :3])),
    ("sparse_verify", "proposal_tokens", _set(proposal_tokens=lambda t: t[..., 0])),
    ("sparse_verify", "proposal_tokens", _set(proposal_tokens=lambda t: t.int())),
    ("sparse_verify", "number of candidates C",
     _set(proposal_tokens=lambda t: t[..., :0], proposal_probs=lambda t: t[..., :0])),
    ("sparse_verify", "proposal_probs", _set(proposal_probs=lambda t: t[..., :4])),
    ("sparse_verify", "proposal_probs", _set(proposal_probs=lambda t: t.double())),
    ("sparse_verify", "uniforms", _set(uniforms=lambda t: t[:, :4])),
    ("sparse_verify", "top_p", _set(top_p=1.5)),
    # sample_tokens: R = 5, V = 40, C = 3
    ("sample_tokens", "logits", _set(logits=lambda t: t[0])),
    ("sample_tokens", "logits", _set(logits=lambda t: t.double())),
    ("sample_tokens", "logits", _set(logits=lambda t: t[:, :0])),
    ("sample_tokens", "uniforms", _set(uniforms=lambda t: t[:4])),
    ("sample_tokens", "uniforms", _set(uniforms=lambda t: t[:, None])),
    ("sample_tokens", "uniforms", _set(uniforms=lambda t: t.half())),
    ("sample_tokens", "query_tokens", _set(query_tokens=lambda t: t[0])),
    ("sample_tokens", "query_tokens", _set(query_tokens=lambda t: t[:4])),
    ("sample_tokens", "query_tokens", _set(query_tokens=lambda t: t.int())),
    ("sample_tokens", "temperature", _set(temperature=-1.0)),
    ("sample_tokens", "top_p", _set(top_p=0.0)),
    # branch_argmax: N = 3, H = 16, K = 2, 104 head rows of which 100 real
    ("branch_argmax", "hidden", _set(hidden=lambda t: t[0])),
    ("branch_argmax", "hidden", _set(hidden=lambda t: t.double())),
    ("branch_argmax", "hidden", _set(hidden=lambda t: t[:, :0])),
    ("branch_argmax", "lm_head_weight", _set(lm_head_weight=lambda t: t[:, :10])),
    ("branch_argmax", "lm_head_weight", _set(lm_head_weight=lambda t: t[None])),
    ("branch_argmax", "lm_head_weight", _set(lm_head_weight=lambda t: t.half())),
    ("branch_argmax", "vocab_size", _set(vocab_size=0)),
    ("branch_argmax", "vocab_size", _set(vocab_size=105)),
    ("branch_argmax", "given together", _set(expander_bias=None)),
    ("branch_argmax", "given together", _set(expander_weight=None)),
    ("branch_argmax", "expander_weight", _set(expander_weight=lambda t: t[:-1])),
    ("branch_argmax", "expander_weight", _set(expander_weight=lambda t: t[:8])),
    ("branch_argmax", "expander_weight", _set(expander_weight=lambda t: t[:, :10])),
    ("branch_argmax", "expander_weight", _set(expander_weight=lambda t: t.bfloat16())),
    ("branch_argmax", "expander_bias", _set(expander_bias=lambda t: t[:-1])),
    ("branch_argmax", "expander_bias", _set(expander_bias=lambda t: t[None])),
    ("branch_argmax", "expander_bias", _set(expander_bias=lambda t: t.half())),
    # drafter_attention: N = 2, Hq = 4, Hkv = 2, B = 4, D = 16, L_max = 10
    ("drafter_attention", "q must", _set(q=lambda t: t[0])),
    ("drafter_attention", "q must", _set(q=lambda t: t.double())),
    ("drafter_attention", "q must", _set(q=lambda t: t[:, :, :0])),
    ("drafter_attention", "q's heads .* multiple", _set(q=lambda t: t[:, :3])),
    ("drafter_attention", "k_cache", _set(k_cache=lambda t: t[:1])),
    ("drafter_attention", "k_cache", _set(k_cache=lambda t: t[..., :8])),
    ("drafter_attention", "k_cache", _set(k_cache=lambda t: t.half())),
    ("drafter_attention", "v_cache", _set(v_cache=lambda t: t[:, :, :9])),
    ("drafter_attention", "v_cache", _set(v_cache=lambda t: t.bfloat16())),
    ("drafter_attention", "k_block", _set(k_block=lambda t: t[:, :, :3])),
    ("drafter_attention", "k_block", _set(k_block=lambda t: t[:, :1])),
    ("drafter_attention", "v_block", _set(v_block=lambda t: t[..., :8])),
    ("drafter_attention", "v_block", _set(v_block=lambda t: t.half())),
    ("drafter_attention", "context_lens", _set(context_lens=lambda t: t.long())),
    ("drafter_attention", "context_lens", _set(context_lens=lambda t: t[:1])),
    ("drafter_attention", "context_lens", _set(context_lens=lambda t: t[None])),
    ("drafter_attention", "scale", _set(scale=-1.0)),
    ("drafter_attention", "scale", _set(scale=float("nan"))),
    ("drafter_attention", "window", _set(window=0)),
    ("drafter_attention", "window", _set(window=-2)),
]
BAD_IDS = [f"{i}-{op}-{pattern.split()[0]}" for i, (op, pattern, _) in enumerate(BAD)]


@pytest.mark.parametrize("name,pattern,mutate", BAD, ids=BAD_IDS)
def test_fake_refuses_what_the_kernel_refuses(device, name, pattern, mutate):
    """Each bad input: the kernel and the fake both raise a ValueError naming the argument."""
    skip_without_kernel(name, device)
    case = to_device(mutate(CASES[name]()), device)
    with pytest.raises(ValueError, match=pattern):
        call_op(name, case)
    with pytest.raises(ValueError, match=pattern):
        call_fake(name, case)


@pytest.mark.parametrize("name,tensor_name", [
    ("branch_verify", "branch_tokens"), ("branch_verify", "branch_prior"), ("branch_verify", "branch"),
    ("branch_verify", "uniforms"), ("mixture_verify", "draft_logits"), ("mixture_verify", "branch_prior"),
    ("mixture_verify", "draft_tokens"), ("mixture_verify", "uniforms"), ("branch_argmax", "lm_head_weight"),
    ("branch_argmax", "expander_weight"), ("branch_argmax", "expander_bias"), ("drafter_attention", "k_cache"),
    ("drafter_attention", "v_cache"), ("drafter_attention", "k_block"), ("drafter_attention", "v_block"),
    ("drafter_attention", "context_lens"), ("sample_tokens", "uniforms"), ("sample_tokens", "query_tokens"),
    ("sparse_verify", "draft_tokens"), ("sparse_verify", "proposal_tokens"), ("sparse_verify", "proposal_probs"),
    ("sparse_verify", "uniforms"),
])
def test_fake_refuses_mixed_devices(name, tensor_name):
    """All inputs on (fake) CUDA but one on the CPU: refused naming that one, as the kernels do."""
    case = CASES[name]()
    with FakeTensorMode() as mode:
        fake = fake_case(mode, case, device="cuda")
        fake[tensor_name] = fake_case(mode, {"t": case[tensor_name]}, device="cpu")["t"]
        with pytest.raises(ValueError, match=f"{tensor_name} must be on cuda"):
            call_op(name, fake)


def test_fake_limits_are_the_kernels():
    """The constants the fake checks copy from the C++ headers have not drifted."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def header(name):
        with open(os.path.join(root, "csrc", "include", "dblast", name)) as f:
            return f.read()

    assert int(re.search(r"kMaxBranches = (\d+);", header("common.h")).group(1)) == ops._MAX_BRANCHES
    dims = re.search(r"kCudaHeadDims = std::to_array<int64_t>\(\{([\d, ]+)\}\)", header("attention_checks.h"))
    assert tuple(int(d) for d in dims.group(1).split(",")) == ops._CUDA_HEAD_DIMS


def test_fake_refuses_a_head_dim_the_cuda_kernel_lacks():
    case = drafter_attention_case(dim=48)
    call_fake("drafter_attention", case)  # the CPU kernel takes any D
    with pytest.raises(ValueError, match="q's head dim D must be one of 16, 32, 64, 96, 128, 256 on CUDA, got 48"):
        call_fake("drafter_attention", case, device="cuda")


def test_fake_refuses_more_row_heads_than_one_cuda_launch_takes():
    case = drafter_attention_case(rows=32768, kv_heads=2, group=1, block=1, dim=16, max_len=1)
    with pytest.raises(ValueError, match="exceeds the 65,535 one CUDA launch takes"):
        call_fake("drafter_attention", case, device="cuda")


# --- torch.compile -------------------------------------------------------------------------------
# Each compiled function moves its inputs into the layouts the decode loop hands the ops (a
# vocabulary slice of padded logits, transposed attention heads) with views and exact casts
# only, so that the compiled and the eager call hand the op the same values.

def _verify_fn(name):
    op = getattr(ops, name)

    def fn(padded_logits, vocab, second, prior, tokens, uniforms, **kwargs):
        return tuple(op(padded_logits[..., :vocab], second, prior, tokens, uniforms, **kwargs))

    return fn


def _sample_tokens_fn(padded_logits, vocab, uniforms, query_tokens, **kwargs):
    # validate=False: on CUDA the wrapper checks values on the host, which a full graph cannot
    return tuple(ops.sample_tokens(padded_logits[:, :vocab], uniforms, query_tokens=query_tokens, validate=False,
                                   **kwargs))


def _branch_argmax_fn(hidden, lm_head_weight, expander_weight, expander_bias, vocab_size):
    return tuple(ops.branch_argmax(hidden, lm_head_weight, expander_weight, expander_bias, vocab_size=vocab_size))


def _drafter_attention_fn(q_by_position, k_cache, v_cache, k_block_by_position, v_block_by_position, context_lens):
    # [N, B, H, D] projections, as the drafter computes them, seen as [N, H, B, D]
    return (ops.drafter_attention(q_by_position.transpose(1, 2), k_cache, v_cache, k_block_by_position.transpose(1, 2),
                                  v_block_by_position.transpose(1, 2), context_lens, window=3, causal=True),)


def _pad_vocab(logits, seed):
    pad = torch.randn(*logits.shape[:-1], 7, generator=_gen(seed)).to(logits.dtype)
    return torch.cat([logits, pad], dim=-1)


def compile_inputs(name, seed, rows=6, dtype=torch.float32):
    """(function, args, kwargs) of one compiled call on fresh random inputs, the floating ones
    (but the prior and the uniforms) in `dtype`."""
    if name == "branch_verify":
        c = branch_verify_case(seed=seed, rows=rows, vocab=64, dtype=dtype)
        args = (_pad_vocab(c["target_logits"], seed), 64, c["branch_tokens"], c["branch_prior"], c["branch"],
                c["uniforms"])
        return _verify_fn(name), args, dict(temperature=0.8, top_k=20, top_p=0.95)
    if name == "mixture_verify":
        c = mixture_verify_case(seed=seed, rows=rows, vocab=48, dtype=dtype)
        args = (_pad_vocab(c["target_logits"], seed), 48, c["draft_logits"], c["branch_prior"], c["draft_tokens"],
                c["uniforms"])
        return _verify_fn(name), args, dict(temperature=1.0, top_p=0.9, draft_temperature=0.8)
    if name == "sample_tokens":
        c = sample_tokens_case(seed=seed, rows=rows, vocab=64, dtype=dtype)
        return _sample_tokens_fn, (_pad_vocab(c["logits"], seed), 64, c["uniforms"], c["query_tokens"]), \
            dict(temperature=0.8, top_k=20, top_p=0.95)
    if name == "branch_argmax":
        c = branch_argmax_case(seed=seed, rows=rows, branches=4, width=32, vocab=290, padded=10, dtype=dtype)
        args = (c["hidden"], c["lm_head_weight"], c["expander_weight"], c["expander_bias"], 290)
        return _branch_argmax_fn, args, {}
    c = drafter_attention_case(seed=seed, rows=rows, kv_heads=2, group=4, block=8, dim=64, max_len=40, dtype=dtype)
    args = (c["q"].transpose(1, 2).contiguous(), c["k_cache"], c["v_cache"], c["k_block"].transpose(1, 2).contiguous(),
            c["v_block"].transpose(1, 2).contiguous(), c["context_lens"])
    return _drafter_attention_fn, args, {}


def _device_args(args, device):
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _upcasting(fn):
    """fn on its bfloat16 arguments cast to float32 first (exact): under inductor, a generated
    kernel then writes the buffers the op reads."""
    def upcast_then_call(*args, **kwargs):
        return fn(*(a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in args),
                  **kwargs)

    return upcast_then_call


def assert_compiled_matches_eager(name, device, upcast=False, **compile_kwargs):
    torch._dynamo.reset()
    dtype = torch.bfloat16 if upcast else torch.float32
    fn, _, kwargs = compile_inputs(name, 0)
    fn = _upcasting(fn) if upcast else fn
    compiled = torch.compile(fn, fullgraph=True, **compile_kwargs)
    for seed in (1, 2):  # the second call reuses the compiled graph on other values
        _, args, _ = compile_inputs(name, seed, dtype=dtype)
        args = _device_args(args, device)
        eager = fn(*args, **kwargs)
        traced = compiled(*args, **kwargs)
        assert len(eager) == len(traced)
        for e, t in zip(eager, traced):
            assert t.dtype == e.dtype and t.shape == e.shape
            assert torch.equal(e, t), (name, seed)
        assert any(e.float().abs().sum() > 0 for e in eager)  # the inputs gave an answer, not zeros


@pytest.mark.parametrize("name", list(CASES))
def test_aot_eager_compiled_op_matches_eager(device, name):
    assert_compiled_matches_eager(name, device, backend="aot_eager")


@pytest.mark.parametrize("name", list(CASES))
def test_inductor_compiled_op_matches_eager(device, name):
    """The op's inputs are views of the graph's inputs: inductor generates no kernel of its own
    (a second or two to compile)."""
    assert_compiled_matches_eager(name, device, backend="inductor")


@pytest.mark.parametrize("name", list(CASES))
def test_inductor_kernel_feeding_the_op_matches_eager(device, name):
    """bfloat16 inputs cast to float32 inside the compiled function: the op reads buffers that
    an inductor-generated kernel (C++ on the CPU, Triton on CUDA) wrote, and inductor checks
    the op's output strides against the fake's (2-8 s each on two cores with a cold cache)."""
    assert_compiled_matches_eager(name, device, upcast=True, backend="inductor")


@pytest.mark.parametrize("name", list(CASES))
def test_dynamic_shapes_compiled_op_matches_eager(device, name):
    """dynamic=True: the fake kernels' checks run on symbolic sizes (guards, not failures), and
    one graph serves two batch sizes."""
    torch._dynamo.reset()
    fn, _, kwargs = compile_inputs(name, 0)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)
    for seed, rows in ((3, 5), (4, 9)):
        _, args, _ = compile_inputs(name, seed, rows=rows)
        args = _device_args(args, device)
        for e, t in zip(fn(*args, **kwargs), compiled(*args, **kwargs)):
            assert torch.equal(e, t), (name, rows)


@pytest.mark.parametrize("name,pattern", [("branch_verify", "branch_tokens"), ("mixture_verify", "draft_tokens"),
                                          ("sample_tokens", "query_tokens"),
                                          ("branch_argmax", "expander_bias"), ("drafter_attention", "k_block")])
def test_compiling_a_call_with_bad_input_names_the_argument(name, pattern):
    """torch.compile traces the fake kernel, so a bad call fails at compile time, naming the argument."""
    torch._dynamo.reset()
    mutate = next(m for op, p, m in BAD if op == name and p == pattern)
    case = mutate(CASES[name]())
    compiled = torch.compile(lambda c: call_op(name, c), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=pattern):
        compiled(case)
