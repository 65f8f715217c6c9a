"""Trie verification (docs/design.md, "Verifying every branch"): the K greedy branches of a
proposal merged into a trie of distinct prefixes, scored by the target in one pass under a
tree attention mask, and walked from the anchor with the target's own draws.

The walk is exact at any temperature: at each node it draws the target's next token from its
filtered distribution at that node (the inverse-CDF rule of every other path) and descends if
the token is one of the node's children, else emits it and stops. Every committed token is
therefore a draw from the target given the committed prefix, whatever the trie holds; the
trie only decides how many draws one target pass yields. A walk visits one node per depth, so
drawing all nodes of a depth with that depth's uniform is exact too (they share it without
ever being used together), which lets one `sample_tokens` launch draw every node at once.

Extra leaves (`add_alternative_leaves`): the drafter also ranks the tokens it did not draft. A
few of the likeliest, weighted by the prior of the branches through a node, become extra
children of that node (leaves: nothing is drafted after them). The walk is unchanged and stays
exact, since any fixed trie is; an extra leaf turns a draw that would have ended the cycle at
its parent into one more committed token and the bonus draw after it.

Rows: row 0 is the anchor (depth 0), rows 1..N the trie's nodes, parents before children.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

__all__ = ["DraftTrie", "build_trie", "add_alternative_leaves", "drafted_token_probs", "TrieWalk"]


@dataclass
class TrieWalk:
    tokens: List[int]     # the committed tokens: accepted drafts, then the walk's last draw
    rows: List[int]       # the rows whose target state is kept: the anchor and the accepted nodes
    branches: List[int]   # the branches whose drafts begin with the accepted ones (all K at 0 accepted;
    # ending on an extra leaf: those through its parent)
    expected_accepted: float  # sum over nodes of the chance the walk reaches it
    branch_rule_expected: Optional[float] = None  # greedy-branch verification's expected accepted drafts
    # for the same proposal and target distributions (None when a node budget cut the trie)
    depth_reach: List[float] = field(default_factory=list)  # [i - 1]: the chance the walk accepts at least
    # i drafts, for every depth i of the trie (the adaptive controller's signal: dblast_ext.decoding.adaptive)


@dataclass
class DraftTrie:
    tokens: List[int]                 # token of row r (row 0: the anchor's, filled by the caller)
    parents: List[int]                # parent row of row r (-1 for the anchor)
    depths: List[int]                 # depth of row r (anchor 0)
    children: List[Dict[int, int]]    # per row: child token -> child row
    branches: List[List[int]]         # per row: the branches through it (the anchor: all; an extra
                                      # leaf: those through its parent, which leave the path there)
    mass: List[float]                 # per row: the prior mass of the branches drafting it (0: extra leaf)
    complete: bool = True             # every branch's every draft is a node (no node budget cut it)
    extra_leaves: int = 0             # rows added by add_alternative_leaves (the last ones)

    @property
    def num_nodes(self) -> int:
        """Draft nodes, the anchor not counted."""
        return len(self.tokens) - 1

    def child_tokens(self, device) -> torch.Tensor:
        """[1 + N, C] int64: each row's child tokens, -1 padded (C >= 1): the query tokens whose
        probabilities give the chance of descending from each row."""
        width = max(1, max(len(c) for c in self.children))
        table = [list(c) + [-1] * (width - len(c)) for c in self.children]
        return torch.tensor(table, dtype=torch.int64, device=device)

    def positions(self, start: int, device) -> torch.Tensor:
        """[1, 1 + N] position ids: the anchor at `start` (the committed context's length), a node at
        start + depth."""
        return torch.tensor([[start + d for d in self.depths]], dtype=torch.int64, device=device)

    def attention_mask(self, context_length: int, dtype: torch.dtype, device) -> torch.Tensor:
        """[1, 1, 1 + N, context_length + 1 + N] additive mask (0 visible, the dtype's minimum
        hidden): every row sees the committed context, itself and its ancestors. Additive float
        works with transformers' eager and SDPA attention alike; a 4D mask is used as given."""
        rows = len(self.tokens)
        visible = torch.zeros(rows, rows, dtype=torch.bool)
        for r in range(rows):
            a = r
            while a >= 0:
                visible[r, a] = True
                a = self.parents[a]
        visible = torch.cat([torch.ones(rows, context_length, dtype=torch.bool), visible], dim=1)
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
        return mask[None, None].to(device)

    def walk(self, drawn: Sequence[int], child_probs: Sequence[Sequence[float]]) -> TrieWalk:
        """The walk from the anchor given every row's draw `drawn` [1 + N] and the filtered
        probability of each row's children (`child_probs`, in child_tokens' order)."""
        tokens, rows, row = [], [0], 0
        while True:
            token = int(drawn[row])
            tokens.append(token)
            child = self.children[row].get(token)
            if child is None:
                break
            rows.append(child)
            row = child
        reach = [1.0] * len(self.tokens)
        # The branch rule (Eq 18-21) draws a branch by the prior and accepts its draft at a node with
        # min(1, p / q), q = the node's mass over its parent's (the prior renormalised over the
        # branches consistent so far). The branches through a node (mass m = product of the q's
        # along its path) reach it with m times the product of those chances, i.e. the product of
        # min(q, p) along the path: never above the walk's product of p.
        branch_reach = [1.0] * len(self.tokens)
        for r, kids in enumerate(self.children):  # parents before children: reach[r] is final here
            for c, child in enumerate(kids.values()):
                p = float(child_probs[r][c])
                reach[child] = reach[r] * p
                q = self.mass[child] / self.mass[r] if self.mass[r] > 0 else 0.0
                branch_reach[child] = branch_reach[r] * min(q, p)
        branch_rule = sum(branch_reach[1:]) if self.complete else None
        depth_reach = [0.0] * max(self.depths)
        for r in range(1, len(self.tokens)):
            depth_reach[self.depths[r] - 1] += reach[r]
        return TrieWalk(tokens, rows, list(self.branches[rows[-1]]), sum(reach[1:]), branch_rule, depth_reach)


def build_trie(branch_tokens: Sequence[Sequence[int]], prior: Sequence[float],
               max_nodes: Optional[int] = None,
               token_probs: Optional[Sequence[Sequence[float]]] = None) -> DraftTrie:
    """The trie of the distinct prefixes of K branches ([K][b] token ids), each node weighted by
    the prior mass of the branches through it. `max_nodes`: keep that many nodes, those of the
    highest score (ties: shallower, then lower branch first), which always keeps a node's
    ancestors (an ancestor scores at least what its descendants do and comes first in ties).
    The score is the node's mass, or with `token_probs` ([K][b]: the drafter's probability of
    each branch's token at each position) the drafter's own estimate of the chance a walk gets
    there: sum over the branches z through the node of prior[z] times the product of z's token
    probabilities along the path. That keeps the shallow nodes of every branch before the deep
    ones of the likeliest branch, which a cycle rarely reaches."""
    num_branches = len(branch_tokens)
    tokens, parents, depths = [-1], [-1], [0]
    children: List[Dict[int, int]] = [{}]
    branches: List[List[int]] = [list(range(num_branches))]
    mass = [float(sum(prior))]
    reach = [mass[0]]
    path_prob = [1.0] * num_branches  # product of each branch's token probabilities so far
    where = [0] * num_branches  # the row each branch has reached
    num_draft = len(branch_tokens[0]) if num_branches else 0
    for depth in range(num_draft):  # depth-major: parents before children, shallower first
        for k in range(num_branches):
            token, parent = int(branch_tokens[k][depth]), where[k]
            row = children[parent].get(token)
            if row is None:
                row = len(tokens)
                children[parent][token] = row
                tokens.append(token)
                parents.append(parent)
                depths.append(depth + 1)
                children.append({})
                branches.append([])
                mass.append(0.0)
                reach.append(0.0)
            branches[row].append(k)
            mass[row] += float(prior[k])
            if token_probs is not None:  # clamped to [0, 1]: a child never outscores its parent
                path_prob[k] *= min(1.0, max(0.0, float(token_probs[k][depth])))
                reach[row] += float(prior[k]) * path_prob[k]
            where[k] = row
    trie = DraftTrie(tokens, parents, depths, children, branches, mass)
    if max_nodes is None or max_nodes >= trie.num_nodes:
        return trie
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    score = mass if token_probs is None else reach
    ranked = sorted(range(1, len(tokens)), key=lambda r: (-score[r], r))
    return _keep_rows(trie, sorted(ranked[:max_nodes]))


def drafted_token_probs(branch_tokens: Sequence[Sequence[int]], top_tokens: Sequence[Sequence[Sequence[int]]],
                        top_probs: Sequence[Sequence[Sequence[float]]]) -> List[List[float]]:
    """[K][b]: each branch's probability of its own draft at each position, read from its ranked
    tokens (`top_tokens` / `top_probs` [K][b][m]); 0 for a draft outside its top m. A drafter
    drafting its argmax ranks it first, but a proposer need not."""
    return [[next((p for t, p in zip(tokens, probs) if t == token), 0.0)
             for token, tokens, probs in zip(drafts, ranked, ranked_probs)]
            for drafts, ranked, ranked_probs in zip(branch_tokens, top_tokens, top_probs)]


def _keep_rows(trie: DraftTrie, kept: List[int]) -> DraftTrie:
    """The sub-trie of the anchor and `kept` (ascending rows, closed under ancestors), renumbered."""
    new_row: Dict[int, int] = {0: 0}
    for r in kept:
        new_row[r] = len(new_row)
    order = [0] + kept
    children = [{t: new_row[c] for t, c in trie.children[r].items() if c in new_row} for r in order]
    parents = [-1] + [new_row[trie.parents[r]] for r in kept]
    return DraftTrie([trie.tokens[r] for r in order], parents, [trie.depths[r] for r in order], children,
                     [trie.branches[r] for r in order], [trie.mass[r] for r in order], complete=False)



def add_alternative_leaves(trie: DraftTrie, top_tokens: Sequence[Sequence[Sequence[int]]],
                           top_probs: Sequence[Sequence[Sequence[float]]], prior: Sequence[float],
                           count: int) -> DraftTrie:
    """Adds up to `count` leaves to `trie` (in place; returned): the drafter's likeliest tokens
    that are not yet children. `top_tokens` / `top_probs` [K][b][m]: branch z's m most probable
    tokens at each draft position and its probabilities for them. A candidate token t under node
    r (depth d < b) scores sum over the branches z through r of prior[z] * q_z(t at position d + 1),
    the prior-weighted chance the drafter would have drafted r's path then t (a branch's
    probability for a token outside its top m counts as 0); the `count` best are kept (ties: the
    lower row, then the lower token). Extra leaves carry no prior mass, so the greedy-branch
    rule's figure (`TrieWalk.branch_rule_expected`) is that of the branches alone."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    num_draft = len(top_tokens[0]) if len(top_tokens) else 0
    scores: Dict[tuple, float] = {}
    for row in range(len(trie.tokens)):
        depth = trie.depths[row]
        # no draft position below it, or no prior mass (an extra leaf, or a node only zero-prior
        # branches reach): every candidate below it would score 0
        if depth >= num_draft or trie.mass[row] <= 0:
            continue
        children = trie.children[row]
        for k in trie.branches[row]:
            for token, prob in zip(top_tokens[k][depth], top_probs[k][depth]):
                token = int(token)
                if token not in children:
                    scores[(row, token)] = scores.get((row, token), 0.0) + float(prior[k]) * float(prob)
    best = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:count]
    for (parent, token), _ in sorted(best):   # by parent row: parents stay before their children
        row = len(trie.tokens)
        trie.children[parent][token] = row
        trie.tokens.append(token)
        trie.parents.append(parent)
        trie.depths.append(trie.depths[parent] + 1)
        trie.children.append({})
        trie.branches.append(list(trie.branches[parent]))
        trie.mass.append(0.0)
    trie.extra_leaves += len(best)
    return trie
