"""dblast::mixture_verify against its specification (dblast_ext.reference.mixture_verify)."""
import functools
import itertools

import numpy as np
import pytest
import torch

from dblast_ext import ops, reference
from losslessness import assert_committed_tokens_follow_p, chi_square_pvalue, exact_joint
from verify_cases import FilterSettings, assert_verify_close, decision_margins, make_mixture_case, to_device

FILTERS = [FilterSettings(t, k, p) for t, k, p in itertools.product([0.0, 0.7, 1.0, 1.5], [0, 1, 20], [0.8, 0.95, 1.0])]


def reference_outcome(case: dict, settings: FilterSettings, draft_temperature: float = 1.0):
    """The float64 reference's result and, per row, how far its decisions are from flipping."""
    expected = reference.mixture_verify(**case, **settings.kwargs(), draft_temperature=draft_temperature)
    p = reference.filter_target_probs(case["target_logits"], **settings.kwargs())
    proposals = reference.mixture_proposal(case["draft_logits"], case["branch_prior"], case["draft_tokens"],
                                           draft_temperature)
    return expected, decision_margins(p, case["draft_tokens"], proposals, case["uniforms"])


def check_against_reference(case: dict, settings: FilterSettings, device, draft_temperature: float = 1.0,
                            outcome=None):
    kwargs = dict(settings.kwargs(), draft_temperature=draft_temperature)
    result = ops.mixture_verify(**to_device(case, device), **kwargs)
    expected, margins = outcome if outcome is not None else reference_outcome(case, settings, draft_temperature)
    assert_verify_close(result, expected, margins)
    return result


@pytest.mark.parametrize("num_draft,num_branches", list(itertools.product([1, 7, 15, 23], [1, 2, 4, 8])))
def test_matches_reference_across_block_and_branch_counts(device, num_draft, num_branches):
    seed = num_draft * 100 + num_branches
    settings = FILTERS[seed % len(FILTERS)]
    dtype = [torch.float32, torch.bfloat16][seed % 2]
    case = make_mixture_case(16, num_branches, num_draft, 300, settings, torch.Generator().manual_seed(seed), dtype)
    check_against_reference(case, settings, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("settings", FILTERS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_matches_reference_across_filters(device, settings, dtype):
    case = make_mixture_case(16, 4, 7, 500, settings, torch.Generator().manual_seed(8), dtype)
    check_against_reference(case, settings, device)


@pytest.mark.parametrize("vocab,settings,draft_temperature", [
    (17, FilterSettings(1.0, 0, 1.0), 1.0),
    (17, FilterSettings(0.7, 5, 0.9), 0.5),
    (151936, FilterSettings(1.0, 20, 0.95), 1.0),
    (151936, FilterSettings(1.0, 0, 0.8), 1.3),
])
def test_matches_reference_across_vocab_sizes(device, vocab, settings, draft_temperature):
    rows = 32 if vocab < 1000 else 2
    case = make_mixture_case(rows, 4, 7, vocab, settings, torch.Generator().manual_seed(vocab), torch.bfloat16,
                             draft_temperature=draft_temperature)
    check_against_reference(case, settings, device, draft_temperature)


@pytest.mark.parametrize("logits_dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("uniforms_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_branches,temperature", list(itertools.product([1, 4], [0.0, 0.7])))
def test_matches_reference_across_dtypes(device, logits_dtype, uniforms_dtype, num_branches, temperature):
    """Every target-logits x uniforms dtype (each its own kernel instantiation), K = 1 and K > 1,
    greedy and sampled."""
    settings = FilterSettings(temperature, 20, 0.9)
    case = make_mixture_case(16, num_branches, 7, 400, settings, torch.Generator().manual_seed(num_branches))
    case["target_logits"] = case["target_logits"].to(logits_dtype)
    case["uniforms"] = case["uniforms"].to(uniforms_dtype)
    check_against_reference(case, settings, device)


SPLIT_CASES = [  # (vocab, settings, dtype): the staged kernels cut these target rows over 8 blocks
    (151936, FilterSettings(0.0, 0, 1.0), torch.bfloat16),
    (151936, FilterSettings(0.7, 20, 0.9), torch.bfloat16),
    (49152, FilterSettings(1.0, 0, 0.95), torch.float32),
    (49152, FilterSettings(0.7, 50, 0.8), torch.bfloat16),
]


@functools.lru_cache(maxsize=None)
def split_case(index: int):
    """SPLIT_CASES[index]'s inputs and reference outcome, computed once for every device."""
    vocab, settings, dtype = SPLIT_CASES[index]
    case = make_mixture_case(4, 4, 3, vocab, settings, torch.Generator().manual_seed(vocab + 3), dtype,
                             draft_temperature=0.8)
    return case, reference_outcome(case, settings, 0.8)


@pytest.mark.parametrize("vocab,settings,dtype", SPLIT_CASES,
                         ids=[f"V{v}-T{s.temperature}-k{s.top_k}-p{s.top_p}" for v, s, _ in SPLIT_CASES])
def test_real_vocabularies_match_the_reference(device, vocab, settings, dtype):
    """Real vocabularies: the staged kernels reduce every branch row in 4,096-token chunks and
    split every target row over a cluster of blocks; 4 rows x 4 positions put the draws in
    every part of the row."""
    case, outcome = split_case(SPLIT_CASES.index((vocab, settings, dtype)))
    check_against_reference(case, settings, device, draft_temperature=0.8, outcome=outcome)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("variant", ["verified", "staged"])
def test_cuda_graph_replay_matches_eager_calls(variant):
    """validate=False never waits for the host: the op (both launches of the staged kernels)
    is captured in a CUDA graph, and replays on new inputs copied into the captured tensors
    give the eager results."""
    settings = FilterSettings(0.8, 20, 0.95)
    kwargs = dict(settings.kwargs(), draft_temperature=0.9)
    cases = [to_device(make_mixture_case(2, 4, 7, 49152, settings, torch.Generator().manual_seed(seed),
                                         torch.bfloat16, draft_temperature=0.9), "cuda") for seed in (41, 42)]
    with ops.using_cuda_kernels(variant):
        static = {k: v.clone() for k, v in cases[0].items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs asks
            ops.mixture_verify(**static, **kwargs, validate=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ops.mixture_verify(**static, **kwargs, validate=False)
        for case in (cases[1], cases[0]):
            for key, value in case.items():
                static[key].copy_(value)
            graph.replay()
            eager = ops.mixture_verify(**case, **kwargs, validate=False)
            for a, b in zip(captured, eager):
                assert torch.equal(a, b)


def test_skipping_validation_changes_nothing_on_valid_input(device):
    settings = FilterSettings(1.0, 20, 0.95)
    case = to_device(make_mixture_case(16, 4, 7, 300, settings, torch.Generator().manual_seed(22)), device)
    checked = ops.mixture_verify(**case, **settings.kwargs())
    unchecked = ops.mixture_verify(**case, **settings.kwargs(), validate=False)
    for a, b in zip(checked, unchecked):
        assert torch.equal(a, b)


@pytest.mark.parametrize("settings", [FilterSettings(1.0, 0, 1.0), FilterSettings(0.8, 5, 0.9)],
                         ids=["plain", "top-k-top-p"])
def test_every_committed_position_follows_the_target(device, settings):
    """Fixed branch logit tables and prior, each row's block drawn from the soft mixture as the
    decode loop would: each committed token follows the target's filtered distribution at
    its position, whatever was drafted before it."""
    g = torch.Generator().manual_seed(32)
    rows, vocab, num_draft, branches = 60000, 8, 3, 3
    logits = torch.randn(num_draft + 1, vocab, generator=g) * 2.0
    p = reference.filter_target_probs(logits, **settings.kwargs())
    draft_logits = 0.8 * logits[None, :num_draft] + torch.randn(branches, num_draft, vocab, generator=g)
    prior = torch.tensor([0.5, 0.3, 0.2])
    case = dict(target_logits=logits.expand(rows, -1, -1).contiguous(),
                draft_logits=draft_logits.expand(rows, -1, -1, -1).contiguous(),
                branch_prior=prior.expand(rows, -1).contiguous())
    case["draft_tokens"], _ = reference.sample_mixture_draft(case["draft_logits"], case["branch_prior"], generator=g)
    case["uniforms"] = torch.rand(rows, num_draft + 1, generator=g, dtype=torch.float64)
    result = ops.mixture_verify(**to_device(case, device), **settings.kwargs())
    assert (result.num_accepted.cpu() == num_draft).float().mean() > 0.05  # deep positions reached
    assert_committed_tokens_follow_p(p, result.num_accepted, result.output_tokens)


def test_mixed_logit_dtypes(device):
    settings = FilterSettings(0.9, 0, 0.95)
    case = make_mixture_case(16, 4, 7, 200, settings, torch.Generator().manual_seed(4))
    case["draft_logits"] = case["draft_logits"].half()
    check_against_reference(case, settings, device)


def test_single_branch_is_standard_speculative_sampling(device):
    # K = 1: accept with min(1, p/q), residual [p - q]+ (Leviathan et al.)
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(32, 5, 40, generator=g)
    draft_logits = torch.randn(32, 1, 4, 40, generator=g)
    tokens = torch.randint(0, 40, (32, 4), generator=g)
    uniforms = torch.rand(32, 5, generator=g, dtype=torch.float64)
    result = ops.mixture_verify(logits.to(device), draft_logits.to(device), torch.ones(32, 1).to(device),
                                tokens.to(device), uniforms.to(device))
    p_all, q_all = logits.double().softmax(-1), draft_logits[:, 0].double().softmax(-1)
    p = p_all[:, :4].gather(-1, tokens[..., None]).squeeze(-1)
    q = q_all.gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(result.accept_probs.cpu(), (p / q).clamp(max=1).float(), atol=1e-6, rtol=0)
    # a rejection's correction: [p - q]+ renormalised, by inverse CDF on the row's last uniform
    k = result.num_accepted.cpu().long()
    corrections = result.output_tokens.cpu()[torch.arange(32), k]
    rejected = (k < 4).nonzero().flatten().tolist()
    assert rejected
    for n in rejected:
        residual = (p_all[n, k[n]] - q_all[n, k[n]]).clamp(min=0)
        want = reference.inverse_cdf_sample((residual / residual.sum())[None], uniforms[n, 4:5])[0]
        assert int(corrections[n]) == int(want), n


SAMPLES = 60_000
STAT_FILTERS = [FilterSettings(1.0, 0, 1.0), FilterSettings(0.7, 6, 0.9), FilterSettings(0.0, 0, 1.0)]


def small_mixture_problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 4, 17, generator=g) * 1.5
    draft_logits = 0.8 * logits[:, None, :3] + torch.randn(1, 3, 3, 17, generator=g) * 1.5
    prior = torch.tensor([[0.5, 0.3, 0.2]])
    return logits, draft_logits, prior


@pytest.mark.parametrize("settings", STAT_FILTERS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_first_emitted_token_follows_filtered_target(device, settings):
    logits, draft_logits, prior = small_mixture_problem(41)
    g = torch.Generator().manual_seed(42)
    draft_logits = draft_logits.expand(SAMPLES, -1, -1, -1).contiguous()
    prior = prior.expand(SAMPLES, -1).contiguous()
    draft_tokens, _ = reference.sample_mixture_draft(draft_logits, prior, generator=g)
    uniforms = torch.rand(SAMPLES, 4, generator=g, dtype=torch.float64)
    result = ops.mixture_verify(logits.expand(SAMPLES, -1, -1).contiguous().to(device), draft_logits.to(device),
                                prior.to(device), draft_tokens.to(device), uniforms.to(device), **settings.kwargs())
    first = result.output_tokens[:, 0].cpu().numpy()
    p1 = reference.filter_target_probs(logits[0, 0], **settings.kwargs()).numpy()
    observed = np.bincount(first, minlength=17)
    assert observed[p1 == 0].sum() == 0, "emitted a token the filtered target excludes"
    assert chi_square_pvalue(observed, p1 * SAMPLES) > 1e-3


@pytest.mark.parametrize("settings", STAT_FILTERS[:2], ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_joint_of_accepted_count_and_final_token_given_draft(device, settings):
    logits, draft_logits, prior = small_mixture_problem(51)
    p = reference.filter_target_probs(logits[0], **settings.kwargs())
    draft = draft_logits[0].argmax(-1)[1]  # a plausible fixed draft: branch 1's modes
    log_q = draft_logits[0].double().log_softmax(-1)  # [K, b, V]

    def q_at(i):  # Eq 11-12 written out: posterior after x_<i, mixing the branch conditionals
        log_w = prior[0].double().log() + sum(log_q[:, j, draft[j]] for j in range(i)) if i else prior[0].double().log()
        w = (log_w - log_w.max()).exp()
        w = w / w.sum()
        return (w[:, None] * log_q[:, i].exp()).sum(0)

    joint = exact_joint(p, draft, q_at)
    g = torch.Generator().manual_seed(52)
    uniforms = torch.rand(SAMPLES, 4, generator=g, dtype=torch.float64)
    result = ops.mixture_verify(logits.expand(SAMPLES, -1, -1).contiguous().to(device),
                                draft_logits.expand(SAMPLES, -1, -1, -1).contiguous().to(device),
                                prior.expand(SAMPLES, -1).contiguous().to(device),
                                draft.expand(SAMPLES, -1).contiguous().to(device), uniforms.to(device),
                                **settings.kwargs())
    k = result.num_accepted.cpu().long()
    final = result.output_tokens.cpu()[torch.arange(SAMPLES), k]
    observed = np.bincount((k * 17 + final).numpy(), minlength=4 * 17).reshape(4, 17)
    assert observed[joint == 0].sum() == 0
    assert chi_square_pvalue(observed.ravel(), joint.ravel() * SAMPLES) > 1e-3


def test_sample_mixture_draft_follows_the_mixture():
    g = torch.Generator().manual_seed(61)
    draft_logits = torch.randn(1, 3, 2, 5, generator=g).expand(SAMPLES, -1, -1, -1)
    prior = torch.tensor([[0.6, 0.3, 0.1]]).expand(SAMPLES, -1)
    tokens, branch = reference.sample_mixture_draft(draft_logits, prior, draft_temperature=0.8, generator=g)
    q = (draft_logits[0].double() / 0.8).softmax(-1)  # [K, b, V]
    joint = (prior[0].double()[:, None, None] * q[:, 0, :, None] * q[:, 1, None, :]).sum(0)  # Eq 5, b = 2
    observed = np.bincount((tokens[:, 0] * 5 + tokens[:, 1]).numpy(), minlength=25)
    assert chi_square_pvalue(observed, joint.ravel().numpy() * SAMPLES) > 1e-3
    assert chi_square_pvalue(np.bincount(branch.numpy(), minlength=3), np.array([0.6, 0.3, 0.1]) * SAMPLES) > 1e-3


# --- bad input --------------------------------------------------------------------------------

def _base_case():
    return make_mixture_case(4, 3, 5, 40, FilterSettings(), torch.Generator().manual_seed(0))


def _with(**changes):
    def build():
        case = _base_case()
        for key, fn in changes.items():
            case[key] = fn(case[key])
        return case
    return build


BAD_INPUTS = [
    ("target_logits", _with(target_logits=lambda t: t.index_fill(2, torch.tensor([0]), float("nan")))),
    ("draft_logits", _with(draft_logits=lambda t: t[..., :39])),
    ("draft_logits", _with(draft_logits=lambda t: t[:, :, :4])),
    ("draft_logits", _with(draft_logits=lambda t: t.double())),
    ("draft_logits", _with(draft_logits=lambda t: t.index_fill(3, torch.tensor([0]), float("-inf")))),
    ("branch_prior", _with(branch_prior=lambda t: t[:, :2])),
    ("branch_prior", _with(branch_prior=lambda t: t * 0.5)),
    ("draft_tokens", _with(draft_tokens=lambda t: t.fill_(40))),
    ("draft_tokens", _with(draft_tokens=lambda t: t[:, :4])),
    ("uniforms", _with(uniforms=lambda t: t.fill_(1.5))),
    ("uniforms", _with(uniforms=lambda t: t[:, :3])),
    ("uniforms", _with(uniforms=lambda t: t.half())),
    ("target_logits", _with(target_logits=lambda t: t.double())),
    ("target_logits", _with(target_logits=lambda t: t[0])),
    ("branch_prior", _with(branch_prior=lambda t: t.double())),
    ("branch_prior", _with(branch_prior=lambda t: t - t.amax(-1, keepdim=True))),  # negative entries
    ("draft_tokens", _with(draft_tokens=lambda t: t.int())),
    ("draft_tokens", _with(draft_tokens=lambda t: t.fill_(-1))),
]


@pytest.mark.parametrize("name,build", BAD_INPUTS, ids=[f"{i}-{n}" for i, (n, _) in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(device, name, build):
    with pytest.raises(ValueError, match=name):
        ops.mixture_verify(**to_device(build(), device))


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_bad_draft_temperature_is_rejected(device, value):
    with pytest.raises(ValueError, match="draft_temperature"):
        ops.mixture_verify(**to_device(_base_case(), device), draft_temperature=value)


@pytest.mark.parametrize("kwargs,name", [(dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"),
                                         (dict(top_p=float("nan")), "top_p")])
def test_bad_filter_settings_name_the_argument(device, kwargs, name):
    with pytest.raises(ValueError, match=name):
        ops.mixture_verify(**to_device(_base_case(), device), **kwargs)


def test_more_branches_than_the_kernels_hold_is_refused(device):
    case = make_mixture_case(2, 65, 2, 16, FilterSettings(), torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="branch"):
        ops.mixture_verify(**to_device(case, device))


@pytest.mark.parametrize("num_branches", [33, 64])
def test_the_most_branches_the_kernels_hold_match_the_reference(device, num_branches):
    settings = FilterSettings(1.0, 20, 0.95)
    case = make_mixture_case(8, num_branches, 3, 64, settings, torch.Generator().manual_seed(num_branches))
    check_against_reference(case, settings, device)


def test_an_empty_batch_gives_empty_outputs(device):
    case = make_mixture_case(0, 4, 5, 64, FilterSettings(), torch.Generator().manual_seed(2))
    result = ops.mixture_verify(**to_device(case, device))
    assert result.num_accepted.shape == (0,) and result.output_tokens.shape == (0, 6)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck_half_precision(device, dtype, validate):
    case = make_mixture_case(4, 1, 5, 64, FilterSettings(), torch.Generator().manual_seed(10), dtype)
    case = to_device(case, device)
    args = (case["target_logits"], case["draft_logits"], case["branch_prior"], case["draft_tokens"],
            case["uniforms"], 0.7, 0, 1.0, 1.0, validate)
    torch.library.opcheck(torch.ops.dblast.mixture_verify.default, args)


def test_opcheck(device):
    case = to_device(make_mixture_case(4, 3, 5, 64, FilterSettings(), torch.Generator().manual_seed(9)), device)
    args = (case["target_logits"], case["draft_logits"], case["branch_prior"], case["draft_tokens"],
            case["uniforms"], 0.9, 20, 0.95, 0.8, True)
    torch.library.opcheck(torch.ops.dblast.mixture_verify.default, args)


# torch.compile (aot_eager, inductor, dynamic shapes) and the fake kernel: test_ops_compile.py
