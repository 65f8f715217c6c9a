"""A draft vocabulary: the token ids the drafter may propose, so that its LM head (K x b rows
against the whole vocabulary, the largest cost of a drafter pass on a CPU) runs over a
shortlist instead. Verification stays exact whatever the drafts are, so the output
distribution is the target's either way; only which tokens can be drafted, and so the
acceptance, changes (FR-Spec's frequency-ranked draft vocabulary makes the same trade).

`draft_vocab` as the decode loop takes it:
- an int N: the first N token ids, plus the target's end-of-sequence ids. A byte-level BPE
  tokenizer numbers its merges in the order it learned them, most frequent pairs first, so
  the first ids are a frequency ranking of the tokenizer's own corpus, free of any data here;
- a sequence (or 1-D tensor) of token ids: any shortlist, e.g. the most frequent tokens of
  the target's own responses.
"""
from typing import Iterable, Optional, Sequence, Union

import torch

from ..target.loading import declared_eos_ids

DraftVocab = Union[int, Sequence[int], torch.Tensor, None]


def end_of_sequence_ids(model) -> set:
    """The end-of-sequence ids a transformers model declares (config and generation config)."""
    return declared_eos_ids(getattr(model, "config", None), getattr(model, "generation_config", None))


def draft_vocabulary(draft_vocab: DraftVocab, vocab_size: int, always: Iterable[int] = ()) -> Optional[torch.Tensor]:
    """The sorted int64 ids of the shortlist (ids in `always` included), or None when it
    would hold the whole vocabulary (nothing to gain). Sorted, so that among tied logits the
    drafter still picks the lowest id, as over the whole vocabulary."""
    if draft_vocab is None:
        return None
    if isinstance(draft_vocab, bool):
        raise TypeError("draft_vocab must be an int or a sequence of token ids, got a bool")
    if isinstance(draft_vocab, int):
        if draft_vocab < 1:
            raise ValueError(f"draft_vocab must be >= 1, got {draft_vocab}")
        ids = set(range(min(draft_vocab, vocab_size)))
    else:
        given = torch.as_tensor(draft_vocab)
        if given.dim() != 1 or given.numel() == 0 or given.is_floating_point() or given.is_complex():
            raise ValueError(f"draft_vocab must be a non-empty 1-D list of integer token ids, got shape "
                             f"{tuple(given.shape)} of {given.dtype}")
        ids = set(given.tolist())
        outside = sorted(i for i in ids if not 0 <= i < vocab_size)
        if outside:
            raise ValueError(f"draft_vocab holds ids outside the vocabulary [0, {vocab_size}): {outside[:5]}")
    ids.update(i for i in always if 0 <= i < vocab_size)
    if len(ids) >= vocab_size:
        return None
    return torch.tensor(sorted(ids), dtype=torch.int64)
