"""Training losses against direct hand computations, finite differences and the unchunked
LM-head computation."""
import math

import pytest
import torch

from dblast_ext.training.losses import (CPU_CHUNK_LOGITS, GPU_CHUNK_ROWS, accepted_length_surrogate,
                                        auto_chunk_rows, autocast_lm_head, decay_weights, distillation_loss,
                                        flat_step_weights, gather_branch_logprobs, nll_independent, nll_mixture)
from peak_memory import peak_extra_bytes


def random_case(seed, blocks=3, K=4, b=5, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    prior = torch.randn(blocks, K, generator=g, dtype=torch.float64)
    branch = -torch.rand(blocks, K, b, generator=g, dtype=torch.float64) * 3 * spread
    target = -torch.rand(blocks, b, generator=g, dtype=torch.float64) * 2 * spread
    return prior, branch, target


def valid_length(row):
    n = 0
    for m in row:
        if not m:
            break
        n += 1
    return n


def test_nll_independent_by_hand_with_leading_valid_positions():
    lp = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-0.5, -0.5, -0.5, -0.5]])
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])  # the first block's valid positions: 1, 2
    assert nll_independent(lp, mask).item() == pytest.approx(((1 + 2) + 2.0) / 2)
    w = flat_step_weights(4, boundary=3, weight=3.0)
    assert w.tolist() == [1, 1, 3, 3]
    assert nll_independent(lp, mask, w).item() == pytest.approx(((1 + 2) + (0.5 + 0.5 + 1.5 + 1.5)) / 2)


def test_nll_mixture_by_hand_and_k1_equals_independent():
    prior, branch, _ = random_case(0)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 1]])
    expected = 0.0
    for n in range(3):
        pi = torch.softmax(prior[n], -1)
        m = valid_length(mask[n].tolist())
        expected += -math.log(sum(float(pi[z]) * math.exp(float(branch[n, z, :m].sum())) for z in range(4)))
    assert nll_mixture(prior, branch, mask).item() == pytest.approx(expected / 3, rel=1e-12)
    one = branch[:, :1]
    assert nll_mixture(prior[:, :1], one, mask).item() == pytest.approx(nll_independent(one[:, 0], mask).item())


def al_by_hand(prior, branch, target, mask, tau, variant):
    """Eq 10-12 by the posterior update, Eq 14-15 in probability space, one block at a time."""
    blocks, K, b = branch.shape
    total = 0.0
    for n in range(blocks):
        m = valid_length(mask[n].tolist())
        post = torch.softmax(prior[n], -1).tolist()
        q_prefix = p_prefix = 1.0
        survive, s, terms, log_r = 1.0, 0.0, [], []
        for i in range(m):
            qi = sum(post[z] * math.exp(float(branch[n, z, i])) for z in range(K))
            pi = math.exp(float(target[n, i]))
            post = [post[z] * math.exp(float(branch[n, z, i])) / qi for z in range(K)]  # Eq 11
            q_prefix, p_prefix = q_prefix * qi, p_prefix * pi
            survive *= min(1.0, pi / qi)
            s += survive
            log_r.append(math.log(q_prefix / p_prefix))
            terms.append(math.log(q_prefix / p_prefix) + math.log(s))
        if m == 0:
            continue
        below = [l for l in range(m) if tau > 0 and log_r[l] < math.log(tau)]
        l_tau = below[0] if below else m - 1
        if variant == "all_prefixes":
            total += sum(terms[: l_tau + 1])
        elif variant == "one_prefix":
            total += terms[l_tau]
        else:
            total += terms[m - 1]
    return -total / blocks


@pytest.mark.parametrize("variant", ["all_prefixes", "one_prefix", "whole_block"])
@pytest.mark.parametrize("tau", [0.0, 0.1, 0.5, 1e9])
def test_accepted_length_surrogate_by_hand(variant, tau):
    for seed in range(4):
        prior, branch, target = random_case(seed, spread=0.6)
        mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 1], [0, 1, 1, 1, 1]])
        got = accepted_length_surrogate(prior, branch, target, mask, tau=tau, variant=variant).item()
        assert got == pytest.approx(al_by_hand(prior, branch, target, mask, tau, variant), rel=1e-10, abs=1e-12)


def test_surrogate_variants_coincide_where_the_paper_says():
    prior, branch, target = random_case(7)
    mask = torch.ones(3, 5)
    args = (prior, branch, target, mask)
    # tau = 0 keeps every prefix: one_prefix is then the whole block
    assert accepted_length_surrogate(*args, tau=0, variant="one_prefix").item() == pytest.approx(
        accepted_length_surrogate(*args, tau=0, variant="whole_block").item())
    # a huge tau stops at the first prefix: all_prefixes keeps only l = 1
    assert accepted_length_surrogate(*args, tau=1e9, variant="all_prefixes").item() == pytest.approx(
        accepted_length_surrogate(*args, tau=1e9, variant="one_prefix").item())


def test_k1_surrogate_uses_the_independent_conditionals():
    _, branch, target = random_case(3, K=1)
    mask = torch.ones(3, 5)
    got = accepted_length_surrogate(torch.zeros(3, 1, dtype=torch.float64), branch, target, mask, tau=0.0,
                                    variant="whole_block")
    log_a = torch.clamp(target - branch[:, 0], max=0)
    log_s = torch.log(torch.exp(torch.cumsum(log_a, -1)).sum(-1))
    expected = -((branch[:, 0] - target).sum(-1) + log_s).mean()
    assert got.item() == pytest.approx(expected.item())


@pytest.mark.parametrize("variant", ["all_prefixes", "one_prefix", "whole_block"])
def test_gradients_match_finite_differences(variant):
    prior, branch, target = random_case(11, blocks=2, K=3, b=4, spread=0.5)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    prior.requires_grad_(True)
    branch.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda p, q: accepted_length_surrogate(p, q, target, mask, tau=0.3, variant=variant), (prior, branch))
    assert torch.autograd.gradcheck(lambda p, q: nll_mixture(p, q, mask), (prior, branch))
    assert torch.autograd.gradcheck(lambda q: nll_independent(q[:, 0], mask, decay_weights(4, 0.8).double()),
                                    (branch,))


def test_losses_stay_finite_on_extreme_inputs():
    prior = torch.tensor([[80.0, -80.0, 0.0]], requires_grad=True)
    branch = torch.tensor([[[-1e4, -3.0, -2e3], [-0.0, -5e3, -1e-9], [-50.0, -50.0, -50.0]]], requires_grad=True)
    target = torch.tensor([[-1e-7, -9e3, -30.0]])
    for variant in ("all_prefixes", "one_prefix", "whole_block"):
        loss = accepted_length_surrogate(prior, branch, target, torch.ones(1, 3), variant=variant)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(prior.grad).all() and torch.isfinite(branch.grad).all()
    assert torch.isfinite(nll_mixture(prior, branch, torch.ones(1, 3)))


def test_bad_shapes_and_settings_fail_clearly():
    prior, branch, target = random_case(0)
    with pytest.raises(ValueError, match="variant"):
        accepted_length_surrogate(prior, branch, target, torch.ones(3, 5), variant="prefix")
    with pytest.raises(ValueError, match="target_logprobs"):
        accepted_length_surrogate(prior, branch, target[:, :4], torch.ones(3, 5))
    with pytest.raises(ValueError, match="mask"):
        nll_independent(target, torch.ones(3, 4))
    with pytest.raises(ValueError, match="prior_logits"):
        nll_mixture(prior[:, :2], branch, torch.ones(3, 5))
    with pytest.raises(ValueError, match="position_weights"):
        nll_independent(target, torch.ones(3, 5), torch.ones(4))


def test_decay_weights_are_dflash_exponentials():
    assert decay_weights(4, 7.0).tolist() == pytest.approx([1.0, math.exp(-1 / 7), math.exp(-2 / 7), math.exp(-3 / 7)])
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    w = decay_weights(3, 2.0)
    expected = 1.0 + 2.0 * math.exp(-0.5) + 3.0 * math.exp(-1.0)
    assert nll_independent(lp, torch.ones(1, 3), w).item() == pytest.approx(expected)
    with pytest.raises(ValueError, match="gamma"):
        decay_weights(3, 0.0)


def distillation_by_hand(prior, branch, topk, teacher, mask, weights):
    """Per block: sum_i w_i * -sum_v p~_i(v) log sum_z pi(z | x_<i) q_i(v | z), the posterior
    updated one label at a time, in plain floats."""
    blocks, K, b, k = topk.shape
    total = 0.0
    for n in range(blocks):
        post = torch.softmax(prior[n], -1).tolist()
        for i in range(valid_length(mask[n].tolist())):
            p = [math.exp(float(teacher[n, i, v])) for v in range(k)]
            p = [x / sum(p) for x in p]
            q = [sum(post[z] * math.exp(float(topk[n, z, i, v])) for z in range(K)) for v in range(k)]
            total += float(weights[i]) * -sum(p[v] * math.log(q[v]) for v in range(k))
            label = [post[z] * math.exp(float(branch[n, z, i])) for z in range(K)]
            post = [x / sum(label) for x in label]
    return total / blocks


@pytest.mark.parametrize("K", [1, 3])
def test_distillation_loss_by_hand(K):
    g = torch.Generator().manual_seed(1)
    blocks, b, k = 3, 4, 5
    prior = torch.randn(blocks, K, generator=g, dtype=torch.float64)
    branch = -torch.rand(blocks, K, b, generator=g, dtype=torch.float64) * 3
    topk = -torch.rand(blocks, K, b, k, generator=g, dtype=torch.float64) * 4
    teacher = -torch.rand(blocks, b, k, generator=g, dtype=torch.float64) * 5   # not normalised over the k ids
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1], [1, 0, 0, 0]])
    weights = decay_weights(b, 3.0).double()
    got = distillation_loss(prior, branch, topk, teacher, mask, weights).item()
    assert got == pytest.approx(distillation_by_hand(prior, branch, topk, teacher, mask, weights), rel=1e-12)


def test_distillation_on_a_one_hot_target_is_the_mixture_nll():
    """With all the target's mass on the label, the soft term is Eq 8: its conditionals
    multiply to the mixture likelihood."""
    prior, branch, _ = random_case(2)
    g = torch.Generator().manual_seed(2)
    others = -torch.rand(*branch.shape, 3, generator=g, dtype=torch.float64) * 4
    topk = torch.cat([branch.unsqueeze(-1), others], -1)                       # id 0 is the label
    teacher = torch.tensor([0.0, -1e4, -1e4, -1e4], dtype=torch.float64).expand(3, 5, 4)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 1]])
    assert distillation_loss(prior, branch, topk, teacher, mask).item() == \
        pytest.approx(nll_mixture(prior, branch, mask).item(), rel=1e-10)


def test_distillation_gradients_match_finite_differences():
    prior, branch, _ = random_case(4, blocks=2, K=2, b=3)
    g = torch.Generator().manual_seed(4)
    topk = -torch.rand(2, 2, 3, 4, generator=g, dtype=torch.float64) * 2
    teacher = -torch.rand(2, 3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    inputs = tuple(t.clone().requires_grad_() for t in (prior, branch, topk))
    assert torch.autograd.gradcheck(lambda p, q, t: distillation_loss(p, q, t, teacher, mask), inputs)


def test_distillation_shapes_are_checked():
    prior, branch, _ = random_case(0)
    topk, teacher = torch.zeros(3, 4, 5, 2), torch.zeros(3, 5, 2)
    with pytest.raises(ValueError, match="teacher_topk_logprobs"):
        distillation_loss(prior, branch, topk, teacher[:, :4], torch.ones(3, 5))
    with pytest.raises(ValueError, match="branch_topk_logprobs"):
        distillation_loss(prior, branch, topk[:, :, :4], teacher, torch.ones(3, 5))


def direct_logprobs(hidden, lm_head, labels, ew=None, eb=None):
    states = hidden.unsqueeze(-2)
    if ew is not None:
        K = ew.shape[0] // hidden.shape[-1]
        states = states + (hidden @ ew.T + eb).view(*hidden.shape[:-1], K, hidden.shape[-1])
    logp = torch.log_softmax(states @ lm_head.T, -1)
    return logp.gather(-1, labels[..., None, None].expand(*labels.shape, states.shape[-2], 1)).squeeze(-1)


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("branches", [1, 4])
def test_gather_branch_logprobs_equals_the_unchunked_computation(branches, recompute):
    g = torch.Generator().manual_seed(0)
    H, V = 16, 50
    hidden = torch.randn(2, 7, H, generator=g, requires_grad=True)
    lm_head = torch.randn(V + 6, H, generator=g) / 4  # 6 padded rows, dropped by vocab_size
    labels = torch.randint(0, V, (2, 7), generator=g)
    ew = (torch.randn(branches * H, H, generator=g) * 0.2).requires_grad_() if branches > 1 else None
    eb = (torch.randn(branches * H, generator=g) * 0.1).requires_grad_() if branches > 1 else None
    got = gather_branch_logprobs(hidden, lm_head, labels, ew, eb, chunk_size=3, vocab_size=V, recompute=recompute)
    want = direct_logprobs(hidden, lm_head[:V], labels, ew, eb)
    assert got.shape == (2, 7, branches)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    params = [t for t in (hidden, ew, eb) if t is not None]
    weights = torch.randn(got.shape, generator=g)
    grads_got = torch.autograd.grad((got * weights).sum(), params)
    grads_want = torch.autograd.grad((want * weights).sum(), params)
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("branches", [1, 4])
def test_several_ids_per_row_equal_the_unchunked_computation(branches, recompute):
    """The label and the target's top-k of every row from one pass: [..., K, J]."""
    g = torch.Generator().manual_seed(1)
    H, V, J = 16, 50, 6
    hidden = torch.randn(2, 7, H, generator=g, requires_grad=True)
    lm_head = torch.randn(V, H, generator=g) / 4
    ids = torch.randint(0, V, (2, 7, J), generator=g)
    ew = (torch.randn(branches * H, H, generator=g) * 0.2).requires_grad_() if branches > 1 else None
    eb = (torch.randn(branches * H, generator=g) * 0.1).requires_grad_() if branches > 1 else None
    got = gather_branch_logprobs(hidden, lm_head, ids, ew, eb, chunk_size=4, recompute=recompute)
    want = torch.stack([direct_logprobs(hidden, lm_head, ids[..., j], ew, eb) for j in range(J)], -1)
    assert got.shape == (2, 7, branches, J)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    params = [t for t in (hidden, ew, eb) if t is not None]
    weights = torch.randn(got.shape, generator=g)
    for a, b in zip(torch.autograd.grad((got * weights).sum(), params),
                    torch.autograd.grad((want * weights).sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="labels must have shape"):
        gather_branch_logprobs(hidden, lm_head, ids[:, :6])


@pytest.mark.parametrize("ids_per_row", [None, 33])
def test_gather_branch_logprobs_memory_is_bounded_by_the_chunk(ids_per_row):
    g = torch.Generator().manual_seed(0)
    rows, K, H, V = 512, 4, 32, 20000
    hidden = torch.randn(rows, H, generator=g, requires_grad=True)
    lm_head = torch.randn(V, H, generator=g) / 6
    labels = torch.randint(0, V, (rows,) if ids_per_row is None else (rows, ids_per_row), generator=g)
    ew, eb = torch.randn(K * H, H, generator=g) * 0.1, torch.zeros(K * H)
    full_logits = rows * K * V * 4

    def step(chunk):
        hidden.grad = None
        gather_branch_logprobs(hidden, lm_head, labels, ew, eb, chunk_size=chunk).sum().backward()

    chunked = peak_extra_bytes(lambda: step(16))
    whole = peak_extra_bytes(lambda: step(rows))
    # forward + backward of the whole batch hold its [rows, K, V] logits at least once; the
    # chunked run holds one chunk's (1/32 of them) plus the process's own noise
    assert whole >= full_logits, (whole, full_logits)
    assert chunked <= whole / 4, f"chunked peaked at {chunked / 1e6:.1f} MB, unchunked at {whole / 1e6:.1f} MB"


def test_acceptance_proxy_is_the_importance_weighted_eq_14_sum():
    from dblast_ext.training.losses import accepted_length_proxy

    prior, branch, target = random_case(5, spread=0.7)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 1], [1, 1, 1, 1, 0]])
    expected = 0.0
    for n in range(3):
        post = torch.softmax(prior[n], -1).tolist()
        q_prefix = p_prefix = survive = 1.0
        for i in range(valid_length(mask[n].tolist())):
            qi = sum(post[z] * math.exp(float(branch[n, z, i])) for z in range(4))
            pi = math.exp(float(target[n, i]))
            post = [post[z] * math.exp(float(branch[n, z, i])) / qi for z in range(4)]
            q_prefix, p_prefix, survive = q_prefix * qi, p_prefix * pi, survive * min(1.0, pi / qi)
            expected += q_prefix / p_prefix * survive  # r_l prod_{j<=l} A_j
    assert accepted_length_proxy(prior, branch, target, mask).item() == pytest.approx(expected / 3, rel=1e-10)


def test_top1_agreement_counts_by_hand():
    from dblast_ext.training.objective import top1_agreement_counts

    draft = torch.tensor([[[5, 6, 7], [1, 2, 3]], [[5, 0, 7], [9, 9, 9]]])
    top1 = torch.tensor([[[5, 6, 0], [1, 0, 3]], [[5, 0, 7], [9, 8, 9]]])
    mask = torch.tensor([[[1, 1, 1], [1, 1, 0]], [[1, 1, 1], [0, 0, 0]]], dtype=torch.bool)
    hits, positions = top1_agreement_counts(draft, top1, mask)
    # position 0: 5=5, 1=1, 5=5 (the 4th masked) -> 3 of 3; position 1: 6=6, 0!=2, 0=0 -> 2 of 3;
    # position 2: 7!=0, (masked), 7=7 -> 1 of 2
    assert hits.tolist() == [3, 2, 1] and positions.tolist() == [3, 3, 2]


def test_greedy_chain_accepted_counts_the_leading_matches_by_hand():
    from dblast_ext.training.objective import greedy_chain_accepted

    draft = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9], [4, 4, 4, 4]])
    data = torch.tensor([[5, 6, 0, 8], [1, 2, 3, 4], [0, 9, 9, 9], [4, 4, 4, 4]])
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    # a mismatch ends the run (row 0: 2, not 3), however many match after it (row 2: 0), and
    # positions past the block's valid prefix never count (row 3: 2)
    assert greedy_chain_accepted(draft, data, valid).tolist() == [2.0, 4.0, 0.0, 2.0]


def test_greedy_chain_accepted_is_unbiased_for_the_chains_acceptance_on_sampled_data():
    """On continuations sampled from the target, the run length's mean is the greedy chain's
    expected accepted length under the target's sampling: sum_l prod_{j<=l} p(d_j | d_<j)."""
    from dblast_ext.training.objective import greedy_chain_accepted

    g = torch.Generator().manual_seed(11)
    vocab, b, n = 5, 4, 200_000
    # a first-order chain: p(y_1) and p(y_l | y_{l-1}), random but peaked enough to match often
    first = torch.softmax(torch.randn(vocab, generator=g) * 2, -1)
    step = torch.softmax(torch.randn(vocab, vocab, generator=g) * 2, -1)
    y = torch.empty(n, b, dtype=torch.long)
    y[:, 0] = torch.multinomial(first, n, replacement=True, generator=g)
    for i in range(1, b):
        y[:, i] = torch.multinomial(step[y[:, i - 1]], 1, generator=g).squeeze(-1)
    draft = [int(first.argmax())]
    for i in range(1, b):
        draft.append(int(step[draft[-1]].argmax()))
    expected, survive = 0.0, 1.0
    for i, token in enumerate(draft):
        survive *= float(first[token] if i == 0 else step[draft[i - 1], token])
        expected += survive
    runs = greedy_chain_accepted(torch.tensor(draft).expand(n, b), y, torch.ones(n, b, dtype=torch.bool))
    stderr = float(runs.std()) / n ** 0.5
    assert abs(float(runs.mean()) - expected) < 4 * stderr, (float(runs.mean()), expected, stderr)


def test_the_fused_label_log_softmax_has_the_exact_gradient_with_repeated_ids():
    from dblast_ext.training.losses import _PickedLogSoftmax

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 2, 11, generator=g, dtype=torch.float64) * 2).requires_grad_()
    ids = torch.randint(0, 11, (3, 2, 5), generator=g)
    ids[0, 0] = torch.tensor([4, 4, 4, 1, 0])   # the label among the target's top-k: a repeated id
    torch.testing.assert_close(_PickedLogSoftmax.apply(logits, ids), torch.log_softmax(logits, -1).gather(-1, ids))
    assert torch.autograd.gradcheck(lambda x: _PickedLogSoftmax.apply(x, ids), (logits,))


def test_bfloat16_logits_give_the_float32_values_and_their_gradient_in_bfloat16():
    from dblast_ext.training.losses import _PickedLogSoftmax

    g = torch.Generator().manual_seed(6)
    half = (torch.randn(4, 3, 40, generator=g) * 3).to(torch.bfloat16).requires_grad_()
    full = half.detach().float().requires_grad_()
    ids = torch.randint(0, 40, (4, 3, 6), generator=g)
    out_half, out_full = _PickedLogSoftmax.apply(half, ids), _PickedLogSoftmax.apply(full, ids)
    assert out_half.dtype == torch.float32 and torch.equal(out_half, out_full)
    weights = torch.randn(out_full.shape, generator=g)
    (out_half * weights).sum().backward()
    (out_full * weights).sum().backward()
    assert half.grad.dtype == torch.bfloat16 and torch.equal(half.grad, full.grad.to(torch.bfloat16))


def test_the_chunk_left_to_the_device_keeps_a_cpu_chunk_under_the_logit_budget_and_the_values():
    assert auto_chunk_rows(torch.device("cpu"), 4, 49152) == CPU_CHUNK_LOGITS // (4 * 49152) == 21
    assert auto_chunk_rows(torch.device("cpu"), 1, 10 ** 8) == 1
    assert auto_chunk_rows(torch.device("cuda"), 4, 49152) == GPU_CHUNK_ROWS
    g = torch.Generator().manual_seed(2)
    H, V, K = 16, CPU_CHUNK_LOGITS // 40, 4   # 10 rows a chunk on a CPU, 64 rows in all
    hidden = torch.randn(64, H, generator=g)
    lm_head = torch.randn(V, H, generator=g) / 4
    ids = torch.randint(0, V, (64, 3), generator=g)
    ew, eb = torch.randn(K * H, H, generator=g) * 0.2, torch.randn(K * H, generator=g) * 0.1
    assert auto_chunk_rows(hidden.device, K, V) == 10
    # equal to rounding, not bit for bit: BLAS may block a 10-row matmul differently from a 64-row
    # one (bit-equal on a Xeon, 2026-12-07; not on an AMD EPYC the same day)
    torch.testing.assert_close(gather_branch_logprobs(hidden, lm_head, ids, ew, eb),
                               gather_branch_logprobs(hidden, lm_head, ids, ew, eb, chunk_size=64),
                               rtol=1e-5, atol=1e-5)


def test_a_frozen_lm_head_is_cast_once_for_autocast_with_autocasts_own_values():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    lm_head = torch.randn(50, 16, generator=g) / 4
    ids = torch.randint(0, 50, (2, 5, 4), generator=g)
    assert autocast_lm_head(lm_head) is lm_head   # no autocast: as it is
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = autocast_lm_head(lm_head)
        assert cast.dtype == torch.bfloat16 and torch.equal(cast, lm_head.to(torch.bfloat16))
        assert autocast_lm_head(lm_head) is cast   # once, not at every call
        got = gather_branch_logprobs(hidden, lm_head, ids)   # what autocast's own cast computes
        assert torch.equal(got, gather_branch_logprobs(hidden, lm_head.to(torch.bfloat16), ids))
        want = torch.stack([direct_logprobs(hidden, lm_head, ids[..., j], None, None) for j in range(4)], -1)
        torch.testing.assert_close(got, want.float(), rtol=0, atol=5e-2)   # bfloat16 logits
        lm_head.mul_(2)   # changed in place: cast again
        assert torch.equal(autocast_lm_head(lm_head), lm_head.to(torch.bfloat16))
        trained = lm_head.clone().requires_grad_()
        assert autocast_lm_head(trained) is trained   # a trained head: autocast's own cache
