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
