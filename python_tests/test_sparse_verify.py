"""dblast::sparse_verify (a sampled chain with a sparse proposal: DFlash2's candidate selector)
against its specification (dblast_ext.reference.sparse_verify), its distribution guarantee, and
its argument checks."""
import itertools

import numpy as np
import pytest
import torch

from dblast_ext import ops, reference
from losslessness import assert_committed_tokens_follow_p, chi_square_pvalue, exact_joint
from verify_cases import FilterSettings, assert_verify_close, decision_margins, make_sparse_case, to_device

FILTERS = [FilterSettings(t, k, p) for t, k, p in itertools.product([0.0, 0.7, 1.0, 1.5], [0, 20], [0.9, 1.0])]


def check_against_reference(case: dict, settings: FilterSettings, device):
    result = ops.sparse_verify(**to_device(case, device), **settings.kwargs())
    expected = reference.sparse_verify(**case, **settings.kwargs())
    p = reference.filter_target_probs(case["target_logits"], **settings.kwargs())
    proposals = reference.sparse_proposal(case["proposal_tokens"], case["proposal_probs"],
                                          case["target_logits"].shape[-1])
    assert_verify_close(result, expected, decision_margins(p, case["draft_tokens"], proposals, case["uniforms"]))
    assert result.output_tokens.device.type == torch.device(device).type
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("settings", FILTERS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_matches_reference_across_filters(device, settings, dtype):
    case = make_sparse_case(24, 7, 1000, 16, settings, torch.Generator().manual_seed(7), dtype)
    check_against_reference(case, settings, device)


@pytest.mark.parametrize("num_draft,candidates", [(1, 1), (3, 4), (7, 16), (15, 16), (7, 64)])
def test_matches_reference_across_block_and_candidate_counts(device, num_draft, candidates):
    settings = FilterSettings(0.8, 0, 0.95)
    case = make_sparse_case(32, num_draft, 500, candidates, settings,
                            torch.Generator().manual_seed(num_draft * 100 + candidates))
    check_against_reference(case, settings, device)


@pytest.mark.parametrize("logits_dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("uniforms_dtype", [torch.float32, torch.float64])
def test_matches_reference_across_dtypes(device, logits_dtype, uniforms_dtype):
    settings = FilterSettings(1.0, 20, 0.9)
    case = make_sparse_case(24, 7, 600, 16, settings, torch.Generator().manual_seed(3), logits_dtype)
    case["uniforms"] = case["uniforms"].to(uniforms_dtype)
    check_against_reference(case, settings, device)


def test_a_large_vocabulary_matches_the_reference(device):
    settings = FilterSettings(1.0, 20, 0.95)
    case = make_sparse_case(3, 7, 151936, 16, settings, torch.Generator().manual_seed(5), torch.bfloat16)
    check_against_reference(case, settings, device)


def test_repeated_candidates_add_up_and_a_draft_outside_them_is_accepted_iff_p_allows(device):
    """An id listed twice carries the sum of its probabilities; a draft the proposal gives no
    mass (q = 0) is accepted iff the target can emit it, as in the other verifiers."""
    settings = FilterSettings(1.0, 5, 1.0)
    case = make_sparse_case(40, 5, 200, 8, settings, torch.Generator().manual_seed(11))
    case["proposal_tokens"][:, :, 1] = case["proposal_tokens"][:, :, 0]  # duplicates
    outside = case["draft_tokens"].clone()
    outside[::2, 2] = (case["proposal_tokens"][::2, 2].max(-1).values + 1) % 200
    in_list = (case["proposal_tokens"][::2, 2] == outside[::2, 2, None]).any(-1)
    outside[::2][in_list, 2] = case["draft_tokens"][::2][in_list, 2]
    case["draft_tokens"] = outside
    result = check_against_reference(case, settings, device)
    p = reference.filter_target_probs(case["target_logits"], **settings.kwargs())
    proposals = reference.sparse_proposal(case["proposal_tokens"], case["proposal_probs"], 200)
    rows = torch.arange(40)
    q_draft = proposals[2][rows, case["draft_tokens"][:, 2]]
    p_draft = p[rows, 2, case["draft_tokens"][:, 2]]
    unlisted = q_draft == 0
    assert unlisted.sum() >= 10
    torch.testing.assert_close(result.accept_probs.cpu()[unlisted, 2], (p_draft[unlisted] > 0).float())


def test_greedy_commits_the_targets_argmax(device):
    settings = FilterSettings(0.0, 0, 1.0)
    case = make_sparse_case(32, 7, 300, 16, settings, torch.Generator().manual_seed(13))
    # half of the rows draft the target's own argmax chain: all of it is accepted
    greedy = case["target_logits"].argmax(-1)
    case["draft_tokens"][:16] = greedy[:16, :7]
    case["proposal_tokens"][:16, :, 0] = greedy[:16, :7]
    result = check_against_reference(case, settings, device)
    assert (result.num_accepted.cpu()[:16] == 7).all()
    k = result.num_accepted.cpu().long()
    rows = torch.arange(32)
    assert torch.equal(result.output_tokens.cpu()[rows, k], greedy[rows, k])


def test_skipping_validation_changes_nothing_on_valid_input(device):
    settings = FilterSettings(1.0, 20, 0.95)
    case = to_device(make_sparse_case(32, 7, 500, 16, settings, torch.Generator().manual_seed(21)), device)
    checked = ops.sparse_verify(**case, **settings.kwargs())
    unchecked = ops.sparse_verify(**case, **settings.kwargs(), validate=False)
    for a, b in zip(checked, unchecked):
        assert torch.equal(a, b)


def test_uniforms_drawn_from_generator_are_reproducible(device):
    case = to_device(make_sparse_case(32, 7, 100, 8, FilterSettings(), torch.Generator().manual_seed(5)), device)
    case.pop("uniforms")
    gen = lambda seed: torch.Generator(device=device).manual_seed(seed)  # noqa: E731
    a = ops.sparse_verify(**case, generator=gen(99))
    explicit = torch.rand(32, 8, dtype=torch.float64, device=device, generator=gen(99))
    b = ops.sparse_verify(**case, uniforms=explicit)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# --- losslessness ---------------------------------------------------------------------------

SAMPLES = 100_000
STAT_FILTERS = [FilterSettings(0.7, 6, 0.9), FilterSettings(1.0, 0, 1.0), FilterSettings(1.5, 0, 0.95)]


def small_sparse_problem(seed: int):
    """V = 17, b = 3, C = 4 candidates per position: the target's top ids in a shuffled order
    and one it ranks low, with a q unlike p."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 17, generator=g) * 1.5
    order = logits[:3].argsort(-1, descending=True)
    candidates = torch.stack([order[:, 1], order[:, 0], order[:, 2], order[:, 12]], dim=-1)  # [3, 4]
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.1, 0.6, 0.1, 0.2]])
    return logits, candidates, q


@pytest.mark.parametrize("settings", STAT_FILTERS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_every_committed_position_follows_the_target(device, settings):
    """Each row draws its chain from q (position by position) and fresh uniforms: every committed
    token follows the target's filtered distribution at its position."""
    logits, candidates, q = small_sparse_problem(41)
    g = torch.Generator().manual_seed(42)
    picks = torch.stack([torch.multinomial(q[i], SAMPLES, replacement=True, generator=g) for i in range(3)], -1)
    draft = candidates[torch.arange(3), picks]  # [SAMPLES, 3]
    case = dict(target_logits=logits.expand(SAMPLES, -1, -1).contiguous(), draft_tokens=draft,
                proposal_tokens=candidates.expand(SAMPLES, -1, -1).contiguous(),
                proposal_probs=q.expand(SAMPLES, -1, -1).contiguous(),
                uniforms=torch.rand(SAMPLES, 4, generator=g, dtype=torch.float64))
    result = ops.sparse_verify(**to_device(case, device), **settings.kwargs())
    p = reference.filter_target_probs(logits, **settings.kwargs())
    assert (result.num_accepted.cpu() == 3).float().mean() > 0.02  # deep positions reached
    assert_committed_tokens_follow_p(p, result.num_accepted, result.output_tokens)


@pytest.mark.parametrize("settings", STAT_FILTERS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_joint_of_accepted_count_and_final_token_for_a_fixed_chain(device, settings):
    logits, candidates, q = small_sparse_problem(51)
    p = reference.filter_target_probs(logits, **settings.kwargs())
    draft = candidates[:, 0]

    def q_at(i):
        return torch.zeros(17, dtype=torch.float64).index_add_(0, candidates[i], q[i].double())

    joint = exact_joint(p, draft, q_at)
    g = torch.Generator().manual_seed(52)
    result = ops.sparse_verify(logits.expand(SAMPLES, -1, -1).contiguous().to(device),
                               draft.expand(SAMPLES, -1).contiguous().to(device),
                               candidates.expand(SAMPLES, -1, -1).contiguous().to(device),
                               q.expand(SAMPLES, -1, -1).contiguous().to(device),
                               torch.rand(SAMPLES, 4, generator=g, dtype=torch.float64).to(device),
                               **settings.kwargs())
    k = result.num_accepted.cpu().long()
    final = result.output_tokens.cpu()[torch.arange(SAMPLES), k]
    observed = np.bincount((k * 17 + final).numpy(), minlength=4 * 17).reshape(4, 17)
    assert observed[joint == 0].sum() == 0
    assert chi_square_pvalue(observed.ravel(), joint.ravel() * SAMPLES) > 1e-3


# --- bad input --------------------------------------------------------------------------------

def _base_case():
    return make_sparse_case(4, 5, 40, 6, FilterSettings(), torch.Generator().manual_seed(0))


def _with(**changes):
    def build():
        case = _base_case()
        for key, fn in changes.items():
            case[key] = fn(case[key])
        return case
    return build


BAD_INPUTS = [
    ("target_logits", _with(target_logits=lambda t: t[0])),
    ("target_logits", _with(target_logits=lambda t: t.to(torch.int32))),
    ("target_logits", _with(target_logits=lambda t: t.index_fill(2, torch.tensor([3]), float("nan")))),
    ("draft_tokens", _with(draft_tokens=lambda t: t[:, :4])),
    ("draft_tokens", _with(draft_tokens=lambda t: t.float())),
    ("draft_tokens", _with(draft_tokens=lambda t: t.index_fill(1, torch.tensor([1]), 40))),
    ("proposal_tokens", _with(proposal_tokens=lambda t: t[:, :4])),
    ("proposal_tokens", _with(proposal_tokens=lambda t: t.int())),
    ("proposal_tokens", _with(proposal_tokens=lambda t: t.index_fill(2, torch.tensor([1]), -1))),
    ("candidates C", _with(proposal_tokens=lambda t: t[:, :, :0], proposal_probs=lambda t: t[:, :, :0])),
    ("proposal_probs", _with(proposal_probs=lambda t: t[:, :, :5])),
    ("proposal_probs", _with(proposal_probs=lambda t: t.double())),
    ("proposal_probs", _with(proposal_probs=lambda t: t * 1.5)),
    ("proposal_probs", _with(proposal_probs=lambda t: t.index_fill(2, torch.tensor([0]), -0.1))),
    ("uniforms", _with(uniforms=lambda t: t[:, :5])),
    ("uniforms", _with(uniforms=lambda t: t.fill_(1.0))),
]


@pytest.mark.parametrize("name,build", BAD_INPUTS, ids=[f"{i}-{n}" for i, (n, _) in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(device, name, build):
    with pytest.raises(ValueError, match=name):
        ops.sparse_verify(**to_device(build(), device))


@pytest.mark.parametrize("name,kwargs", [("top_p", dict(top_p=1.5)), ("top_k", dict(top_k=-1)),
                                         ("temperature", dict(temperature=float("nan")))])
def test_bad_filter_settings_name_the_argument(device, name, kwargs):
    with pytest.raises(ValueError, match=name):
        ops.sparse_verify(**to_device(_base_case(), device), **kwargs)


def test_direct_calls_are_checked_by_the_kernel():
    case = _base_case()
    case["proposal_probs"] = case["proposal_probs"] * 2
    with pytest.raises(ValueError, match="proposal_probs must sum to 1"):
        torch.ops.dblast.sparse_verify(*case.values(), 1.0, 0, 1.0, True)
    with pytest.raises(ValueError, match="the number of candidates C"):
        torch.ops.dblast.sparse_verify(case["target_logits"], case["draft_tokens"],
                                       torch.zeros(4, 5, 65, dtype=torch.int64), torch.zeros(4, 5, 65),
                                       case["uniforms"], 1.0, 0, 1.0, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mixing devices needs a GPU")
@pytest.mark.parametrize("name", ["draft_tokens", "proposal_tokens", "proposal_probs", "uniforms"])
def test_mixed_devices_name_the_argument(name):
    case = to_device(_base_case(), "cuda")
    case[name] = case[name].cpu()
    with pytest.raises(ValueError, match=name):
        ops.sparse_verify(**case)


# --- registration -----------------------------------------------------------------------------

@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype, validate):
    case = make_sparse_case(6, 5, 64, 8, FilterSettings(), torch.Generator().manual_seed(9), dtype)
    torch.library.opcheck(torch.ops.dblast.sparse_verify.default, (*case.values(), 0.9, 20, 0.95, validate))
