"""dblast::sample_tokens against its specification (dblast_ext.reference.sample_tokens)."""
import functools
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


def reference_outcome(logits, uniforms, query, settings):
    """The float64 reference's result and which rows' draws lie clear of a CDF step."""
    expected = reference.sample_tokens(logits, uniforms, query_tokens=query, **settings.kwargs())
    probs = reference.filter_target_probs(logits, **settings.kwargs())
    return expected, cdf_margin(probs, uniforms) > 1e-9


def check_against_reference(logits, uniforms, query, settings, device, outcome=None):
    result = ops.sample_tokens(logits.to(device), uniforms.to(device), query_tokens=query.to(device),
                               **settings.kwargs())
    expected, decided = outcome if outcome is not None else reference_outcome(logits, uniforms, query, settings)
    assert result.tokens.dtype == torch.int64 and result.query_probs.dtype == torch.float32
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


SPLIT_CASES = [  # (vocab, settings, dtype): the staged kernel cuts these rows over 8 blocks
    (151936, FilterSettings(0.0, 0, 1.0), torch.bfloat16),
    (151936, FilterSettings(0.7, 20, 0.95), torch.bfloat16),
    (151936, FilterSettings(1.0, 0, 0.9), torch.float32),
    (49152, FilterSettings(0.7, 0, 0.8), torch.bfloat16),
    (49152, FilterSettings(1.0, 50, 1.0), torch.float16),
    (200003, FilterSettings(1.0, 0, 0.95), torch.float32),  # parts longer than a block's shared-memory copy
]


@functools.lru_cache(maxsize=None)
def split_case(index: int):
    """SPLIT_CASES[index]'s inputs and reference outcome, computed once for every device."""
    vocab, settings, dtype = SPLIT_CASES[index]
    case = make_case(16, vocab, 4, seed=vocab + 7, dtype=dtype)
    return case, reference_outcome(*case, settings)


@pytest.mark.parametrize("vocab,settings,dtype", SPLIT_CASES,
                         ids=[f"V{v}-T{s.temperature}-k{s.top_k}-p{s.top_p}" for v, s, _ in SPLIT_CASES])
def test_real_vocabularies_match_the_reference(device, vocab, settings, dtype):
    """Real vocabularies, whose rows the staged kernel splits over a cluster of blocks: the
    thresholds and masses combine the blocks' parts, the draws land in every part."""
    (logits, uniforms, query), outcome = split_case(SPLIT_CASES.index((vocab, settings, dtype)))
    result = check_against_reference(logits, uniforms, query, settings, device, outcome)
    if settings.temperature == 0.0:
        assert torch.equal(result.tokens.cpu(), logits.float().argmax(-1))


def test_greedy_ties_across_the_split_take_the_lowest_id(device):
    logits = torch.randn(3, 151936, generator=torch.Generator().manual_seed(13))
    logits[:, [140000, 30001, 90000, 30002]] = 10.0  # tied maxima in different parts of the row
    out = ops.sample_tokens(logits.to(device), torch.zeros(3, dtype=torch.float64).to(device), temperature=0.0)
    assert out.tokens.tolist() == [30001] * 3


@pytest.mark.parametrize("settings", [FilterSettings(1.0, 100, 1.0), FilterSettings(0.5, 3000, 0.9),
                                      FilterSettings(1.0, 0, 0.5)], ids=["k100", "k3000-p0.9", "p0.5"])
def test_ties_at_the_thresholds_across_the_split_are_all_kept(device, settings):
    """Logits with few distinct values, so that the k-th largest and the top-p boundary are
    shared by thousands of tokens spread over every part of the row: all of them are kept."""
    g = torch.Generator().manual_seed(17)
    logits = torch.randint(0, 12, (8, 49152), generator=g).float() * 0.5
    uniforms = torch.rand(8, generator=g, dtype=torch.float64)
    query = torch.randint(0, 49152, (8, 6), generator=g)
    check_against_reference(logits, uniforms, query, settings, device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("variant", ["verified", "staged"])
def test_cuda_graph_replay_matches_eager_calls(variant):
    """validate=False never waits for the host: the op is captured in a CUDA graph, and replays
    on new inputs copied into the captured tensors give the eager results."""
    settings = FilterSettings(0.8, 20, 0.95)
    cases = [dict(zip(("logits", "uniforms", "query_tokens"),
                      (t.cuda() for t in make_case(61, 49152, 4, seed=seed, dtype=torch.bfloat16))))
             for seed in (41, 42)]
    with ops.using_cuda_kernels(variant):
        static = {k: v.clone() for k, v in cases[0].items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs asks
            ops.sample_tokens(**static, **settings.kwargs(), validate=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ops.sample_tokens(**static, **settings.kwargs(), validate=False)
        for case in (cases[1], cases[0]):
            for key, value in case.items():
                static[key].copy_(value)
            graph.replay()
            eager = ops.sample_tokens(**case, **settings.kwargs(), validate=False)
            assert torch.equal(captured.tokens, eager.tokens)
            assert torch.equal(captured.query_probs, eager.query_probs)


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
