"""dblast::sample_tokens against its specification (dblast_ext.reference.sample_tokens)."""
import itertools

import numpy as np
import pytest
import torch

from dblast_ext import ops, reference
from losslessness import chi_square_pvalue
from verify_cases import FilterSettings

FILTERS = [FilterSettings(t, k, p) for t, k, p in itertools.product([0.0, 0.7, 1.0, 1.5], [0, 1, 20], [0.8, 0.95, 1.0])]


def make_case(rows, vocab, queries, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3.0).to(dtype)
    uniforms = torch.rand(rows, generator=g, dtype=torch.float64)
    query = torch.randint(-1, vocab, (rows, queries), generator=g)
    query[:, 0] = logits.float().argmax(-1)  # a token every filter keeps
    return logits, uniforms, query


def cdf_margin(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, how far u * total lies from the nearest step of the filtered CDF: a draw within
    rounding of a step may go either way between float32 and float64 arithmetic."""
    cumulative = probs.cumsum(-1)
    target = uniforms.double()[:, None] * cumulative[:, -1:]
    return (cumulative - target).abs().min(-1).values


def check_against_reference(logits, uniforms, query, settings, device):
    result = ops.sample_tokens(logits.to(device), uniforms.to(device), query_tokens=query.to(device),
                               **settings.kwargs())
    expected = reference.sample_tokens(logits, uniforms, query_tokens=query, **settings.kwargs())
    assert result.tokens.dtype == torch.int64 and result.query_probs.dtype == torch.float32
    probs = reference.filter_target_probs(logits, **settings.kwargs())
    decided = cdf_margin(probs, uniforms) > 1e-9
    assert decided.float().mean() > 0.9  # the comparison below covers almost every row
    assert torch.equal(result.tokens.cpu()[decided], expected.tokens[decided])
    torch.testing.assert_close(result.query_probs.cpu(), expected.query_probs, rtol=1e-5, atol=1e-6)
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("settings", FILTERS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_matches_reference_across_filters(device, settings, dtype):
    logits, uniforms, query = make_case(48, 1000, 4, seed=3, dtype=dtype)
    result = check_against_reference(logits, uniforms, query, settings, device)
    if settings.temperature == 0.0:
        assert torch.equal(result.tokens.cpu(), logits.float().argmax(-1))


@pytest.mark.parametrize("vocab,settings", [
    (1, FilterSettings(1.0, 0, 1.0)),
    (17, FilterSettings(0.7, 5, 0.9)),
    (151936, FilterSettings(1.0, 20, 0.95)),
    (151936, FilterSettings(0.7, 0, 0.8)),
])
def test_matches_reference_across_vocab_sizes(device, vocab, settings):
    logits, uniforms, query = make_case(4, vocab, 3, seed=vocab)
    check_against_reference(logits, uniforms, query, settings, device)


def test_greedy_takes_the_lowest_id_among_tied_maxima(device):
    logits = torch.zeros(3, 10)
    logits[:, [2, 5, 7]] = 4.0
    out = ops.sample_tokens(logits.to(device), torch.rand(3, dtype=torch.float64, generator=torch.Generator()
                                                          .manual_seed(0)).to(device), temperature=0.0)
    assert out.tokens.tolist() == [2, 2, 2]


@pytest.mark.parametrize("settings", [FilterSettings(1.0, 0, 1.0), FilterSettings(0.7, 6, 0.9)])
def test_draws_follow_the_filtered_distribution(device, settings):
    """One row of logits, many uniforms: the drawn tokens' histogram is the filtered target."""
    g = torch.Generator().manual_seed(21)
    row = torch.randn(24, generator=g) * 1.5
    samples = 20000
    logits = row.expand(samples, -1).contiguous()
    tokens = ops.sample_tokens(logits.to(device), torch.rand(samples, generator=g, dtype=torch.float64).to(device),
                               **settings.kwargs()).tokens.cpu()
    p = reference.filter_target_probs(row, **settings.kwargs()).numpy()
    counts = np.bincount(tokens.numpy(), minlength=24)
    assert counts[p == 0].sum() == 0
    assert chi_square_pvalue(counts, p * samples) > 1e-3


def test_query_probs_are_the_filtered_probabilities_and_zero_for_no_query(device):
    logits, uniforms, query = make_case(8, 50, 5, seed=4)
    query[:, -1] = -1
    out = ops.sample_tokens(logits.to(device), uniforms.to(device), query_tokens=query.to(device), temperature=0.9,
                            top_k=10)
    p = reference.filter_target_probs(logits, temperature=0.9, top_k=10)
    expected = p.gather(1, query.clamp(min=0)).float()
    expected[:, -1] = 0
    torch.testing.assert_close(out.query_probs.cpu(), expected, rtol=1e-5, atol=1e-7)


def test_uniforms_drawn_from_a_generator_are_reproducible(device):
    logits, _, _ = make_case(16, 100, 1, seed=5)
    runs = [ops.sample_tokens(logits.to(device), generator=torch.Generator(device).manual_seed(9)).tokens
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert runs[0].shape == (16,)


def test_skipping_validation_changes_nothing_on_valid_input(device):
    logits, uniforms, query = make_case(16, 300, 2, seed=6)
    args = (logits.to(device), uniforms.to(device))
    a = ops.sample_tokens(*args, query_tokens=query.to(device), top_p=0.9)
    b = ops.sample_tokens(*args, query_tokens=query.to(device), top_p=0.9, validate=False)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.query_probs, b.query_probs)


def _bad(name, **changes):
    def build():
        logits, uniforms, query = make_case(4, 30, 2, seed=7)
        case = dict(logits=logits, uniforms=uniforms, query_tokens=query)
        for key, fn in changes.items():
            case[key] = fn(case[key])
        return case
    return name, build


BAD_INPUTS = [
    _bad("logits", logits=lambda t: t[None]),
    _bad("logits", logits=lambda t: t.double()),
    _bad("logits", logits=lambda t: t.clone().index_fill_(1, torch.tensor([3]), float("nan"))),
    _bad("uniforms", uniforms=lambda t: t[:3]),
    _bad("uniforms", uniforms=lambda t: t.clone().fill_(1.0)),
    _bad("uniforms", uniforms=lambda t: t.half()),
    _bad("query_tokens", query_tokens=lambda t: t.int()),
    _bad("query_tokens", query_tokens=lambda t: t[:, 0]),
    _bad("query_tokens", query_tokens=lambda t: t.clone().fill_(30)),
    _bad("query_tokens", query_tokens=lambda t: t.clone().fill_(-2)),
]


@pytest.mark.parametrize("name,build", BAD_INPUTS, ids=[f"{i}-{n}" for i, (n, _) in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(device, name, build):
    case = {k: v.to(device) for k, v in build().items()}
    with pytest.raises(ValueError, match=name):
        ops.sample_tokens(case["logits"], case["uniforms"], query_tokens=case["query_tokens"])


@pytest.mark.parametrize("name,kwargs", [
    ("top_p", dict(top_p=0.0)), ("top_p", dict(top_p=float("nan"))),
    ("temperature", dict(temperature=-1.0)), ("temperature", dict(temperature=float("inf"))),
])
def test_bad_filter_settings_name_the_argument(device, name, kwargs):
    logits, uniforms, _ = make_case(4, 30, 1, seed=8)
    with pytest.raises(ValueError, match=name):
        ops.sample_tokens(logits.to(device), uniforms.to(device), **kwargs)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_opcheck(dtype, validate):
    logits, uniforms, query = make_case(6, 64, 3, seed=10, dtype=dtype)
    torch.library.opcheck(torch.ops.dblast.sample_tokens.default, (logits, uniforms, 0.9, 20, 0.95, query, validate))
    torch.library.opcheck(torch.ops.dblast.sample_tokens.default, (logits, uniforms, 0.0, 0, 1.0, query[:, :0],
                                                                   validate))

# torch.compile (aot_eager, inductor, dynamic shapes) and the fake kernel: test_ops_compile.py
