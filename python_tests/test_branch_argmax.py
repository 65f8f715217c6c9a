"""dblast::branch_argmax against its float64 specification (dblast_ext.reference.branch_argmax)."""
import pytest
import torch

from dblast_ext import ops, reference
from peak_memory import peak_extra_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_case(rows, branches, width, vocab, dtype, seed, padded=0):
    """Hidden states, an LM head (with `padded` extra rows) and, for K > 1, an expander whose
    offsets are small next to h (as in a trained DBLast head), scaled so logits are O(10)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=g)
    head = torch.randn(vocab + padded, width, generator=g) * (3.0 / width**0.5)
    case = dict(hidden=hidden.to(dtype), lm_head_weight=head.to(dtype))
    if branches > 1:
        case["expander_weight"] = (torch.randn(branches * width, width, generator=g) * (0.3 / width**0.5)).to(dtype)
        case["expander_bias"] = (torch.randn(branches * width, generator=g) * 0.1).to(dtype)
    return case


def float64(case):
    return {k: v.double() for k, v in case.items()}


def assert_matches_float64_reference(result, case, vocab_size=None):
    exact = float64(case)
    expected = reference.branch_argmax(**exact, vocab_size=vocab_size)
    states = reference.branch_states(exact["hidden"], exact.get("expander_weight"), exact.get("expander_bias"))
    vocab = vocab_size or case["lm_head_weight"].shape[0]
    logits = states @ exact["lm_head_weight"][:vocab].T
    tokens = result.tokens.cpu()
    assert tokens.shape == expected.tokens.shape and tokens.dtype == torch.int64
    assert ((tokens >= 0) & (tokens < vocab)).all()
    # float32 accumulation of H products: a token is right when its float64 logit is within
    # tolerance of the float64 maximum
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    best = logits.amax(-1)
    tol = 1e-4 * (1 + best.abs())
    assert ((best - chosen) <= tol).all(), (best - chosen).max()
    torch.testing.assert_close(result.max_logits.cpu(), expected.max_logits, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(result.logsumexp.cpu(), expected.logsumexp, rtol=1e-5, atol=1e-4)
    assert result.max_logits.dtype == result.logsumexp.dtype == torch.float32


def to_device(case, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("branches", [1, 2, 4, 8])
def test_matches_reference_across_branches_and_dtypes(device, branches, dtype):
    case = make_case(15, branches, 64, 1000, dtype, seed=branches)
    assert_matches_float64_reference(ops.branch_argmax(**to_device(case, device)), case)


# Each width and vocabulary appears with several row counts; the largest products keep
# N * K small so that the float64 reference stays quick on two cores. The LM heads of 50M
# elements and more (576 x 151,936, 2,560 x 49,152, 2,560 x 151,936) are the slow tier: drawing
# them, the half-precision kernels' float32 tile copies and the float64 reference's copy take
# 5-45 s each on two cores; every width and every vocabulary still appears in the fast tier.
SLOW = pytest.mark.slow
SHAPES = [
    # rows, branches, width, vocab
    (64, 4, 64, 1000), (15, 8, 64, 49152), (1, 4, 64, 151936),
    (64, 2, 576, 1000), (15, 4, 576, 49152), pytest.param(15, 1, 576, 151936, marks=SLOW),
    (1, 8, 2560, 1000), pytest.param(15, 1, 2560, 49152, marks=SLOW), pytest.param(1, 4, 2560, 151936, marks=SLOW),
    (64, 8, 64, 1000),  # N * K = 512 rows: several 64-row passes on the GPU
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,branches,width,vocab", SHAPES)
def test_matches_reference_across_shapes(device, rows, branches, width, vocab, dtype):
    case = make_case(rows, branches, width, vocab, dtype, seed=vocab + width)
    assert_matches_float64_reference(ops.branch_argmax(**to_device(case, device)), case)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_width_off_the_vector_loads_matches_the_reference(device, dtype):
    """H = 90: rows of H elements are not multiples of 16 bytes, the CUDA kernel's scalar path."""
    case = make_case(15, 4, 90, 1000, dtype, seed=90)
    assert_matches_float64_reference(ops.branch_argmax(**to_device(case, device)), case)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_lm_head_starting_inside_its_allocation_matches_the_reference(device, dtype):
    """An LM head one element into its buffer: not 16-byte aligned for vector loads."""
    case = make_case(15, 4, 64, 1000, dtype, seed=91)
    head = case["lm_head_weight"]
    buffer = torch.empty(head.numel() + 1, dtype=dtype)
    buffer[1:].copy_(head.reshape(-1))
    case = to_device(dict(case, lm_head_weight=buffer[1:].view(head.shape)), device)
    assert case["lm_head_weight"].storage_offset() == 1
    assert_matches_float64_reference(ops.branch_argmax(**case), {k: v.cpu() if isinstance(v, torch.Tensor) else v
                                                                 for k, v in case.items()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("branches", [1, 4])
def test_an_empty_batch_gives_empty_outputs(device, branches, dtype):
    case = make_case(0, branches, 64, 1000, dtype, seed=5)
    result = ops.branch_argmax(**to_device(case, device))
    assert result.tokens.shape == result.max_logits.shape == result.logsumexp.shape == (0, branches)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_vocabulary_smaller_than_a_tile_matches_the_reference(device, dtype):
    case = make_case(5, 4, 64, 50, dtype, seed=6)  # fewer tokens than the 64-column minimum tile
    assert_matches_float64_reference(ops.branch_argmax(**to_device(case, device)), case)


@pytest.mark.parametrize("vocab,padded", [(1000, 24), (151669, 267)])  # Qwen3: 151,669 tokens in 151,936 rows
def test_padding_rows_never_win_nor_count(device, vocab, padded):
    case = make_case(4, 2, 64, vocab, torch.float32, seed=3, padded=padded)
    # make a padding row the best match of every state: it must still be ignored
    case["lm_head_weight"][vocab] = case["hidden"][0] * 50
    result = ops.branch_argmax(**to_device(case, device), vocab_size=vocab)
    assert (result.tokens.cpu() < vocab).all()
    assert_matches_float64_reference(result, case, vocab_size=vocab)


# (vocab, low, high, tile_bytes): one tile, two of the CPU's small tiles, and, at a real
# vocabulary with 8 rows x 2 branches, two of the staged CUDA kernel's vocabulary tiles
TIES = [(5000, 10, 20, 64 * 4 * 8), (5000, 10, 4900, 64 * 4 * 8), (151669, 10, 151000, 0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,low,high,tile_bytes", TIES, ids=["same-tile", "other-tile", "real-vocab"])
def test_planted_tie_resolves_to_the_lower_id(device, vocab, low, high, tile_bytes, dtype):
    width = 32
    hidden = torch.zeros(8, width)
    hidden[:, 0] = 1.0  # logits are then exactly column 0 of the head, whatever the summation order
    head = torch.rand(vocab, width) * 4  # below 7.0 in every dtype; 7.0 is exact in all three
    head[low, 0] = head[high, 0] = 7.0
    expander_weight = torch.zeros(2 * width, width)  # both branches equal h: both tie
    expander_bias = torch.zeros(2 * width)
    args = [t.to(device, dtype) for t in (hidden, head, expander_weight, expander_bias)]
    result = ops.branch_argmax(*args, tile_bytes=tile_bytes)
    assert (result.tokens.cpu() == low).all()
    assert (result.max_logits.cpu() == 7.0).all()


# A real vocabulary (Qwen3: 151,669 tokens in 151,936 rows) with N * K large enough that the
# staged CUDA kernel walks it in several vocabulary tiles (its float32 logits workspace holds
# 16 MiB; the last tile is shorter), at a small H so that the float64 reference stays quick.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,branches", [(32, 1), (8, 4), (4, 8)])
def test_a_real_vocabulary_in_several_tiles_matches_the_reference(device, rows, branches, dtype):
    vocab = 151669
    case = make_case(rows, branches, 32, vocab, dtype, seed=branches + 40, padded=151936 - vocab)
    result = ops.branch_argmax(**to_device(case, device), vocab_size=vocab)
    assert_matches_float64_reference(result, case, vocab_size=vocab)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kernels", ["verified", "staged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cuda_graph_replay_matches_an_eager_call(kernels, dtype):
    """Captured once, replayed on new inputs copied into the captured tensors: no host sync,
    no allocation that outlives the capture, the same answer as an eager call."""
    rows, branches, width, vocab = 16, 4, 64, 151936  # several of the staged kernel's tiles
    with ops.using_cuda_kernels(kernels):
        static = to_device(make_case(rows, branches, width, vocab, dtype, seed=60), "cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream (cuBLAS handles, workspaces)
            for _ in range(2):
                ops.branch_argmax(**static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ops.branch_argmax(**static)
        fresh = to_device(make_case(rows, branches, width, vocab, dtype, seed=61), "cuda")
        for name, tensor in fresh.items():
            static[name].copy_(tensor)
        graph.replay()
        eager = ops.branch_argmax(**fresh)
        torch.cuda.synchronize()
    assert torch.equal(captured.tokens, eager.tokens)
    torch.testing.assert_close(captured.max_logits, eager.max_logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(captured.logsumexp, eager.logsumexp, rtol=1e-6, atol=1e-6)
    assert_matches_float64_reference(eager, {k: v.cpu() for k, v in fresh.items()})


def test_tile_size_does_not_change_the_answer():
    case = make_case(15, 4, 64, 10000, torch.bfloat16, seed=5)
    small = ops.branch_argmax(**case, tile_bytes=64 * 1024)
    default = ops.branch_argmax(**case)
    assert torch.equal(small.tokens, default.tokens)
    torch.testing.assert_close(small.logsumexp, default.logsumexp, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_keeps_at_most_an_eighth_of_the_logits_alive(dtype):
    rows, branches, width, vocab = 15, 4, 256, 151936
    case = make_case(rows, branches, width, vocab, dtype, seed=6)
    full_logits = rows * branches * vocab * 4
    extra = peak_extra_bytes(lambda: ops.branch_argmax(**case))
    assert extra <= full_logits / 8, f"peak extra {extra / 1e6:.1f} MB vs full logits {full_logits / 1e6:.1f} MB"


BAD_INPUTS = [
    ("hidden", lambda c: dict(c, hidden=c["hidden"][0])),
    ("hidden", lambda c: dict(c, hidden=c["hidden"].double())),
    ("lm_head_weight", lambda c: dict(c, lm_head_weight=c["lm_head_weight"][:, :10])),
    ("lm_head_weight", lambda c: dict(c, lm_head_weight=c["lm_head_weight"].half())),
    ("expander_weight", lambda c: dict(c, expander_weight=c["expander_weight"][:-1])),
    ("expander_weight", lambda c: dict(c, expander_weight=c["expander_weight"][:, :10])),
    ("expander_weight", lambda c: dict(c, expander_weight=c["expander_weight"].half())),
    ("expander_bias", lambda c: dict(c, expander_bias=c["expander_bias"][:-1])),
    ("expander_bias", lambda c: dict(c, expander_bias=c["expander_bias"].half())),
    ("given together", lambda c: dict(c, expander_bias=None)),
    ("vocab_size", lambda c: dict(c, vocab_size=0)),
    ("vocab_size", lambda c: dict(c, vocab_size=101)),
]


@pytest.mark.parametrize("name,mutate", BAD_INPUTS, ids=[f"{i}-{n}" for i, (n, _) in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(device, name, mutate):
    case = to_device(make_case(3, 2, 16, 100, torch.float32, seed=0), device)
    with pytest.raises(ValueError, match=name):
        ops.branch_argmax(**mutate(case))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mixing devices needs a GPU")
@pytest.mark.parametrize("name", ["lm_head_weight", "expander_weight", "expander_bias"])
def test_mixed_devices_name_the_argument(name):
    case = to_device(make_case(3, 2, 16, 100, torch.float32, seed=0), "cuda")
    case[name] = case[name].cpu()
    with pytest.raises(ValueError, match=name):
        ops.branch_argmax(**case)


@pytest.mark.parametrize("branches", [1, 4])
def test_opcheck(device, branches):
    case = to_device(make_case(5, branches, 32, 300, torch.float32, seed=8), device)
    args = (case["hidden"], case["lm_head_weight"], case.get("expander_weight"), case.get("expander_bias"), 290, 0)
    torch.library.opcheck(torch.ops.dblast.branch_argmax.default, args)

# torch.compile (aot_eager, inductor, dynamic shapes) and the fake kernel: test_ops_compile.py
