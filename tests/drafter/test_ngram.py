"""N-gram lookup: continuations of the longest suffix matches, merged into one tree."""
import numpy as np

from drafter_service.engine import DraftCall, Drafter, Options
from drafter_service.ngram import NgramProposer, continuations
from drafter_service.state import DraftState, TokenHistory
from treeserve.sampling import Sampling


def test_longest_match_first_then_recency():
    #            0  1  2  3  4  5  6  7  8  9 10 11 12
    text = np.array([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3], dtype=np.int64)
    conts = continuations(text, 3, max_match=8, min_match=1, limit=8)
    # suffix "1 2 3" matches at 0..2 (length 3): its continuation comes first; then "2 3" at 5..6
    assert conts[0] == [4, 9, 2]
    assert conts[1] == [5, 7, 1]
    assert all(len(c) <= 3 for c in conts)


def test_no_match_and_distinct():
    assert continuations(np.array([1, 2, 3], dtype=np.int64), 4, 8, 1, 8) == []
    text = np.array([5, 6, 5, 6, 5, 6, 5], dtype=np.int64)
    conts = continuations(text, 2, 8, 1, 8)
    assert len(conts) == len({tuple(c) for c in conts})
    assert conts[0] == [6, 5]


def test_tree_holds_prompt_continuation_within_budget_and_depth():
    history = [10, 11, 12, 13, 14, 20, 21, 10, 11, 12, 15, 16, 10, 11]
    state = DraftState("s", Sampling(), TokenHistory(history))
    # after "10 11 12" came "15 16 ..." (the latest match, first) and "13 14 ...": the best match's
    # continuation whole, then the other's, each cut to the depth, the whole cut to the budget
    expected = {
        (16, 6): [[15, 16, 10, 11, 12], [13, 14, 20, 21, 10, 11]],
        (4, 6): [[15, 16, 10]],
        (16, 2): [[15, 16], [13, 14]],
        (1, 4): [[]],
    }
    for (budget, depth), paths in expected.items():
        tree = NgramProposer().propose(state, 12, budget, depth).tree.validate(1000, budget)
        assert tree.size <= budget and max(tree.depths()) <= depth
        assert tree.tokens[0] == 12
        leaves = [list(tree.tokens_along(tree.path_to(i))[1:]) for i in range(tree.size) if not tree.children(i)]
        assert leaves == paths, (budget, depth, tree)


def test_drafter_ngram_follows_committed_text():
    d = Drafter(None, Options("ngram", 8, 4, False))
    tokens = [3, 4, 5, 6, 7, 8, 3, 4]
    assert d.start("x", tokens) == 8
    tree = d.draft(DraftCall("x", 8, (), 5)).tree
    assert list(tree.tokens[:4]) == [5, 6, 7, 8]  # the continuation of the earlier "3 4 5"
    # accept 5 6, bonus 9: the history grows and the next lookup sees it
    tree2 = d.draft(DraftCall("x", 10, (5, 6), 9)).tree
    assert tree2.tokens[0] == 9 and d._seqs["x"].state.length == 10
    d.close()
