"""dblast::drafter_attention against its float64 specification (dblast_ext.reference.drafter_attention)."""
import itertools

import pytest
import torch

from dblast_ext import ops, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
             torch.float16: dict(atol=2e-3, rtol=2e-3)}


def make_case(rows, kv_heads, group, block, dim, max_len, dtype, seed, lens=None):
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if lens is None:  # ragged: an empty context, a full one, and random ones in between
        lens = [0, max_len] + torch.randint(1, max_len + 1, (max(rows - 2, 0),), generator=g).tolist()
    return dict(q=rand(rows, heads, block, dim), k_cache=rand(rows, kv_heads, max_len, dim),
                v_cache=rand(rows, kv_heads, max_len, dim), k_block=rand(rows, kv_heads, block, dim),
                v_block=rand(rows, kv_heads, block, dim),
                context_lens=torch.tensor(lens[:rows], dtype=torch.int32))


def to_device(case, device):
    return {k: v.to(device) for k, v in case.items()}


def check(case, device, **kwargs):
    out = ops.drafter_attention(**to_device(case, device), **kwargs)
    exact = {k: (v.double() if v.is_floating_point() else v) for k, v in case.items()}
    expected = reference.drafter_attention(**exact, **kwargs)
    dtype = case["q"].dtype
    assert out.dtype == dtype and out.shape == case["q"].shape
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCE[dtype])


CASES = list(itertools.product([1, 4, 8], [64, 128], [1, 16, 24]))


@pytest.mark.parametrize("group,dim,block", CASES)
def test_matches_reference(device, group, dim, block):
    i = CASES.index((group, dim, block))
    dtype, window = DTYPES[i % 3], [-1, 37, 300][i % 3]
    case = make_case(4, 2, group, block, dim, 300, dtype, seed=i)
    check(case, device, window=window, causal=i % 2 == 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [-1, 1, 5, 100, 5000])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group,block", [(1, 1), (3, 16)])
def test_windows_causal_and_dtypes(device, dtype, window, causal, group, block):
    """Every combination: a window shorter than the block (5) hides block keys too, and the
    window of 1 leaves each query only itself."""
    case = make_case(3, 2, group, block, 64, 700, dtype, seed=window % 97 + 7 * causal + group)
    check(case, device, window=window, causal=causal)


def test_reference_masks_are_dflash_sliding_and_causal_rules():
    """The specification's mask, one (query, key) pair at a time: a block query at position
    L + i sees context key p iff L + i - p < W, and block key j iff (not causal or j <= i) and
    |i - j| < W (W = -1: no window), the keys DFlash's sliding layers let a query see."""
    L, B = 6, 5
    for window, causal in itertools.product([-1, 1, 2, 4, 7], [False, True]):
        query = torch.arange(B)[:, None] + L
        context = reference.key_visible(query, torch.arange(L)[None, :], window=window, causal=causal)
        block = reference.key_visible(query, torch.arange(B)[None, :] + L, window=window, causal=causal)
        for i in range(B):
            for p in range(L):
                assert bool(context[i, p]) == (window < 0 or L + i - p < window), (window, causal, i, p)
            for j in range(B):
                want = (not causal or j <= i) and (window < 0 or abs(i - j) < window)
                assert bool(block[i, j]) == want, (window, causal, i, j)


@pytest.mark.parametrize("dim", [16, 32, 64, 96, 128, 256])
def test_every_supported_head_dim(device, dim):
    dtype = DTYPES[dim % 3]
    case = make_case(2, 2, 4, 16, dim, 200, dtype, seed=dim)
    check(case, device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the head-dim limit is the CUDA kernel's")
def test_unsupported_head_dim_on_cuda_names_q():
    case = to_device(make_case(2, 2, 2, 4, 48, 50, torch.float32, seed=0), "cuda")
    with pytest.raises(ValueError, match="q's head dim D must be one of 16, 32, 64, 96, 128, 256 on CUDA, got 48"):
        ops.drafter_attention(**case)


def test_long_context_and_custom_scale(device):
    case = make_case(2, 8, 4, 16, 128, 4096, torch.float32, seed=5, lens=[4096, 2500])
    check(case, device, scale=0.05)


def test_empty_context_attends_to_the_block_only(device):
    case = make_case(2, 2, 2, 8, 64, 50, torch.float32, seed=6, lens=[0, 0])
    out = ops.drafter_attention(**to_device(case, device))
    k = case["k_block"].repeat_interleave(2, dim=1)
    v = case["v_block"].repeat_interleave(2, dim=1)
    expected = torch.softmax(case["q"] @ k.transpose(-1, -2) / 8.0, dim=-1) @ v
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=1e-4)


def test_stale_cache_entries_beyond_the_length_are_ignored(device):
    case = make_case(2, 2, 4, 16, 64, 64, torch.float32, seed=7, lens=[20, 40])
    a = ops.drafter_attention(**to_device(case, device))
    case["k_cache"][0, :, 20:] = 1e4  # garbage past each row's length must not matter
    case["v_cache"][1, :, 40:] = float("nan")
    b = ops.drafter_attention(**to_device(case, device))
    assert torch.equal(a, b)


BAD_INPUTS = [
    ("q", lambda c: dict(c, q=c["q"][0])),
    ("q", lambda c: dict(c, q=c["q"].double())),
    ("q's heads .* multiple", lambda c: dict(c, q=c["q"][:, :3])),
    ("k_cache", lambda c: dict(c, k_cache=c["k_cache"][..., :32])),
    ("v_cache", lambda c: dict(c, v_cache=c["v_cache"][:, :, :10])),
    ("k_block", lambda c: dict(c, k_block=c["k_block"][:, :, :3])),
    ("v_block", lambda c: dict(c, v_block=c["v_block"].half())),
    ("context_lens", lambda c: dict(c, context_lens=c["context_lens"].long())),
    ("context_lens", lambda c: dict(c, context_lens=c["context_lens"][:1])),
    ("context_lens", lambda c: dict(c, context_lens=torch.tensor([5, 51], dtype=torch.int32))),
    ("context_lens", lambda c: dict(c, context_lens=torch.tensor([-1, 5], dtype=torch.int32))),
    ("window", lambda c: dict(c, window=0)),
    ("window", lambda c: dict(c, window=-2)),
    ("scale", lambda c: dict(c, scale=-1.0)),
]


@pytest.mark.parametrize("name,mutate", BAD_INPUTS, ids=[f"{i}-{n}" for i, (n, _) in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(device, name, mutate):
    case = to_device(make_case(2, 2, 2, 4, 64, 50, torch.float32, seed=0), device)
    bad = mutate(case)
    bad = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in bad.items()}
    with pytest.raises(ValueError, match=name):
        ops.drafter_attention(**bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mixing devices needs a GPU")
@pytest.mark.parametrize("name", ["k_cache", "v_cache", "k_block", "v_block", "context_lens"])
def test_mixed_devices_name_the_argument(name):
    case = to_device(make_case(2, 2, 2, 4, 64, 50, torch.float32, seed=0), "cuda")
    case[name] = case[name].cpu()
    with pytest.raises(ValueError, match=name):
        ops.drafter_attention(**case)


def test_opcheck(device):
    case = to_device(make_case(3, 2, 4, 8, 64, 40, torch.float32, seed=9), device)
    args = (case["q"], case["k_cache"], case["v_cache"], case["k_block"], case["v_block"], case["context_lens"],
            0.125, -1, False)
    torch.library.opcheck(torch.ops.dblast.drafter_attention.default, args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck_sliding_causal_half_precision(device, dtype):
    case = to_device(make_case(3, 2, 4, 8, 64, 40, dtype, seed=13), device)
    args = (case["q"], case["k_cache"], case["v_cache"], case["k_block"], case["v_block"], case["context_lens"],
            0.125, 6, True)
    torch.library.opcheck(torch.ops.dblast.drafter_attention.default, args)


def test_opcheck_with_a_strided_q(device):
    """q as the drafter makes it (heads and positions transposed): the fake output must be
    contiguous like the kernels' for torch.compile's stride bookkeeping."""
    case = to_device(make_case(3, 2, 4, 8, 64, 40, torch.float32, seed=10), device)
    q = case["q"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not q.is_contiguous()
    args = (q, case["k_cache"], case["v_cache"], case["k_block"], case["v_block"], case["context_lens"], 0.125, -1,
            False)
    torch.library.opcheck(torch.ops.dblast.drafter_attention.default, args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inputs_starting_inside_their_allocation_match_the_reference(device, dtype):
    """Views one element into a buffer (not 16-byte aligned for vector loads), as a slice of
    a larger cache would be."""
    case = make_case(3, 2, 4, 16, 64, 50, dtype, seed=12)

    def offset_view(t):
        buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
        view = buffer[1:].view(t.shape)
        view.copy_(t)
        return view

    shifted = {k: offset_view(v) if v.is_floating_point() else v.to(device) for k, v in case.items()}
    assert all(v.storage_offset() == 1 for k, v in shifted.items() if k != "context_lens")
    out = ops.drafter_attention(**shifted)
    exact = {k: (v.double() if v.is_floating_point() else v) for k, v in case.items()}
    torch.testing.assert_close(out.cpu().double(), reference.drafter_attention(**exact), **TOLERANCE[dtype])


# torch.compile (aot_eager, inductor, dynamic shapes) and the fake kernel: test_ops_compile.py


@pytest.mark.parametrize("dtype", DTYPES)
def test_transposed_views_match_the_reference(device, dtype):
    """q, k_block and v_block as the drafter passes them: views of [N, B, H, D] projections
    with heads and positions transposed (not contiguous)."""
    case = make_case(3, 2, 4, 16, 64, 50, dtype, seed=14)
    strided = {k: (v.transpose(1, 2).contiguous().transpose(1, 2).to(device) if k in ("q", "k_block", "v_block")
                   else v.to(device)) for k, v in case.items()}
    assert not any(strided[k].is_contiguous() for k in ("q", "k_block", "v_block"))
    out = ops.drafter_attention(**strided, window=9, causal=True)
    exact = {k: (v.double() if v.is_floating_point() else v) for k, v in case.items()}
    expected = reference.drafter_attention(**exact, window=9, causal=True)
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCE[dtype])


# Split-KV and tile edges. On CUDA the staged kernel cuts each row's keys into splits of whole
# 32-key tiles (at least 256 keys) from its real length, and the grid's split count from the
# shapes: with N = 8 rows of 2 KV heads and L_max = 3000 every long row spans several splits,
# the ragged lengths end inside tiles, an empty context leaves the block alone, and a window
# shorter than the context starts the keys mid-tile. B = 7 and B = 24 make query tiles of 56
# and 96 rows (a second, partial tile).
EDGE_LENS = [0, 1, 31, 32, 33, 257, 1500, 3000]
EDGE_CASES = [  # group, dim, dtype, window, causal, block
    (1, 64, torch.bfloat16, -1, False, 16),
    (4, 128, torch.bfloat16, -1, True, 16),
    (8, 128, torch.float16, 700, True, 16),
    (4, 64, torch.float16, 33, False, 16),
    (8, 64, torch.bfloat16, 1000, False, 7),
    (1, 128, torch.float16, 5, True, 16),
    (4, 128, torch.bfloat16, 2999, True, 24),
]


@pytest.mark.parametrize("group,dim,dtype,window,causal,block", EDGE_CASES,
                         ids=[f"g{c[0]}-d{c[1]}-{str(c[2])[6:]}-w{c[3]}-{'causal' if c[4] else 'full'}-b{c[5]}"
                              for c in EDGE_CASES])
def test_split_and_tile_edges_match_the_reference(device, group, dim, dtype, window, causal, block):
    case = make_case(8, 2, group, block, dim, 3000, dtype, seed=group * 1000 + dim + block, lens=EDGE_LENS)
    check(case, device, window=window, causal=causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_rows_in_a_large_cache(device, dtype):
    """The grid is sized from the cache's capacity (L_max = 8192), the work from the real
    lengths: rows far shorter than the cache still match."""
    case = make_case(3, 2, 4, 16, 128, 8192, dtype, seed=31, lens=[5, 300, 0])
    check(case, device, window=-1, causal=True)


def test_many_rows_one_split_each(device):
    """N * Hkv large enough to fill the GPU with one split per row (the staged kernel then
    normalises in place, no combine)."""
    case = make_case(40, 8, 4, 16, 64, 400, torch.bfloat16, seed=32)
    check(case, device, window=300, causal=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kernels", ["verified", "staged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_capture_replays_new_inputs(kernels, dtype):
    """The op captures into a torch.cuda.CUDAGraph (no host sync while capturing: the
    context_lens value check is skipped then) and a replay after copying new inputs, lengths
    included, into the captured tensors equals an eager call on them. float32 runs the
    verified kernel under either switch."""
    kwargs = dict(window=700, causal=True)
    with ops.using_cuda_kernels(kernels):
        static = to_device(make_case(4, 2, 4, 16, 128, 2000, dtype, seed=40, lens=[2000, 100, 0, 1333]), "cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graphs asks
            ops.drafter_attention(**static, **kwargs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ops.drafter_attention(**static, **kwargs)
        fresh = make_case(4, 2, 4, 16, 128, 2000, dtype, seed=41, lens=[7, 2000, 650, 0])
        for name, value in to_device(fresh, "cuda").items():
            static[name].copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        eager = ops.drafter_attention(**to_device(fresh, "cuda"), **kwargs)
        assert torch.equal(captured, eager)
    exact = {k: (v.double() if v.is_floating_point() else v) for k, v in fresh.items()}
    torch.testing.assert_close(captured.cpu().double(), reference.drafter_attention(**exact, **kwargs),
                               **TOLERANCE[dtype])
