"""The top-token oracle (eval/oracle.py): reading the cycles of an always-the-top-token drafter
off a response equals verifying its drafts with the verifier, cycle for cycle, and the top
tokens are read from the distributions the response was drawn from."""
import pytest
import torch

pytest.importorskip("transformers")

from dblast_ext import reference  # noqa: E402
from dblast_ext.decoding.decoder import sample_autoregressive  # noqa: E402
from dblast_ext.sampling import SamplingParams  # noqa: E402
from dblast_ext.target.adapter import TargetAdapter  # noqa: E402
from dblast_ext.eval.oracle import oracle_accepted, sample_with_top_tokens  # noqa: E402
from tiny_models import tiny_target  # noqa: E402

VOCAB, PROMPT = 12, [3, 7, 1, 8, 5]


def peaked_target():
    model = tiny_target(vocab_size=VOCAB, layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked distributions: long runs of top tokens and real rejections
    return model


def filtered_probs(model, sequence, sampling):
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].float()
    return reference.filter_target_probs(logits, **sampling.kwargs())


def oracle_speculative_decoding(model, sampling, num_draft, cycles, seed):
    """Speculative sampling whose drafter drafts the filtered target's argmax path, verified by
    reference.branch_verify with K = 1: the response, the accepted count of every cycle, and
    for every token after the first whether it is the argmax of the distribution it came from."""
    generator = torch.Generator().manual_seed(seed)
    first = filtered_probs(model, PROMPT, sampling)[-1]
    response = [int(torch.multinomial(first, 1, generator=generator))]
    accepted, matches = [], []
    for _ in range(cycles):
        draft, path = [], PROMPT + response
        for _ in range(num_draft):
            draft.append(int(filtered_probs(model, path, sampling)[-1].argmax()))
            path = path + draft[-1:]
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + response + draft])).logits[:, len(PROMPT) + len(response) - 1:]
        result = reference.branch_verify(logits.float(), torch.tensor([[draft]]), torch.tensor([[1.0]]),
                                         torch.tensor([0]), generator=generator, **sampling.kwargs())
        n = int(result.num_accepted[0])
        emitted = result.output_tokens[0, : n + 1].tolist()
        # row j of the verify pass is the distribution emitted token j was accepted from or drawn from
        probs = reference.filter_target_probs(logits[0, : n + 1].float(), **sampling.kwargs())
        matches += [int(probs[j].argmax()) == token for j, token in enumerate(emitted)]
        accepted.append(n)
        response += emitted
    return response, accepted, matches


@pytest.mark.parametrize("sampling", [SamplingParams(1.0, 0, 1.0), SamplingParams(0.7, 6, 0.9),
                                      SamplingParams(1.5, 0, 0.95)])
def test_reading_the_cycles_off_a_response_equals_verifying_top_token_drafts(sampling):
    model = peaked_target()
    seen = []
    for seed in range(6):
        _, accepted, matches = oracle_speculative_decoding(model, sampling, num_draft=3, cycles=8, seed=seed)
        assert oracle_accepted(matches, 3) == accepted
        seen += accepted
    assert 0 in seen and 3 in seen  # both rejections and full blocks were exercised


@pytest.mark.parametrize("sampling", [SamplingParams(1.0, 0, 1.0), SamplingParams(0.7, 6, 0.9)])
def test_top_tokens_are_those_of_the_distributions_the_tokens_were_drawn_from(sampling):
    model = peaked_target()
    adapter = TargetAdapter(model, [0])
    out, matches, top_probability = sample_with_top_tokens(adapter, PROMPT, sampling, 24, [], seed=3)
    assert out.token_ids == sample_autoregressive(adapter, PROMPT, sampling, 24, [], seed=3).token_ids
    assert len(matches) == len(top_probability) == len(out.token_ids) - 1 == 23
    for i, token in enumerate(out.token_ids[1:], 1):
        probs = filtered_probs(model, PROMPT + out.token_ids[:i], sampling)[-1]
        assert top_probability[i - 1] == pytest.approx(float(probs.max()), rel=1e-4)
        assert matches[i - 1] == (int(probs.argmax()) == token)
    assert any(matches) and not all(matches)


def test_greedy_responses_reach_the_ceiling_every_cycle():
    adapter = TargetAdapter(tiny_target(vocab_size=VOCAB, layers=2), [0])
    out, matches, top_probability = sample_with_top_tokens(adapter, PROMPT, SamplingParams(0.0), 14, [], seed=0)
    assert all(matches) and top_probability == [1.0] * 13
    assert oracle_accepted(matches, 4) == [4, 4, 2]  # 13 tokens after the first: two full cycles, then 3 kept


@pytest.mark.parametrize("matches, num_draft, cycles", [
    ([], 3, []),
    ([False, False], 3, [0, 0]),
    ([True, True, True, True, True], 3, [3, 0]),      # 3 drafts + bonus, then the response keeps one token
    ([True, False, True, True, False, True], 2, [1, 2, 0]),
    ([True, True, False, False, True], 5, [2, 0, 0]),
])
def test_cycles_end_at_the_first_other_token_or_after_b_minus_1_drafts(matches, num_draft, cycles):
    assert oracle_accepted(matches, num_draft) == cycles
    # every token after the first is drafted-and-accepted or closes a cycle (or ends the response)
    assert sum(n + 1 for n in cycles) == len(matches)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="num_draft"):
        oracle_accepted([True], 0)
    adapter = TargetAdapter(tiny_target(vocab_size=VOCAB, layers=1), [0])
    with pytest.raises(ValueError, match="input_ids is empty"):
        sample_with_top_tokens(adapter, [], SamplingParams(1.0), 4, [], seed=0)
