"""Dynamic trees drawn for multi-draft sampling keep the target's distribution.

A toy bigram draft and target over 4 tokens; the real `DynamicProposer` (children drawn by the real
`ChildPicker`) and the real `multi_draft_walk`. What a step emits must follow the target: its first
token p(. | root), and a second token, when it emits one, p(. | first). With a budget of 3 nodes and
depth 2 the proposer chooses between a second draw at the root and a child of the first draw. A rule
that decided by the second draw's own token tilts the output towards the draft's favourites: ranking
draws by their own q did, with a first-token p-value of 3e-6 at this sample size and seed (the
threshold is 1e-3; the rule kept gives 0.65).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from drafter_service.children import ChildPicker, PickRule
from drafter_service.dynamic import DynamicProposer
from drafter_service.nodes import NodeSet, rank_logq
from drafter_service.state import DraftState, TokenHistory
from verifier_service.results import multi_draft_walk
from treeserve.sampling import Sampling

ROOT = 0
# row t: the next-token distribution after token t
DRAFT = torch.tensor([[0.37, 0.39, 0.01, 0.23],
                      [0.67, 0.13, 0.10, 0.10],
                      [0.67, 0.13, 0.10, 0.10],
                      [0.67, 0.13, 0.10, 0.10]], dtype=torch.float64)
TARGET = torch.tensor([[0.08, 0.02, 0.35, 0.55],
                       [0.25, 0.25, 0.25, 0.25],
                       [0.10, 0.20, 0.30, 0.40],
                       [0.40, 0.30, 0.20, 0.10]], dtype=torch.float64)
TRIALS = 3000


class BigramDraft(DraftState):
    """A draft state whose logits at a node depend only on the node's token; `length` committed
    tokens (it keys the draws' noise)."""

    def __init__(self, sampling: Sampling, length: int):
        super().__init__("s", sampling, TokenHistory(()), ChildPicker(sampling, PickRule.DRAWN))
        self._length = length

    @property
    def length(self) -> int:
        return self._length

    def logits(self, tree, nodes=None):
        rows = range(tree.size) if nodes is None else nodes
        return torch.log(DRAFT[[tree.tokens[i] for i in rows]]).float()


def emitted_tokens(trials: int) -> list[tuple[int, ...]]:
    s = Sampling(temperature=1.0, seed=20261127)
    proposer = DynamicProposer()
    out = []
    for t in range(trials):
        length = 10 * t  # a fresh committed length per step: fresh draws and acceptance noise
        state = BigramDraft(s, length)
        tree = proposer.propose(state, ROOT, 3, 2).tree
        tree.validate(DRAFT.shape[1], 3)
        outcome = multi_draft_walk(tree, TARGET[list(tree.tokens)], length, s.seed)
        out.append(tuple(outcome.emitted(tree)))
    return out


def test_dynamic_drawn_tree_emits_the_target_distribution():
    runs = emitted_tokens(TRIALS)
    first = np.bincount([r[0] for r in runs], minlength=4)
    assert stats.chisquare(first, TARGET[ROOT].numpy() * TRIALS).pvalue > 1e-3, first / TRIALS
    # a step that emits a second token accepted its first as a draft node, and the walk below that
    # node starts afresh: the second token follows p(. | first)
    pairs = np.zeros((4, 4))
    for r in runs:
        if len(r) > 1:
            pairs[r[0], r[1]] += 1
    assert pairs.sum() > TRIALS / 4
    want = pairs.sum(1, keepdims=True) * TARGET.numpy()
    assert stats.chisquare(pairs.ravel(), want.ravel(), ddof=3).pvalue > 1e-3, pairs


def test_drawn_children_are_ranked_by_draw_place_not_by_token():
    s = Sampling(temperature=1.0, seed=3)
    picker = ChildPicker(s, PickRule.DRAWN)
    seen = set()
    for pos in range(40):
        [kids] = picker.pick(torch.log(DRAFT[:1]).float(), 3, position=pos, salts=[0])
        ns = NodeSet(ROOT)
        ids = ns.add_children(0, kids)
        # whichever tokens were drawn, the k-th draw is scored by q's k-th largest probability
        assert [ns.nodes[i].score for i in ids] == list(rank_logq(kids))
        assert rank_logq(kids) == pytest.approx(np.log([0.39, 0.37, 0.23]), rel=1e-6)
        assert [ns.nodes[i].logp for i in ids] == list(kids.logq)
        seen.add(kids.tokens)
    assert len(seen) > 3  # the draws themselves did vary
