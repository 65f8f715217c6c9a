"""The draft vocabulary (dblast_ext.drafting.draft_vocabulary): which ids a shortlist holds, and bad
shortlists refused by name."""
import pytest
import torch

from dblast_ext.drafting.draft_vocabulary import draft_vocabulary, end_of_sequence_ids


def test_first_n_ids_plus_the_end_of_sequence_ids_sorted():
    ids = draft_vocabulary(10, 100, always=[57, 3])
    assert ids.dtype == torch.int64
    assert ids.tolist() == list(range(10)) + [57]


def test_a_list_of_ids_is_deduplicated_and_sorted():
    assert draft_vocabulary([9, 3, 9, 41], 100, always=[0]).tolist() == [0, 3, 9, 41]
    assert draft_vocabulary(torch.tensor([7, 2]), 100).tolist() == [2, 7]


def test_the_whole_vocabulary_or_none_means_no_shortlist():
    assert draft_vocabulary(None, 100) is None
    assert draft_vocabulary(100, 100) is None
    assert draft_vocabulary(5000, 100) is None
    assert draft_vocabulary(99, 100, always=[99]) is None
    assert draft_vocabulary(list(range(100)), 100) is None


def test_end_of_sequence_ids_outside_the_vocabulary_are_ignored():
    assert draft_vocabulary(4, 100, always=[-1, 100, 250]).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("value,error,message", [
    (0, ValueError, "draft_vocab must be >= 1"),
    (-3, ValueError, "draft_vocab must be >= 1"),
    (True, TypeError, "draft_vocab"),
    ([], ValueError, "non-empty 1-D"),
    ([[1, 2]], ValueError, "non-empty 1-D"),
    ([1.5, 2.0], ValueError, "integer token ids"),
    ([3, 100], ValueError, r"outside the vocabulary \[0, 100\): \[100\]"),
    ([-1, 4], ValueError, r"outside the vocabulary"),
])
def test_bad_shortlists_are_refused_by_name(value, error, message):
    with pytest.raises(error, match=message):
        draft_vocabulary(value, 100)


class Config:
    def __init__(self, eos):
        self.eos_token_id = eos


class Model:
    def __init__(self, config_eos, generation_eos):
        self.config, self.generation_config = Config(config_eos), Config(generation_eos)


def test_end_of_sequence_ids_from_the_config_and_the_generation_config():
    assert end_of_sequence_ids(Model(2, [2, 7])) == {2, 7}
    assert end_of_sequence_ids(Model(None, 5)) == {5}
    assert end_of_sequence_ids(Model(None, None)) == set()
    assert end_of_sequence_ids(object()) == set()
