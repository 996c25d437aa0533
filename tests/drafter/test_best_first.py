"""Dynamic trees are best-first: every chosen node's path probability is at least that of every
candidate left out (children of chosen nodes above the depth limit), checked against an
independent forward pass over the finished tree."""
import math

import pytest
import torch

from drafter_service.children import ChildPicker, PickRule
from drafter_service.dynamic import DynamicProposer
from drafter_service.state import DraftState
from treeserve.sampling import Sampling

TOL = 1e-4  # level-by-level and whole-tree forwards differ by float rounding only


@pytest.mark.parametrize(
    "sampling,rule",
    [(Sampling(), PickRule.GREEDY), (Sampling(temperature=0.15), PickRule.RANKED), (Sampling(temperature=0.3), PickRule.RANKED)],
    ids=["greedy-softmax", "sharp", "medium"],
)
@pytest.mark.parametrize("budget,depth", [(8, 3), (20, 5)])
def test_dynamic_tree_is_best_first(draft_model, prompt, sampling, rule, budget, depth):
    picker = ChildPicker(sampling, rule)
    state = DraftState.open("bf", prompt, sampling, picker, draft_model)
    try:
        draft = DynamicProposer().propose(state, prompt[-1], budget, depth)
        tree = draft.tree
        logq = torch.log(picker.ranking_probs(state.logits(tree)).double())
    finally:
        state.release()
    assert tree.size == budget
    depths = tree.depths()
    path_logp = [0.0] * tree.size
    for i in range(1, tree.size):
        path_logp[i] = path_logp[tree.parents[i]] + float(logq[tree.parents[i], tree.tokens[i]])
        assert abs(path_logp[i] - draft.logp[i]) < TOL
    worst_chosen = min(path_logp[1:])
    best_left_out = -math.inf
    for i in range(tree.size):
        if depths[i] >= depth:
            continue
        row = logq[i].clone()
        row[list(tree.tokens[c] for c in tree.children(i))] = -math.inf
        best_left_out = max(best_left_out, path_logp[i] + float(row.max()))
    assert worst_chosen >= best_left_out - TOL
