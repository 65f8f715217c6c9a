"""DFlash2's two additions to the DFlash drafter: grouped dynamic causal convolutions around each
sublayer, and the candidate selector that picks each drafted token among the LM head's top-k
given the token before it.

Convolution (per layer, one around attention and one around the MLP; `kernel` taps, channels in
groups of `group` sharing a dynamic tap). From the sublayer's normed input x [N, T, H] one
projection gives per-position dynamic taps dyn [N, T, 2, kernel, H / group] (set 0 before the
sublayer, set 1 after it); with base [2, kernel, H] the per-channel static taps,

    conv_s(y)[t, c] = sum_{k < kernel} (base[s, k, c] + dyn[t, s, k, c // group]) * y[t - k, c],

tap 0 the position itself, tap k the position k before it within the block (the anchor is the
block's first position; taps reaching before it read zero, context positions never enter). The
sublayer reads conv_0(x), and its output o enters the residual stream as conv_1(o).

Selector: at each drafted position i (1..b) the top-k tokens of the draft logits (after the
output multiplier and soft-capping) with their logits u as unary scores, and

    score_i(c | p) = u_i(c) + < A[p] * (P h_i), B[c] >,

A, B [V, R] the predecessor and successor codebooks, P [R, H] the hidden projection, h_i the
position's final-normed state, p the token drafted before (the anchor at i = 1). At T = 0 the
selector walks the block greedily (each position's best-scoring candidate, the lowest slot on
ties); at T > 0 it draws each token from q_i = softmax(score_i / T) over the k candidates, and the
chain is verified against that sparse proposal (ops.sparse_verify: accept min(1, p/q), correction
from [p - q]+), as the published loop does.
"""
from typing import NamedTuple, Optional

import torch
from torch import nn

__all__ = ["GroupedDynamicConv", "CandidateSelector", "SelectedChain", "draft_logits"]


class GroupedDynamicConv(nn.Module):
    """The convolution pair around one sublayer (module docstring). State-dict names as published:
    `base_kernel` [2, kernel, H], `kernel_projection.weight` [2 * kernel * H / group, H]."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        if kernel < 1 or group < 1 or hidden % group:
            raise ValueError(f"conv_kernel_size must be >= 1 and conv_group_size a divisor of the hidden size "
                             f"{hidden}, got {kernel} and {group}")
        self.kernel, self.group, self.groups = kernel, group, hidden // group
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * self.groups, bias=False)

    @torch.no_grad()
    def make_identity(self) -> None:
        """Taps that pass the input through unchanged (base tap 0 = 1, every other tap and the
        projection 0): a DFlash drafter's behaviour, where training a DFlash2 one starts."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def taps(self, x: torch.Tensor) -> torch.Tensor:
        """The dynamic taps [N, T, 2, kernel, G] of the normed sublayer input x [N, T, H]."""
        n, t, _ = x.shape
        return self.kernel_projection(x).view(n, t, 2, self.kernel, self.groups)

    def apply(self, y: torch.Tensor, taps: torch.Tensor, side: int, block: Optional[int] = None) -> torch.Tensor:
        """conv_side(y) over y [N, T, H] (module docstring), the positions in blocks of `block`
        (None: one block of T), each block's taps starting at its first position."""
        n, t, h = y.shape
        block = block or t
        within = torch.arange(t, device=y.device) % block  # position inside its block
        dyn = taps[:, :, side].repeat_interleave(self.group, dim=-1)  # [N, T, kernel, H]
        out = torch.zeros_like(y, dtype=torch.float32)
        for k in range(self.kernel):
            shifted = y
            if k:  # y k positions back, zero where that reaches before the block
                shifted = torch.zeros_like(y)
                shifted[:, k:] = y[:, :-k]
                shifted = shifted * (within >= k).to(y.dtype)[None, :, None]
            coefficient = self.base_kernel[side, k].float() + dyn[:, :, k].float()
            out = out + coefficient * shifted.float()
        return out.to(y.dtype)


class SelectedChain(NamedTuple):
    tokens: torch.Tensor                 # [N, b] int64: the chain
    candidates: torch.Tensor             # [N, b, k] int64: each position's candidate ids
    probs: Optional[torch.Tensor]        # [N, b, k] float32: q over them (None for the greedy walk)


class CandidateSelector(nn.Module):
    """The selector's parameters as published: `hidden_projection.weight` [R, H],
    `predecessor_codebook` and `successor_codebook` [V, R] (stored with or without `.weight`;
    `drafter_io` reads both)."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        if rank < 1 or top_k < 1:
            raise ValueError(f"selector_rank and selector_top_k must be >= 1, got {rank} and {top_k}")
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))

    @torch.no_grad()
    def walk(self, anchors: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor,
             ids: Optional[torch.Tensor] = None, temperature: float = 0.0,
             generator: Optional[torch.Generator] = None, uniforms: Optional[torch.Tensor] = None) -> SelectedChain:
        """The chain over a block: anchors [N], the drafted positions' normed states hidden
        [N, b, H] and draft logits [N, b, V'] (after multiplier and soft-cap) over the token ids
        `ids` [V'] (a draft vocabulary; None: ids 0..V'-1). At temperature 0 each position takes
        its best-scoring candidate (the lowest slot on ties); above 0 it draws one from
        q = softmax(score / temperature) over the candidates by inverse CDF on `uniforms`
        [N, b] in [0, 1) (drawn from `generator` when None), and the chain keeps what it drew from
        (the sparse proposal sparse_verify checks it against)."""
        unary, candidates, projected, successors = self._candidates(hidden, logits, ids)
        k = candidates.shape[-1]
        previous = anchors
        chain, probs = [], []
        if temperature > 0 and uniforms is None:
            uniforms = torch.rand(hidden.shape[:2], generator=generator, dtype=torch.float64).to(hidden.device)
        for i in range(hidden.shape[1]):
            scores = self._scores(unary[:, i], successors[:, i], projected[:, i], previous[:, None])[:, 0]  # [N, k]
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                # the first slot whose cumulative mass passes u (the last one if rounding leaves u unreached)
                below = q.double().cumsum(-1) <= uniforms[:, i : i + 1].double()
                slot = below.sum(-1, keepdim=True).clamp(max=k - 1)
                probs.append(q)
            else:
                slot = scores.argmax(-1, keepdim=True)  # first max: lowest slot
            previous = candidates[:, i].gather(1, slot)[:, 0]
            chain.append(previous)
        return SelectedChain(torch.stack(chain, dim=1), candidates,
                             torch.stack(probs, dim=1) if probs else None)

    @torch.no_grad()
    def best_paths(self, anchors: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor,
                   ids: Optional[torch.Tensor] = None, width: int = 4):
        """The selector's greedy chain and its `width` likeliest paths by beam search, for trie
        verification (inputs as `walk`'s): (paths [N, width + 1, b] int64, the greedy chain first,
        then the beam best first; their probabilities [N, width + 1] float32, each the product of
        softmax(score) at every position, renormalised over the paths). The chain comes first so
        that the trie holds every draft a chain verifier would check."""
        unary, candidates, projected, successors = self._candidates(hidden, logits, ids)
        k = candidates.shape[-1]
        # column 0: the greedy chain (as `walk` at T 0 takes it); columns 1..: the beam
        paths = anchors[:, None, None].expand(-1, 2, 1)                 # [N, 1 + beams, i + 1]: anchor, then drafts
        logp = torch.zeros(anchors.shape[0], 2, device=hidden.device)
        for i in range(hidden.shape[1]):
            scores = self._scores(unary[:, i], successors[:, i], projected[:, i], paths[:, :, -1])  # [N, 1 + B, k]
            logq = torch.log_softmax(scores, -1)
            greedy_slot = scores[:, 0].argmax(-1, keepdim=True)                             # first max: lowest slot
            greedy_logp = logq[:, 0].gather(1, greedy_slot)
            total = (logp[:, 1:, None] + logq[:, 1:]).flatten(1)                            # [N, B * k]
            beam_logp, best = total.topk(min(width, total.shape[1]), dim=-1)
            rows = torch.cat([torch.zeros_like(greedy_slot), 1 + best // k], dim=1)
            slots = torch.cat([greedy_slot, best % k], dim=1)
            paths = torch.cat([paths.gather(1, rows[..., None].expand(-1, -1, paths.shape[2])),
                               candidates[:, i].gather(1, slots)[..., None]], dim=2)
            logp = torch.cat([logp[:, :1] + greedy_logp, beam_logp], dim=1)
        return paths[:, :, 1:], torch.softmax(logp, dim=-1)

    def _candidates(self, hidden: torch.Tensor, logits: torch.Tensor, ids: Optional[torch.Tensor]):
        """Each position's top-k candidates and what scoring them needs: (unary logits [N, b, k],
        likeliest first; candidate ids [N, b, k]; P h [N, b, R]; the candidates' successor codes
        [N, b, k, R])."""
        k = min(self.top_k, logits.shape[-1])
        unary, candidates = logits.float().topk(k, dim=-1)
        if ids is not None:
            candidates = ids[candidates]
        projected = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype)).float()
        return unary, candidates, projected, self.successor_codebook[candidates].float()

    def _scores(self, unary: torch.Tensor, successors: torch.Tensor, projected: torch.Tensor,
                previous: torch.Tensor) -> torch.Tensor:
        """The scores [N, B, k] of one position's candidates after each of B predecessors
        `previous` [N, B]: unary [N, k] + < A[previous] * (P h) [N, R], B[candidate] [N, k, R] >."""
        query = self.predecessor_codebook[previous].float() * projected[:, None]   # [N, B, R]
        return unary[:, None] + (successors @ query.transpose(1, 2)).transpose(1, 2)


def draft_logits(logits: torch.Tensor, multiplier: float, softcap: Optional[float]) -> torch.Tensor:
    """DFlash2's draft logits from the LM head's: times `output_multiplier`, then soft-capped
    c * tanh(l / c) when `final_logit_softcapping` c > 0 (both keep the order of the tokens)."""
    out = logits.float() * multiplier if multiplier != 1.0 else logits.float()
    if softcap:
        out = softcap * torch.tanh(out / softcap)
    return out
