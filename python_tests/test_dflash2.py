"""DFlash2 drafters (issue 46, first part): a checkpoint in the published layout loads (both codebook
spellings), round-trips through save, its convolutions and candidate selector compute what
dblast_ext.drafting.dflash2 says (against direct float64 loops), a DFlash2 drafter whose convolutions are
the identity and whose selector adds nothing drafts exactly what the DFlash drafter under it does,
and greedy decoding with a DFlash2 drafter gives the target's own greedy output."""
import json
import os

import numpy as np
import pytest
import torch

from dblast_ext import load_drafter, ops, reference
from dblast_ext.decoding.chain_cycle import SELECTOR_TREE_PATHS
from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder
from dblast_ext.drafting.dflash2 import CandidateSelector, GroupedDynamicConv, draft_logits
from dblast_ext.drafting.drafter_io import save_pretrained
from decoding_cases import PROMPT, hf_greedy
from losslessness import assert_committed_tokens_follow_p, chi_square_pvalue
from tiny_models import H, VOCAB, dflash2_config, dflash2_state, tiny_target, write_dflash2_checkpoint


@pytest.mark.parametrize("suffix", ["", ".weight"])
def test_a_published_layout_checkpoint_loads_with_either_codebook_spelling(tmp_path, suffix):
    drafter = load_drafter(write_dflash2_checkpoint(tmp_path / "d", codebook_suffix=suffix), target=tiny_target())
    c = drafter.config
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (2, 16, 8, 4)
    assert (c.output_multiplier, c.final_logit_softcapping, c.block_size, c.is_causal) == (0.5, 20.0, 4, False)
    state = dflash2_state()
    assert torch.equal(drafter.candidate_selector.predecessor_codebook,
                       state["candidate_selector.predecessor_codebook"])
    assert torch.equal(drafter.layers[1].mlp_conv.base_kernel, state["layers.1.mlp_conv.base_kernel"])


def test_a_dflash2_checkpoint_round_trips_through_save(tmp_path):
    drafter = load_drafter(write_dflash2_checkpoint(tmp_path / "d"))
    save_pretrained(drafter, str(tmp_path / "again"))
    config = json.load(open(tmp_path / "again" / "config.json"))
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                    "selector_top_k", "output_multiplier",
                                                    "final_logit_softcapping")} == {
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4,
        "output_multiplier": 0.5, "final_logit_softcapping": 20.0}
    again = load_drafter(str(tmp_path / "again"))
    assert again.config == drafter.config
    for (name, a), (_, b) in zip(sorted(drafter.state_dict().items()), sorted(again.state_dict().items())):
        assert torch.equal(a, b), name
    from safetensors import safe_open
    with safe_open(os.path.join(tmp_path, "again", "model.safetensors"), framework="pt") as f:
        assert "candidate_selector.successor_codebook" in f.keys()  # the published (bare) spelling


@pytest.mark.parametrize("change,message", [
    (dict(conv_group_size=None), "sets conv_kernel_size without conv_group_size"),
    (dict(conv_group_size=12), "conv_group_size 12 does not divide hidden_size 64"),
    (dict(selector_top_k=0), "selector_top_k must be a positive integer, got 0"),
    (dict(output_multiplier=-1), "output_multiplier must be a number > 0, got -1"),
])
def test_a_bad_dflash2_setting_is_named(tmp_path, change, message):
    from tiny_models import dflash2_config
    nested = {k: v for k, v in {**dflash2_config()["dflash_config"], **change}.items() if v is not None}
    path = write_dflash2_checkpoint(tmp_path / "d", dflash_config=nested)
    with pytest.raises(ValueError, match=message):
        load_drafter(path)


def test_the_convolution_is_the_grouped_dynamic_causal_sum():
    g = torch.Generator().manual_seed(3)
    conv = GroupedDynamicConv(H, 3, 16)
    with torch.no_grad():
        conv.base_kernel.copy_(torch.randn(2, 3, H, generator=g))
        conv.kernel_projection.weight.copy_(torch.randn(2 * 3 * 4, H, generator=g) / 8)
    x, y = torch.randn(2, 10, H, generator=g), torch.randn(2, 10, H, generator=g)
    taps = conv.taps(x)
    block = 5  # two blocks side by side: the taps restart at each block's first position
    for side in (0, 1):
        got = conv.apply(y, taps, side, block).double()
        dyn = taps.double().view(2, 10, 2, 3, 4)
        want = torch.zeros(2, 10, H, dtype=torch.float64)
        for t in range(10):
            for k in range(3):
                if t % block - k < 0:
                    continue
                for c in range(H):
                    want[:, t, c] += (conv.base_kernel[side, k, c].double() + dyn[:, t, side, k, c // 16]) \
                        * y[:, t - k, c].double()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    conv.make_identity()
    assert torch.equal(conv.apply(y, conv.taps(x), 1), y)


def test_the_selector_walks_the_best_scoring_candidate_from_the_anchor():
    g = torch.Generator().manual_seed(5)
    selector = CandidateSelector(H, VOCAB, 6, 5)
    with torch.no_grad():
        for p in selector.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    anchors, hidden = torch.tensor([3, 41]), torch.randn(2, 4, H, generator=g)
    logits = draft_logits(torch.randn(2, 4, VOCAB, generator=g) * 10, 0.5, 3.0)
    assert logits.abs().max() <= 3.0
    chain = selector.walk(anchors, hidden, logits).tokens
    for row in range(2):
        previous = int(anchors[row])
        for i in range(4):
            unary, candidates = logits[row, i].double().topk(5)
            projected = selector.hidden_projection.weight.double() @ hidden[row, i].double()
            scores = [float(u) + float((selector.predecessor_codebook[previous].double() * projected)
                                       @ selector.successor_codebook[c].double()) for u, c in zip(unary, candidates)]
            previous = int(candidates[max(range(5), key=lambda j: (scores[j], -j))])
            assert int(chain[row, i]) == previous


def test_the_selectors_best_paths_are_its_chain_then_its_likeliest_paths():
    """best_paths (the trie's proposal): the greedy chain first, then the beam; a beam as wide as
    every path (k^b) keeps them all, so it must list the exact top paths by the product of
    softmax(score) at each position, found here by enumerating every path in float64."""
    import itertools

    selector, g = _random_selector(11, top_k=3)
    anchors, hidden = torch.tensor([3, 41]), torch.randn(2, 3, H, generator=g)
    logits = torch.randn(2, 3, VOCAB, generator=g) * 2
    paths, probs = selector.best_paths(anchors, hidden, logits, width=27)
    assert paths.shape == (2, 28, 3) and probs.shape == (2, 28)
    assert torch.equal(paths[:, 0], selector.walk(anchors, hidden, logits).tokens)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    for row in range(2):
        projected = selector.hidden_projection.weight.double() @ hidden[row].double().T   # [R, b]
        unary, candidates = logits[row].double().topk(3)

        def logq(previous, i):
            query = selector.predecessor_codebook[previous].double() * projected[:, i]
            scores = unary[i] + selector.successor_codebook[candidates[i]].double() @ query
            return torch.log_softmax(scores, -1)

        every = {}
        for slots in itertools.product(range(3), repeat=3):
            previous, total, path = int(anchors[row]), 0.0, []
            for i, slot in enumerate(slots):
                total += float(logq(previous, i)[slot])
                previous = int(candidates[i, slot])
                path.append(previous)
            every[tuple(path)] = total
        ranked = sorted(every.values(), reverse=True)
        beam = [every[tuple(p)] for p in paths[row, 1:].tolist()]
        assert np.allclose(beam, ranked, atol=1e-4)                       # the top paths, best first
        weights = np.exp([every[tuple(p)] for p in paths[row].tolist()])
        assert np.allclose(probs[row].numpy(), weights / weights.sum(), atol=1e-5)
    narrow, _ = selector.best_paths(anchors, hidden, logits, width=2)
    assert narrow.shape == (2, 3, 3) and torch.equal(narrow[:, 1:], paths[:, 1:3])


def _random_selector(seed: int, rank: int = 6, top_k: int = 5):
    """Parameters small enough that the pair term moves q without making it a point mass."""
    g = torch.Generator().manual_seed(seed)
    selector = CandidateSelector(H, VOCAB, rank, top_k)
    with torch.no_grad():
        for p in selector.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return selector, g


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_the_sampled_walk_draws_each_token_from_the_softmax_of_the_scores(temperature):
    """At T > 0 the chain keeps q_i = softmax(score_i / T) over the candidates it drew from, and
    the drawn tokens follow q (one row repeated: each row's own draws)."""
    selector, g = _random_selector(7)
    rows = 20000
    anchors = torch.full((rows,), 3)
    hidden = torch.randn(1, 2, H, generator=g).expand(rows, -1, -1)
    logits = draft_logits(torch.randn(1, 2, VOCAB, generator=g) * 2, 1.0, None).expand(rows, -1, -1)
    chain = selector.walk(anchors, hidden, logits, temperature=temperature,
                          generator=torch.Generator().manual_seed(8))
    unary, candidates = logits[0, 0].double().topk(5)
    projected = selector.hidden_projection.weight.double() @ hidden[0, 0].double()
    scores = unary + selector.successor_codebook[candidates].double() @ (
        selector.predecessor_codebook[3].double() * projected)
    torch.testing.assert_close(chain.probs[0, 0].double(), torch.softmax(scores / temperature, -1), atol=1e-5,
                               rtol=0)
    assert torch.equal(chain.candidates[0, 0], candidates)
    counts = np.array([(chain.tokens[:, 0] == c).sum().item() for c in candidates.tolist()])
    assert chi_square_pvalue(counts, chain.probs[0, 0].double().numpy() * rows) > 1e-3
    # position 2's q depends on the token drawn before it, row by row
    first, second = [candidates[j] for j in np.argsort(-counts)[:2]]
    assert not torch.equal(chain.probs[chain.tokens[:, 0] == first][0, 1],
                           chain.probs[chain.tokens[:, 0] == second][0, 1])


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_a_sampled_chain_verified_by_sparse_verify_commits_the_targets_distribution(temperature):
    """The selector's sampled chains, verified against the proposal they were drawn from, commit
    tokens that follow the target's filtered distribution at every position."""
    selector, g = _random_selector(9, top_k=6)
    rows, b = 80000, 3
    hidden = torch.randn(1, b, H, generator=g).expand(rows, -1, -1)
    target = torch.randn(1, b + 1, VOCAB, generator=g) * 2
    drafter = target[:, :b] + torch.randn(1, b, VOCAB, generator=g)  # a drafter that roughly agrees
    logits = draft_logits(drafter, 1.0, None).expand(rows, -1, -1)
    chain = selector.walk(torch.full((rows,), 5), hidden, logits, temperature=temperature,
                          generator=torch.Generator().manual_seed(10))
    target_logits = target.expand(rows, -1, -1).contiguous()
    settings = dict(temperature=temperature, top_k=0, top_p=0.95)
    result = ops.sparse_verify(target_logits, chain.tokens, chain.candidates, chain.probs,
                               generator=torch.Generator().manual_seed(11), **settings)
    p = reference.filter_target_probs(target_logits[0], **settings)
    # every position, the bonus token's included, reached by at least 2,000 rows (about 2.9% of
    # the rows at T 1.5, the fewest), or this fails
    assert_committed_tokens_follow_p(p, result.num_accepted, result.output_tokens, min_rows=2000)


def test_identity_convolutions_and_a_silent_selector_draft_what_dflash_does(tmp_path):
    target = tiny_target()
    dflash2 = load_drafter(write_dflash2_checkpoint(tmp_path / "d"), target=target)
    dflash = load_drafter(write_dflash2_checkpoint(tmp_path / "d1"), target=target)
    with torch.no_grad():
        for layer in dflash2.layers:
            layer.attention_conv.make_identity()
            layer.mlp_conv.make_identity()
        dflash2.candidate_selector.predecessor_codebook.zero_()
    del dflash.candidate_selector  # the same weights as a DFlash drafter: convolutions off, argmax drafts
    for layer in dflash.layers:
        del layer.attention_conv, layer.mlp_conv
    outs = [SpeculativeDecoder(target, d, controller="off").generate(PROMPT, SamplingParams(0.0), max_new_tokens=16)
            for d in (dflash2, dflash)]
    assert [c.num_accepted for c in outs[0].cycles] == [c.num_accepted for c in outs[1].cycles]
    assert outs[0].token_ids == outs[1].token_ids


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("verify", ["branch", "tree"])
def test_greedy_output_with_a_dflash2_drafter_equals_the_targets_own(tmp_path, family, verify):
    target = tiny_target(family)
    drafter = load_drafter(write_dflash2_checkpoint(tmp_path / "d"), target=target)
    decoder = SpeculativeDecoder(target, drafter, verify=verify, controller="off")
    assert decoder.generate(PROMPT, SamplingParams(0.0), max_new_tokens=24).token_ids == hf_greedy(target, PROMPT, 24)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_cycles_are_the_published_reference_loops(tmp_path, family):
    """Cycle by cycle at T = 0, the drafts, the accepted lengths and the tokens are those of a
    loop written in the order of z-lab's published reference (dflash2_reference_loop.py): no
    caches there, the decode loop's caches and kernels here. The reference drafts a shorter block
    near the length limit, where this loop drafts the whole block and keeps what fits: the
    cycles before the limit are compared."""
    from dflash2_reference_loop import reference_greedy

    target = tiny_target(family)
    drafter = load_drafter(write_dflash2_checkpoint(tmp_path / "d"), target=target)
    decoder = SpeculativeDecoder(target, drafter, controller="off")
    drafted = []
    propose = decoder.proposer.propose

    def spy(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        drafted.append(proposal.branch_tokens[0, 0].tolist())
        return proposal

    decoder.proposer.propose = spy
    out = decoder.generate(PROMPT, SamplingParams(0.0), max_new_tokens=40)
    tokens, cycles = reference_greedy(target, drafter, PROMPT, 40)
    assert out.token_ids == tokens
    block = drafter.config.block_size
    full = [i for i, (drafts, _) in enumerate(cycles) if len(drafts) == block - 1]
    assert len(full) >= 8
    assert [drafted[i] for i in full] == [cycles[i][0] for i in full]
    assert [out.cycles[i].num_accepted for i in full] == [cycles[i][1] for i in full]


def test_sampling_with_a_dflash2_drafter_runs_and_is_reproducible(tmp_path):
    target = tiny_target()
    drafter = load_drafter(write_dflash2_checkpoint(tmp_path / "d"), target=target)
    decoder = SpeculativeDecoder(target, drafter, draft_vocab=60, controller="off")
    runs = [decoder.generate(PROMPT, SamplingParams(1.0, 20, 0.9), max_new_tokens=16, seed=4).token_ids
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 16


def small_dflash2_decoder(tmp_path, **kwargs):
    """A DFlash2 drafter on a 16-token target whose LM head is peaked (top token ~0.6); the
    selector's candidates are the whole vocabulary and its scores small (multiplier 0.05,
    codebooks / 10), so q is spread out and the chains are accepted often enough to reach the
    sparse residual at every position."""
    from decoding_cases import MASK, SMALL_VOCAB

    target = tiny_target(vocab_size=SMALL_VOCAB, layers=2)
    target.generation_config.eos_token_id = None
    with torch.no_grad():
        target.lm_head.weight.mul_(12.0)
    path = write_dflash2_checkpoint(
        tmp_path / "small", vocab_size=SMALL_VOCAB,
        dflash_config={**dflash2_config()["dflash_config"], "mask_token_id": MASK, "target_layer_ids": [0, 1],
                       "selector_top_k": SMALL_VOCAB, "output_multiplier": 0.05})
    drafter = load_drafter(path, target=target)
    with torch.no_grad():
        drafter.candidate_selector.predecessor_codebook.div_(10)
    kwargs.setdefault("controller", "off")
    return SpeculativeDecoder(target, drafter, **kwargs)


@pytest.mark.parametrize("sampling,samples", [
    (SamplingParams(0.7, 6, 0.9), 600), (SamplingParams(1.0, 0, 1.0), 600), (SamplingParams(1.5, 0, 0.95), 600),
    pytest.param(SamplingParams(0.7, 6, 0.9), 3000, marks=pytest.mark.slow),
    pytest.param(SamplingParams(1.0, 0, 1.0), 3000, marks=pytest.mark.slow),
    pytest.param(SamplingParams(1.5, 0, 0.95), 3000, marks=pytest.mark.slow),
], ids=lambda v: f"T{v.temperature}-k{v.top_k}-p{v.top_p}" if isinstance(v, SamplingParams) else str(v))
def test_sampled_chains_commit_the_targets_distribution_at_every_position(tmp_path, sampling, samples):
    """The loop with a DFlash2 drafter at T > 0: chains sampled by the selector, verified by
    sparse_verify; the first four committed tokens follow the target's filtered joint. (A trie of
    the selector's paths is a fixed trie, whose walk test_trie.py shows exact.)"""
    from decoding_cases import SMALL_PROMPT, exact_prefix_joint

    decoder = small_dflash2_decoder(tmp_path)
    length = 4
    exact = exact_prefix_joint(decoder.target.model, SMALL_PROMPT, sampling, length)
    counts = np.zeros_like(exact)
    accepted = []
    for seed in range(samples):
        out = decoder.generate(SMALL_PROMPT, sampling, max_new_tokens=length, seed=seed)
        counts[tuple(out.token_ids[:length])] += 1
        accepted.append(out.cycles[0].num_accepted)
    assert np.mean(np.array(accepted) >= 1) > 0.1  # drafts accepted: the sparse residual is exercised
    assert counts[exact == 0].sum() == 0
    assert chi_square_pvalue(counts.ravel(), exact.ravel() * samples) > 1e-3
    for position in range(1, length):
        axes = tuple(a for a in range(length) if a != position)
        assert chi_square_pvalue(counts.sum(axes), exact.sum(axes) * samples) > 1e-3, position


def test_the_sampled_chain_goes_to_sparse_verify_and_the_trie_takes_the_best_paths(tmp_path, monkeypatch):
    calls = []
    sparse = ops.sparse_verify
    monkeypatch.setattr(ops, "sparse_verify", lambda *a, **k: calls.append("sparse") or sparse(*a, **k))
    decoder = small_dflash2_decoder(tmp_path)
    from decoding_cases import SMALL_PROMPT

    first = decoder.generate(SMALL_PROMPT, SamplingParams(1.0), max_new_tokens=12, seed=5)
    assert calls and decoder.proposer.selector_temperature == 1.0
    again = decoder.generate(SMALL_PROMPT, SamplingParams(1.0), max_new_tokens=12, seed=5)
    assert again.token_ids == first.token_ids  # the chain's draws come from the row's generator
    calls.clear()
    decoder.generate(SMALL_PROMPT, SamplingParams(0.0), max_new_tokens=12)
    assert not calls and decoder.proposer.selector_temperature == 0.0
    tree = small_dflash2_decoder(tmp_path, verify="tree")
    tree.generate(SMALL_PROMPT, SamplingParams(1.0), max_new_tokens=12, seed=5)
    assert not calls and tree.proposer.selector_temperature == 0.0
    assert tree.proposer.selector_paths == SELECTOR_TREE_PATHS
    assert max(c.tree_nodes for c in tree.generate(SMALL_PROMPT, SamplingParams(1.0), max_new_tokens=12,
                                                   seed=5).cycles) > tree.proposer.block_size - 1


def test_branches_are_refused_on_a_dflash2_drafter(tmp_path):
    with pytest.raises(ValueError, match="DFlash2 drafter drafts one chain"):
        load_drafter(write_dflash2_checkpoint(tmp_path / "d"), num_branches=4)


def test_dblast_serve_hands_a_dflash2_drafter_to_vllm_or_names_the_version_needed(tmp_path, monkeypatch):
    from dblast_ext.cli import build_parser
    from dblast_ext.cli import serve

    path = write_dflash2_checkpoint(tmp_path / "d")
    args = build_parser().parse_args(["serve", "--drafter", path])
    monkeypatch.setattr(serve, "installed_vllm_version", lambda: (0, 32, 0))
    argv, env = serve.serve_command(args)
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config == {"method": "dflash", "model": path, "num_speculative_tokens": 3} and not env
    monkeypatch.setattr(serve, "installed_vllm_version", lambda: (0, 27, 2))
    with pytest.raises(ValueError, match=r"DFlash2 drafter: vLLM serves those from version 0\.28\.0 on; this "
                                         r"environment has vLLM 0\.27\.2"):
        serve.serve_command(args)


def published_config(hidden, intermediate, vocab, block, mask, layer_ids, target_layers, **nested):
    """A published 5-layer DFlash2 config.json (the sizes of z-lab's Qwen3.8-27B and
    Muse-Glimmer-30B drafters), as written there."""
    return {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": hidden,
            "intermediate_size": intermediate, "num_hidden_layers": 5, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_theta": 1e7, "rope_type": "default"}, "layer_types": ["sliding_attention"] * 5,
            "sliding_window": 2048, "use_sliding_window": True, "max_window_layers": 5, "is_causal": False,
            "num_target_layers": target_layers, "vocab_size": vocab, "tie_word_embeddings": False,
            "attention_bias": False, "dtype": "bfloat16",
            "dflash_config": {"block_size": block, "mask_token_id": mask, "target_layer_ids": layer_ids,
                              "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                              "selector_top_k": 16, **nested}}


@pytest.mark.parametrize("raw,shapes", [
    (published_config(5120, 17408, 248320, 8, 248070, [5, 19, 33, 47, 61], 64),
     {"fc.weight": (5120, 25600), "layers.4.attention_conv.kernel_projection.weight": (1280, 5120),
      "layers.0.mlp_conv.base_kernel": (2, 2, 5120), "candidate_selector.predecessor_codebook": (248320, 256),
      "candidate_selector.hidden_projection.weight": (256, 5120)}),
    (published_config(6656, 19968, 202048, 16, 201818, [1, 13, 25, 37, 49], 52,
                      output_multiplier=0.19611613513818404, final_logit_softcapping=20.0),
     {"fc.weight": (6656, 33280), "layers.2.mlp_conv.kernel_projection.weight": (1664, 6656),
      "candidate_selector.successor_codebook": (202048, 256)}),
])
def test_the_published_five_layer_configs_build_the_published_shapes(raw, shapes):
    from dblast_ext.drafting.drafter import DBlastDrafter
    from dblast_ext.drafting.drafter_io import config_from_json

    config = config_from_json(raw)
    assert config.is_dflash2 and config.block_size == raw["dflash_config"]["block_size"] and config.rope_theta == 1e7
    assert [config.causal(i) for i in range(5)] == [False] * 5 and config.window(0) == 2048
    with torch.device("meta"):  # the sizes only: a 27B target's drafter is 3.8 GB
        state = DBlastDrafter(config).state_dict()
    assert len(state) == 81  # 15 per layer, fc, hidden_norm, norm and the selector's three
    for name, shape in shapes.items():
        assert tuple(state[name].shape) == shape, name


def test_the_drafter_family_is_named_by_the_parts_a_checkpoint_has(tmp_path):
    from tiny_models import write_dflash_checkpoint

    assert load_drafter(write_dflash2_checkpoint(tmp_path / "d2")).config.family == "dflash2"
    dflash = load_drafter(write_dflash_checkpoint(tmp_path / "d1"))
    assert dflash.config.family == "dflash"
    dflash.add_branch_head(4)
    assert dflash.config.family == "dblast"
