"""dblast::branch_verify against its specification (dblast_ext.reference.branch_verify)."""
import functools
import itertools

import numpy as np
import pytest
import torch

from dblast_ext import ops, reference
from losslessness import assert_committed_tokens_follow_p, chi_square_pvalue, exact_joint
from verify_cases import FilterSettings, assert_verify_close, decision_margins, make_branch_case, to_device

FILTERS = [FilterSettings(t, k, p) for t, k, p in itertools.product([0.0, 0.7, 1.0, 1.5], [0, 1, 20], [0.8, 0.95, 1.0])]


def reference_outcome(case: dict, settings: FilterSettings):
    """The float64 reference's result and, per row, how far its decisions are from flipping."""
    expected = reference.branch_verify(**case, **settings.kwargs())
    p = reference.filter_target_probs(case["target_logits"], **settings.kwargs())
    rows = case["branch"].shape[0]
    draft = case["branch_tokens"][torch.arange(rows), case["branch"]]
    proposals = reference.greedy_branch_proposal(case["branch_tokens"], case["branch_prior"], case["branch"],
                                                 case["target_logits"].shape[-1])
    return expected, decision_margins(p, draft, proposals, case["uniforms"])


def check_against_reference(case: dict, settings: FilterSettings, device, outcome=None):
    result = ops.branch_verify(**to_device(case, device), **settings.kwargs())
    expected, margins = outcome if outcome is not None else reference_outcome(case, settings)
    assert_verify_close(result, expected, margins)
    return result


@pytest.mark.parametrize("num_draft,num_branches", list(itertools.product([1, 7, 15, 23], [1, 2, 4, 8])))
def test_matches_reference_across_block_and_branch_counts(device, num_draft, num_branches):
    seed = num_draft * 100 + num_branches
    settings = FILTERS[seed % len(FILTERS)]
    dtype = [torch.float32, torch.bfloat16][seed % 2]
    case = make_branch_case(32, num_branches, num_draft, 1000, settings, torch.Generator().manual_seed(seed), dtype)
    check_against_reference(case, settings, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("settings", FILTERS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_matches_reference_across_filters(device, settings, dtype):
    case = make_branch_case(24, 4, 7, 1000, settings, torch.Generator().manual_seed(7), dtype)
    result = check_against_reference(case, settings, device)
    if settings.temperature == 0.0:
        # greedy: a correction is always the target's argmax
        greedy = case["target_logits"].float().argmax(-1)
        rows = torch.arange(24)
        k = result.num_accepted.cpu().long()
        assert torch.equal(result.output_tokens.cpu()[rows, k], greedy[rows, k])


@pytest.mark.parametrize("vocab,settings", [
    (17, FilterSettings(1.0, 0, 1.0)),
    (17, FilterSettings(0.7, 5, 0.9)),
    (151936, FilterSettings(1.0, 20, 0.95)),
    (151936, FilterSettings(1.0, 0, 0.8)),
    (151936, FilterSettings(0.7, 0, 1.0)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_across_vocab_sizes(device, vocab, settings, dtype):
    # a large vocabulary with 3 rows of b + 1 = 8 positions: the float64 reference sorts every
    # position's vocabulary, and 24 positions of 151,936 tokens keep it to a second or two (the
    # reference decisions of these rows lie >= 1e-5 from a flip, far outside the 1e-8 band)
    rows, num_draft = (64, 15) if vocab < 1000 else (3, 7)
    case = make_branch_case(rows, 4, num_draft, vocab, settings, torch.Generator().manual_seed(vocab), dtype)
    check_against_reference(case, settings, device)


@pytest.mark.parametrize("logits_dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("uniforms_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_branches,temperature", list(itertools.product([1, 4], [0.0, 0.7])))
def test_matches_reference_across_dtypes(device, logits_dtype, uniforms_dtype, num_branches, temperature):
    """Every logits x uniforms dtype (each its own kernel instantiation) with K = 1 and K > 1,
    greedy and sampled."""
    settings = FilterSettings(temperature, 20, 0.9)
    case = make_branch_case(24, num_branches, 7, 600, settings, torch.Generator().manual_seed(num_branches),
                            logits_dtype)
    case["uniforms"] = case["uniforms"].to(uniforms_dtype)
    check_against_reference(case, settings, device)


def test_logits_sliced_from_a_padded_vocabulary_match_the_reference(device):
    """target_logits as a view [..., :V] of a padded LM head's output: not contiguous."""
    settings = FilterSettings(0.8, 20, 0.9)
    case = make_branch_case(16, 4, 7, 500, settings, torch.Generator().manual_seed(24))
    padded = torch.cat([case["target_logits"], torch.randn(16, 8, 12)], dim=-1)
    sliced = dict(case, target_logits=padded.to(device)[..., :500])
    assert not sliced["target_logits"].is_contiguous()
    result = ops.branch_verify(**to_device(sliced, device), **settings.kwargs())
    expected = ops.branch_verify(**to_device(case, device), **settings.kwargs())
    for a, b in zip(result, expected):
        assert torch.equal(a, b)
    check_against_reference(case, settings, device)


@pytest.mark.parametrize("top_k", [600, 605])
def test_a_top_k_off_or_beyond_the_vocabulary_is_no_filter(device, top_k):
    settings = FilterSettings(1.0, 0, 0.95)
    case = to_device(make_branch_case(32, 4, 7, 600, settings, torch.Generator().manual_seed(23)), device)
    plain = ops.branch_verify(**case, **settings.kwargs())
    same = ops.branch_verify(**case, temperature=1.0, top_k=top_k, top_p=0.95)
    for a, b in zip(plain, same):
        assert torch.equal(a, b)


def test_skipping_validation_changes_nothing_on_valid_input(device):
    settings = FilterSettings(1.0, 20, 0.95)
    case = to_device(make_branch_case(32, 4, 7, 500, settings, torch.Generator().manual_seed(21)), device)
    checked = ops.branch_verify(**case, **settings.kwargs())
    unchecked = ops.branch_verify(**case, **settings.kwargs(), validate=False)
    for a, b in zip(checked, unchecked):
        assert torch.equal(a, b)


@pytest.mark.parametrize("settings", [FilterSettings(1.0, 0, 1.0), FilterSettings(0.8, 5, 0.9)],
                         ids=["plain", "top-k-top-p"])
def test_every_committed_position_follows_the_target(device, settings):
    """Fixed greedy branches (sharing prefixes, one duplicated) and prior, the branch drawn from
    the prior per row as the decode loop does: whatever the branch, each committed token
    follows the target's filtered distribution at its position."""
    g = torch.Generator().manual_seed(31)
    rows, vocab, num_draft = 60000, 8, 3
    logits = torch.randn(num_draft + 1, vocab, generator=g) * 2.0
    p = reference.filter_target_probs(logits, **settings.kwargs())
    top = p.argsort(-1, descending=True)
    branches = torch.stack([top[:num_draft, 0], top[:num_draft, 0], top[:num_draft, 1],
                            torch.tensor([top[0, 0], top[1, 1], top[2, 2]])])  # K = 4
    prior = torch.tensor([0.4, 0.1, 0.3, 0.2])
    case = dict(target_logits=logits.expand(rows, -1, -1).contiguous(),
                branch_tokens=branches.expand(rows, -1, -1).contiguous(), branch_prior=prior.expand(rows, -1).contiguous(),
                branch=torch.multinomial(prior, rows, replacement=True, generator=g),
                uniforms=torch.rand(rows, num_draft + 1, generator=g, dtype=torch.float64))
    result = ops.branch_verify(**to_device(case, device), **settings.kwargs())
    assert (result.num_accepted.cpu() == num_draft).float().mean() > 0.05  # deep positions reached
    assert_committed_tokens_follow_p(p, result.num_accepted, result.output_tokens)


def test_accept_probs_cover_every_drafted_position(device):
    settings = FilterSettings(1.0, 0, 1.0)
    case = make_branch_case(64, 4, 7, 50, settings, torch.Generator().manual_seed(3))
    result = ops.branch_verify(**to_device(case, device))
    expected = reference.branch_verify(**case)
    # positions past the first rejection still carry A_i of the drafted prefix
    assert (result.num_accepted.cpu() < 7).any()
    torch.testing.assert_close(result.accept_probs.cpu(), expected.accept_probs, atol=1e-6, rtol=0)
    padded = torch.arange(8)[None, :] > result.num_accepted.cpu()[:, None].long()
    assert (result.output_tokens.cpu()[padded] == -1).all()


def test_single_branch_is_independent_greedy_draft(device):
    # K = 1: accept with p(x_i), and the residual is p without x_i.
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(40, 6, 30, generator=g)
    tokens = torch.randint(0, 30, (40, 1, 5), generator=g)
    prior = torch.ones(40, 1)
    branch = torch.zeros(40, dtype=torch.int64)
    uniforms = torch.rand(40, 6, generator=g, dtype=torch.float64)
    result = ops.branch_verify(logits.to(device), tokens.to(device), prior.to(device), branch.to(device),
                               uniforms.to(device))
    p = torch.softmax(logits.double(), -1)
    p_draft = p[:, :5].gather(-1, tokens[:, 0, :, None]).squeeze(-1)
    torch.testing.assert_close(result.accept_probs.cpu(), p_draft.float(), atol=1e-6, rtol=0)
    k = result.num_accepted.cpu().long()
    rows = torch.arange(40)
    rejected = k < 5
    corrections = result.output_tokens.cpu()[rows, k]
    assert (corrections[rejected] != tokens[rows, 0, k.clamp(max=4)][rejected]).all()
    # the residual p without x_i, renormalised, by inverse CDF on the row's last uniform
    for n in rows[rejected].tolist():
        residual = p[n, k[n]].clone()
        residual[tokens[n, 0, k[n]]] = 0.0
        want = reference.inverse_cdf_sample((residual / residual.sum())[None], uniforms[n, 5:6])[0]
        assert int(corrections[n]) == int(want), n


def test_uniforms_drawn_from_generator_are_reproducible(device):
    """Without uniforms the op draws float64 uniforms [N, b+1] from `generator`: the same
    seed gives the outcome of passing those uniforms, another seed another outcome."""
    case = to_device(make_branch_case(32, 4, 7, 100, FilterSettings(), torch.Generator().manual_seed(5)), device)
    case.pop("uniforms")
    gen = lambda seed: torch.Generator(device=device).manual_seed(seed)  # noqa: E731
    a = ops.branch_verify(**case, generator=gen(99))
    explicit = torch.rand(32, 8, dtype=torch.float64, device=device, generator=gen(99))
    b = ops.branch_verify(**case, uniforms=explicit)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    other = ops.branch_verify(**case, generator=gen(100))
    assert not torch.equal(a.output_tokens, other.output_tokens)


# --- real vocabularies, split over a cluster of blocks (the staged kernels) -------------------

SPLIT_CASES = [  # (vocab, settings, dtype): the staged kernels cut these rows over 8 blocks
    (151936, FilterSettings(0.0, 0, 1.0), torch.bfloat16),
    (151936, FilterSettings(0.7, 20, 0.9), torch.bfloat16),
    (151936, FilterSettings(1.0, 0, 0.95), torch.bfloat16),
    (49152, FilterSettings(0.7, 0, 0.8), torch.float32),
    (49152, FilterSettings(1.0, 1000, 1.0), torch.float32),
    (40961, FilterSettings(1.0, 50, 0.95), torch.float16),  # uneven slices, unaligned rows
]


@functools.lru_cache(maxsize=None)
def split_case(index: int):
    """SPLIT_CASES[index]'s inputs and reference outcome, computed once for every device."""
    vocab, settings, dtype = SPLIT_CASES[index]
    case = make_branch_case(6, 4, 3, vocab, settings, torch.Generator().manual_seed(vocab + 1), dtype)
    return case, reference_outcome(case, settings)


@pytest.mark.parametrize("vocab,settings,dtype", SPLIT_CASES,
                         ids=[f"V{v}-T{s.temperature}-k{s.top_k}-p{s.top_p}" for v, s, _ in SPLIT_CASES])
def test_real_vocabularies_match_the_reference(device, vocab, settings, dtype):
    """Qwen3's and SmolLM2's vocabularies (and an odd one): the max, the top-k / top-p
    thresholds, the masses and the draws combine the parts of a row that separate blocks hold;
    6 rows x 4 positions put draws in every part."""
    case, outcome = split_case(SPLIT_CASES.index((vocab, settings, dtype)))
    check_against_reference(case, settings, device, outcome)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("variant", ["verified", "staged"])
def test_cuda_graph_replay_matches_eager_calls(variant):
    """validate=False never waits for the host: the op is captured in a CUDA graph, and replays
    on new inputs copied into the captured tensors give the eager results."""
    settings = FilterSettings(0.8, 20, 0.95)
    cases = [to_device(make_branch_case(4, 4, 7, 49152, settings, torch.Generator().manual_seed(seed),
                                        torch.bfloat16), "cuda") for seed in (41, 42)]
    with ops.using_cuda_kernels(variant):
        static = {k: v.clone() for k, v in cases[0].items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs asks
            ops.branch_verify(**static, **settings.kwargs(), validate=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ops.branch_verify(**static, **settings.kwargs(), validate=False)
        for case in (cases[1], cases[0]):
            for key, value in case.items():
                static[key].copy_(value)
            graph.replay()
            eager = ops.branch_verify(**case, **settings.kwargs(), validate=False)
            for a, b in zip(captured, eager):
                assert torch.equal(a, b)


# --- losslessness ---------------------------------------------------------------------------

SAMPLES = 100_000
STAT_FILTERS = [FilterSettings(1.0, 0, 1.0), FilterSettings(0.7, 6, 0.9), FilterSettings(1.5, 0, 0.95),
                FilterSettings(0.0, 0, 1.0)]


def small_branch_problem(seed: int):
    """V = 17, b = 3, K = 4 branches with shared prefixes, drafted from the target's top tokens."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 4, 17, generator=g) * 1.5
    top = logits[0, :3].argsort(-1, descending=True)  # [3, 17]
    a, b_, c, d = top[:, 0], top[:, 1], top[:, 2], top[:, 3]
    branches = torch.stack([
        torch.stack([a[0], a[1], a[2]]),
        torch.stack([a[0], a[1], b_[2]]),
        torch.stack([b_[0], c[1], a[2]]),
        torch.stack([a[0], d[1], c[2]]),
    ])[None]  # [1, K, b]
    prior = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    return logits, branches, prior


@pytest.mark.parametrize("settings", STAT_FILTERS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_first_emitted_token_follows_filtered_target(device, settings):
    logits, branches, prior = small_branch_problem(21)
    g = torch.Generator().manual_seed(22)
    branch = torch.multinomial(prior[0], SAMPLES, replacement=True, generator=g)  # z ~ prior
    uniforms = torch.rand(SAMPLES, 4, generator=g, dtype=torch.float64)
    result = ops.branch_verify(logits.expand(SAMPLES, -1, -1).contiguous().to(device),
                               branches.expand(SAMPLES, -1, -1).contiguous().to(device),
                               prior.expand(SAMPLES, -1).contiguous().to(device), branch.to(device),
                               uniforms.to(device), **settings.kwargs())
    first = result.output_tokens[:, 0].cpu().numpy()
    p1 = reference.filter_target_probs(logits[0, 0], **settings.kwargs()).numpy()
    observed = np.bincount(first, minlength=17)
    assert observed[p1 == 0].sum() == 0, "emitted a token the filtered target excludes"
    assert chi_square_pvalue(observed, p1 * SAMPLES) > 1e-3


@pytest.mark.parametrize("settings", STAT_FILTERS[:3], ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
@pytest.mark.parametrize("chosen", [0, 2])
def test_joint_of_accepted_count_and_final_token_given_branch(device, settings, chosen):
    logits, branches, prior = small_branch_problem(31)
    p = reference.filter_target_probs(logits[0], **settings.kwargs())
    draft = branches[0, chosen]

    def q_at(i):  # Eq 19-20 written out: renormalised prior of consistent branches on their tokens
        q = torch.zeros(17, dtype=torch.float64)
        consistent = [z for z in range(4) if torch.equal(branches[0, z, :i], draft[:i])]
        mass = sum(float(prior[0, z]) for z in consistent)
        for z in consistent:
            q[branches[0, z, i]] += float(prior[0, z]) / mass
        return q

    joint = exact_joint(p, draft, q_at)
    g = torch.Generator().manual_seed(32)
    uniforms = torch.rand(SAMPLES, 4, generator=g, dtype=torch.float64)
    result = ops.branch_verify(logits.expand(SAMPLES, -1, -1).contiguous().to(device),
                               branches.expand(SAMPLES, -1, -1).contiguous().to(device),
                               prior.expand(SAMPLES, -1).contiguous().to(device),
                               torch.full((SAMPLES,), chosen).to(device), uniforms.to(device), **settings.kwargs())
    k = result.num_accepted.cpu().long()
    final = result.output_tokens.cpu()[torch.arange(SAMPLES), k]
    observed = np.bincount((k * 17 + final).numpy(), minlength=4 * 17).reshape(4, 17)
    assert observed[joint == 0].sum() == 0
    assert chi_square_pvalue(observed.ravel(), joint.ravel() * SAMPLES) > 1e-3


# --- bad input --------------------------------------------------------------------------------

def _base_case():
    return make_branch_case(4, 3, 5, 40, FilterSettings(), torch.Generator().manual_seed(0), zero_prior=False)


def _with(**changes):
    def build():
        case = _base_case()
        for key, fn in changes.items():
            case[key] = fn(case[key]) if callable(fn) else fn
        return case
    return build


def _zero_selected_prior(case):
    case["branch_prior"][0] = torch.tensor([0.5, 0.5, 0.0])
    case["branch"][0] = 2
    return case


BAD_INPUTS = [
    ("target_logits", _with(target_logits=lambda t: t[0])),
    ("target_logits", _with(target_logits=lambda t: t.to(torch.int32))),
    ("target_logits", _with(target_logits=lambda t: t.index_fill(2, torch.tensor([3]), float("nan")))),
    ("target_logits", _with(target_logits=lambda t: t.index_fill(2, torch.tensor([3]), float("inf")))),
    ("branch_tokens", _with(branch_tokens=lambda t: t[:, :, :4])),
    ("branch_tokens", _with(branch_tokens=lambda t: t.float())),
    ("branch_tokens", _with(branch_tokens=lambda t: t.index_fill(2, torch.tensor([1]), 40))),
    ("branch_tokens", _with(branch_tokens=lambda t: t.index_fill(2, torch.tensor([1]), -1))),
    ("branch_prior", _with(branch_prior=lambda t: t[:, :2])),
    ("branch_prior", _with(branch_prior=lambda t: t.double())),
    ("branch_prior", _with(branch_prior=lambda t: t * 1.5)),
    ("branch_prior", _with(branch_prior=lambda t: torch.tensor([[1.5, -0.5, 0.0]]).expand(4, 3).contiguous())),
    ("branch", _with(branch=lambda t: t[:3])),
    ("branch", _with(branch=lambda t: t.int())),
    ("branch", _with(branch=lambda t: t.fill_(3))),
    ("branch", lambda: _zero_selected_prior(_base_case())),
    ("uniforms", _with(uniforms=lambda t: t[:, :5])),
    ("uniforms", _with(uniforms=lambda t: t.fill_(1.0))),
    ("uniforms", _with(uniforms=lambda t: t - 0.5)),
    ("uniforms", _with(uniforms=lambda t: t.half())),
]


@pytest.mark.parametrize("name,build", BAD_INPUTS, ids=[f"{i}-{n}" for i, (n, _) in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(device, name, build):
    with pytest.raises(ValueError, match=name):
        ops.branch_verify(**to_device(build(), device))


@pytest.mark.parametrize("name,kwargs", [
    ("top_p", dict(top_p=0.0)), ("top_p", dict(top_p=float("nan"))),
    ("temperature", dict(temperature=-1.0)), ("temperature", dict(temperature=float("inf"))),
])
def test_bad_filter_settings_name_the_argument(device, name, kwargs):
    with pytest.raises(ValueError, match=name):
        ops.branch_verify(**to_device(_base_case(), device), **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mixing devices needs a GPU")
@pytest.mark.parametrize("name", ["branch_tokens", "branch_prior", "branch", "uniforms"])
def test_mixed_devices_name_the_argument(name):
    case = to_device(_base_case(), "cuda")
    case[name] = case[name].cpu()
    with pytest.raises(ValueError, match=name):
        ops.branch_verify(**case)


def test_too_many_branches_is_rejected():
    case = make_branch_case(2, 65, 2, 100, FilterSettings(), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="branches"):
        ops.branch_verify(**case)


# --- registration -----------------------------------------------------------------------------

def test_opcheck(device):
    case = to_device(make_branch_case(6, 4, 5, 64, FilterSettings(), torch.Generator().manual_seed(9)), device)
    args = (case["target_logits"], case["branch_tokens"], case["branch_prior"], case["branch"], case["uniforms"],
            0.9, 20, 0.95, True)
    torch.library.opcheck(torch.ops.dblast.branch_verify.default, args)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck_half_precision_single_branch(device, dtype, validate):
    case = to_device(make_branch_case(6, 1, 5, 64, FilterSettings(), torch.Generator().manual_seed(11), dtype), device)
    args = (case["target_logits"], case["branch_tokens"], case["branch_prior"], case["branch"], case["uniforms"],
            0.0, 0, 1.0, validate)
    torch.library.opcheck(torch.ops.dblast.branch_verify.default, args)

# torch.compile (aot_eager, inductor, dynamic shapes) and the fake kernel: test_ops_compile.py
