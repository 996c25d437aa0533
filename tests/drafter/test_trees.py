"""Model-drafted trees: valid, within budget and depth, the shapes they promise."""
import pytest

from drafter_service.chain import ChainProposer
from drafter_service.children import ChildPicker, PickRule, rule_for
from drafter_service.dynamic import DynamicProposer
from drafter_service.engine import DraftCall, Drafter, Options
from drafter_service.fused import merge
from drafter_service.proposer import Draft
from drafter_service.state import DraftState
from drafter_service.static import STREE_13, ShapeTable, StaticProposer
from treeserve.sampling import Sampling
from treeserve.tree import TokenTree

GREEDY = Sampling()
HOT = Sampling(temperature=0.9, top_k=20, seed=3)


def open_state(model, prompt, sampling, rule=None):
    rule = rule or rule_for(sampling, with_dists=True)
    return DraftState.open("t", prompt, sampling, ChildPicker(sampling, rule), model)


@pytest.mark.parametrize("sampling", [GREEDY, HOT], ids=["greedy", "sampling"])
@pytest.mark.parametrize("proposer", [ChainProposer(), StaticProposer(), DynamicProposer()], ids=lambda p: p.name)
@pytest.mark.parametrize("budget,depth", [(1, 4), (5, 2), (13, 4), (24, 6)])
def test_valid_within_budget_and_depth(draft_model, prompt, proposer, sampling, budget, depth):
    state = open_state(draft_model, prompt, sampling)
    try:
        tree = proposer.propose(state, 17, budget, depth).tree.validate(draft_model.vocab_size, budget)
        assert tree.tokens[0] == 17
        assert max(tree.depths()) <= depth
        assert (tree.draft is not None) == (not sampling.greedy and tree.size > 1)
        if proposer.name == "chain":
            assert tree.parents == tuple(range(-1, tree.size - 1))
            assert tree.size == min(budget, depth + 1)
        if proposer.name == "dynamic":
            assert tree.size == budget  # a 320-token vocabulary always has enough candidates
    finally:
        state.release()


def test_stree_preset_shape(draft_model, prompt):
    assert STREE_13.size() == 13 and STREE_13.depth == 4
    assert ShapeTable.parse("3,2-1,2-1,3").branching == STREE_13.branching
    state = open_state(draft_model, prompt, GREEDY)
    try:
        tree = StaticProposer().propose(state, 5, 64, 8).tree
    finally:
        state.release()
    assert tree.size == 13
    kids = [len(tree.children(i)) for i in range(tree.size)]
    by_depth = {}
    for i, d in enumerate(tree.depths()):
        by_depth.setdefault(d, []).append(kids[i])
    # per depth, children counts of nodes in rank (generation) order
    assert by_depth[0] == [3]
    assert by_depth[1] == [2, 1, 0]
    assert by_depth[2] == [2, 1, 0]
    assert by_depth[3] == [3, 0, 0]
    assert by_depth[4] == [0, 0, 0]


def test_greedy_children_are_the_top_tokens(draft_model, prompt):
    state = open_state(draft_model, prompt, GREEDY)
    try:
        tree = StaticProposer(ShapeTable("wide", ((4,),))).propose(state, 9, 8, 4).tree
        probs = state.node_probs(TokenTree.single(9))[0]
    finally:
        state.release()
    assert list(tree.tokens[1:]) == probs.topk(4).indices.tolist()


def test_sampled_children_are_a_prefix_of_draws_with_exact_dists(draft_model, prompt):
    state = open_state(draft_model, prompt, HOT)
    try:
        tree = DynamicProposer().propose(state, 9, 16, 4).tree
        probs = ChildPicker(HOT, PickRule.DRAWN).draft_distribution(state.logits(tree))
    finally:
        state.release()
    tree.validate(draft_model.vocab_size, 16)
    tokens, q = probs
    for i in range(tree.size):
        d = tree.draft[i]
        if d is None:
            continue
        # top_k=20 < support: the reported q is the target transform itself, listed in full
        assert len(d.tokens) == 20 and d.residual == 0.0
        listed = dict(zip(d.tokens, d.probs))
        expect = {t: p for t, p in zip(tokens[i].tolist(), q[i].tolist()) if p > 0}
        assert listed.keys() == expect.keys()
        assert max(abs(listed[t] - expect[t]) for t in listed) < 1e-5


def test_fused_keeps_lookup_and_prunes_draft_by_probability():
    lookup = TokenTree.from_sequences(1, [[2, 3, 4]])
    drafted = Draft(TokenTree((1, 2, 5, 6, 7), (-1, 0, 0, 1, 2)), (0.0, -0.1, -0.5, -0.3, -2.0))
    tree = merge(lookup, drafted, 6)
    paths = {tuple(tree.tokens_along(tree.path_to(i))) for i in range(tree.size)}
    assert {(1, 2), (1, 2, 3), (1, 2, 3, 4)} <= paths  # the n-gram branch, whole
    assert (1, 2, 6) in paths and (1, 5) in paths  # best draft-only nodes
    assert (1, 5, 7) not in paths and tree.size == 6  # least probable pruned


@pytest.mark.parametrize("sampling", [GREEDY, HOT], ids=["greedy", "sampling"])
def test_fused_through_drafter(draft_model, prompt, sampling):
    d = Drafter(draft_model, Options("fused", 12, 5, False), ahead=None)
    try:
        d.start("f", prompt, sampling)
        tree = d.draft(DraftCall("f", len(prompt), (), prompt[len(prompt) - 4])).tree
        tree.validate(draft_model.vocab_size, 12)
        assert tree.draft is None and max(tree.depths()) <= 5
    finally:
        d.close()
