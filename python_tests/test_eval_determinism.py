"""Early determinism (DBLast Eq 22-24) against its exact value, and the binning."""
import itertools

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from dblast_ext import reference  # noqa: E402
from dblast_ext.sampling import SamplingParams  # noqa: E402
from dblast_ext.target.adapter import TargetAdapter  # noqa: E402
from dblast_ext.eval.determinism import bin_by_determinism, early_determinism  # noqa: E402
from tiny_models import lm_head_rows, tiny_target  # noqa: E402

VOCAB, PREFIX = 12, [3, 7, 1, 8]


def exact_determinism(model, sampling, b):
    """Eq 23: D_b = (1/b) sum_j sum_{u in V^j} p(u)^2, by enumerating every prefix."""
    total = 0.0
    with torch.no_grad():
        for j in range(1, b + 1):
            for u in itertools.product(range(VOCAB), repeat=j):
                p, seq = 1.0, list(PREFIX)
                for token in u:
                    probs = reference.filter_target_probs(model(torch.tensor([seq])).logits[0, -1], **sampling.kwargs())
                    p *= float(probs[token])
                    seq.append(token)
                total += p * p
    return total / b


@pytest.mark.parametrize("sampling", [SamplingParams(1.0, 0, 1.0), SamplingParams(0.7, 5, 0.9)])
def test_the_sampled_estimate_converges_to_the_exact_value(sampling):
    model = tiny_target(vocab_size=VOCAB, layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # spread the determinism away from 1/V
    exact = exact_determinism(model, sampling, 2)
    adapter = TargetAdapter(model, [0])
    estimates = [early_determinism(adapter, PREFIX, sampling, 2, 500, torch.Generator().manual_seed(s))
                 for s in range(4)]
    # 2000 sampled blocks: standard error well under 0.01 for values in (0, 1)
    assert np.mean(estimates) == pytest.approx(exact, abs=0.02)
    assert 1.0 / VOCAB ** 2 < exact < 1.0


def test_greedy_targets_are_fully_determined():
    adapter = TargetAdapter(tiny_target(vocab_size=VOCAB, layers=2), [0])
    assert early_determinism(adapter, PREFIX, SamplingParams(0.0), 3, 4, torch.Generator()) == pytest.approx(1.0)


def test_binning_counts_means_and_errors():
    rows = bin_by_determinism([0.0, 0.1, 0.2, 0.5, 0.55, 1.0], [1, 3, 5, 2, 4, 7])
    assert [r["count"] for r in rows] == [3, 0, 2, 0, 1]
    assert rows[0]["mean"] == pytest.approx(3.0) and rows[0]["sem"] == pytest.approx(2 / np.sqrt(3))
    assert rows[1]["mean"] is None and rows[4]["sem"] is None


def test_the_prefix_pass_projects_only_its_last_position():
    model = tiny_target(vocab_size=VOCAB, layers=2)
    rows = lm_head_rows(model)
    early_determinism(TargetAdapter(model, [0]), PREFIX, SamplingParams(1.0), 3, 4, torch.Generator().manual_seed(0))
    assert rows == [1] * 4  # the prefix pass, then one pass per sampled token
