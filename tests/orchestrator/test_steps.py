"""The pure step logic: fitting trees, acceptance from verifier answers, the committed-token log."""
from __future__ import annotations

import pytest

from orchestrator.adaptive import FixedPolicy, Regime
from orchestrator.request import EOS, LENGTH, RequestSpec, RequestState, Speculation
from orchestrator.steps import accept, advance, fit_tree, in_original, tree_limits
from treeserve.acceptance import Outcome
from treeserve.sampling import Sampling
from treeserve.tree import SparseDist, TokenTree
from treeserve.v1 import treeserve_pb2 as pb

#        0
#      /   \
#     1     2
#    / \    |
#   3   4   5
#   |
#   6
TREE = TokenTree((10, 11, 12, 13, 14, 15, 16), (-1, 0, 0, 1, 1, 2, 3))


def state(prompt=(1, 2, 3), max_new=10, started=True):
    spec = RequestSpec("r", tuple(prompt), Sampling(), max_new, Speculation(), "front")
    st = RequestState(spec, list(prompt), FixedPolicy(1))
    if started:
        st.tokens.append(10)  # the first token from prefill: the root
        st.started, st.needs_prefill, st.generated = True, False, 1
    return st


def test_fit_tree_by_depth_keeps_parents_and_maps_back():
    fitted, kept = fit_tree(TREE, 16, 1)
    assert fitted.tokens == (10, 11, 12) and fitted.parents == (-1, 0, 0)
    assert kept == (0, 1, 2)
    fitted, kept = fit_tree(TREE, 16, 2)
    assert kept == (0, 1, 2, 3, 4, 5)
    assert fit_tree(TREE, 16, 9) == (TREE, None)


def test_fit_tree_by_node_count_is_a_prefix():
    fitted, kept = fit_tree(TREE, 4, 9)
    assert fitted.tokens == (10, 11, 12, 13) and fitted.parents == (-1, 0, 0, 1)
    fitted.validate(100, 64)


def test_fit_tree_keeps_draft_distributions():
    q = SparseDist((11, 12), (0.6, 0.4), 0.0)
    tree = TokenTree((10, 11, 12, 13), (-1, 0, 0, 2), (q, None, SparseDist((13,), (1.0,), 0.0), None))
    fitted, kept = fit_tree(tree, 16, 1)
    assert fitted.draft == (q, None, SparseDist((13,), (1.0,), 0.0))
    fitted.validate(100, 64)  # a leaf may keep its distribution


def test_fit_tree_by_node_count_drops_draft_distributions():
    q = SparseDist((11, 12), (0.6, 0.4), 0.0)
    tree = TokenTree((10, 11, 12, 13), (-1, 0, 0, 2), (q, None, SparseDist((13,), (1.0,), 0.0), None))
    fitted, kept = fit_tree(tree, 3, 9)
    assert kept == (0, 1, 2) and fitted.draft is None  # target-only acceptance: exact for any cut
    fitted, kept = fit_tree(tree, 3, 1)  # the depth cut alone leaves 3 nodes: distributions kept
    assert kept == (0, 1, 2) and fitted.draft == (q, None, SparseDist((13,), (1.0,), 0.0))


def test_fit_tree_fills_the_node_budget_after_the_depth_cut():
    fitted, kept = fit_tree(TREE, 6, 2)  # node 6 is too deep; the other six fit
    assert kept == (0, 1, 2, 3, 4, 5)


def test_outcome_in_original_indices():
    _, kept = fit_tree(TREE, 16, 1)
    assert in_original(Outcome((0, 2), 99), kept) == Outcome((0, 2), 99)
    fitted, kept = fit_tree(TokenTree((10, 11, 12, 13, 14), (-1, 0, 1, 0, 3)), 16, 1)
    assert fitted.tokens == (10, 11, 13)
    assert in_original(Outcome((0, 2), 5), kept) == Outcome((0, 3), 5)


def test_accept_follows_target_tokens():
    # target after root says 11 (node 1), after node 1 says 14 (node 4), after node 4 says 77
    target = [11, 14, 0, 0, 77, 0, 0]
    assert accept(TREE, target, None) == Outcome((0, 1, 4), 77)


def test_accept_uses_the_walk_and_checks_it():
    assert accept(TREE, [0] * 7, Outcome((0, 2, 5), 3)) == Outcome((0, 2, 5), 3)
    with pytest.raises(ValueError):
        accept(TREE, [0] * 7, Outcome((0, 3), 3))  # 3 is not a child of the root
    with pytest.raises(ValueError):
        accept(TREE, [0] * 3, None)


def test_advance_extends_the_log_and_sets_the_commit():
    st = state()
    out, finish = advance(st, TREE, Outcome((0, 1, 3), 42), frozenset({0}))
    assert out == [11, 13, 42] and finish is None
    assert st.tokens == [1, 2, 3, 10, 11, 13, 42]
    assert st.pending_commit == (3, (0, 1, 3))
    assert st.committed == 6 and st.root == 42 and st.generated == 4


def test_advance_stops_at_eos_and_length():
    st = state()
    out, finish = advance(st, TREE, Outcome((0, 1, 3), 0), frozenset({0}))
    assert out == [11, 13] and finish == EOS
    st = state(max_new=3)
    out, finish = advance(st, TREE, Outcome((0, 1, 3), 42), frozenset())
    assert out == [11, 13] and finish == LENGTH


def test_tree_limits():
    st = state(max_new=10)
    assert tree_limits(st, 64, 4096) == (64, 8)  # 9 more tokens: depth 8 plus the bonus
    st = state(max_new=2)
    assert tree_limits(st, 64, 4096) == (64, 0)
    st = state(prompt=tuple(range(20)), max_new=50)
    assert tree_limits(st, 64, 24) == (4, 3)  # committed 20 + 4 nodes fit in 24


def test_a_requests_regime_is_its_tree_shape_temperature_band_and_draft_ahead():
    def regime(sampling, speculation):
        return RequestSpec("r", (1, 2), sampling, 4, speculation, "front").regime

    assert regime(Sampling(), Speculation()) == Regime(pb.TREE_SHAPE_UNSPECIFIED, 0, False)
    assert regime(Sampling(temperature=0.7, seed=1), Speculation(mode="chain")) == Regime(pb.TREE_SHAPE_CHAIN, 2, False)
    assert regime(Sampling(temperature=1.5, seed=1), Speculation(shape=pb.TREE_SHAPE_NGRAM, draft_ahead=True)) \
        == Regime(pb.TREE_SHAPE_NGRAM, 3, True)
    assert regime(Sampling(temperature=0.2, seed=1), Speculation()).band == 1
