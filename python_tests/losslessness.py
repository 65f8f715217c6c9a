"""Statistical helpers for the losslessness tests of the verifiers."""
import numpy as np
import pytest
import torch
from scipy import stats


def chi_square_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square goodness of fit, pooling cells with expected count below 5."""
    assert observed.sum() == pytest.approx(expected.sum(), rel=1e-6)
    expected = expected * (observed.sum() / expected.sum())  # exact totals for scipy's check
    order = np.argsort(expected)
    obs, exp = observed[order].astype(float), expected[order].astype(float)
    pooled_obs, pooled_exp, acc_o, acc_e = [], [], 0.0, 0.0
    for o, e in zip(obs, exp):
        acc_o, acc_e = acc_o + o, acc_e + e
        if acc_e >= 5:
            pooled_obs.append(acc_o)
            pooled_exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        pooled_obs[-1] += acc_o
        pooled_exp[-1] += acc_e
    assert not np.any((np.array(pooled_exp) == 0) & (np.array(pooled_obs) > 0))
    if len(pooled_exp) == 1:  # a point mass (greedy): the totals already matched exactly
        return 1.0
    return stats.chisquare(pooled_obs, pooled_exp).pvalue


def exact_joint(p: torch.Tensor, draft: torch.Tensor, q_at) -> np.ndarray:
    """P(num_accepted = k, final token = v) for a fixed draft, straight from the rules:
    accept x_i with min(1, p/q); on rejection draw from [p - q]+ normalised (p if empty);
    after b acceptances draw from p_{b+1}. q_at(i) is the proposal q(. | x_<i)."""
    b, vocab = draft.shape[0], p.shape[-1]
    joint = np.zeros((b + 1, vocab))
    survive = 1.0
    for i in range(b):
        q = q_at(i)
        x = int(draft[i])
        accept = min(1.0, float(p[i, x] / q[x])) if q[x] > 0 else float(p[i, x] > 0)
        residual = (p[i] - q).clamp(min=0)
        if residual.sum() <= 0:
            residual = p[i].clone()
        joint[i] = survive * (1 - accept) * (residual / residual.sum()).numpy()
        survive *= accept
    joint[b] = survive * p[b].numpy()
    return joint


def assert_committed_tokens_follow_p(p: torch.Tensor, num_accepted: torch.Tensor, output_tokens: torch.Tensor,
                                     min_rows: int = 2000) -> None:
    """The verifier's guarantee checked directly, with no proposal formula restated: rows that
    share one target distribution per position (p [b + 1, V], independent of the prefix) and
    draw their drafts and uniforms afresh. Position 0 of every row is the first committed
    token, so it follows p[0]; position i > 0 of the rows that accepted i drafts is the next
    committed token after a committed prefix, so it follows p[i] whatever the prefix and
    whichever branch drafted it. Chi-square p > 1e-3 at every position; a position reached by
    fewer than `min_rows` rows fails (the case must reach it, not leave it out unseen)."""
    num_accepted, output_tokens = num_accepted.cpu().long(), output_tokens.cpu()
    vocab = p.shape[-1]
    reached_counts = [int((num_accepted >= i).sum()) for i in range(p.shape[0])]
    short = [(i, n) for i, n in enumerate(reached_counts) if n < min_rows]
    assert not short, f"positions reached by fewer than {min_rows} rows (position, rows): {short}"
    for i in range(p.shape[0]):
        reached = num_accepted >= i
        counts = np.bincount(output_tokens[reached, i].numpy(), minlength=vocab).astype(float)
        expected = p[i].double().numpy() * counts.sum()
        assert counts[expected == 0].sum() == 0, f"position {i}: a token outside the target's support"
        assert chi_square_pvalue(counts, expected) > 1e-3, f"position {i}"
