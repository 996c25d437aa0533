"""Dynamic trees grown on the device (`drafter_service.growth`, run eagerly here) against their
plain twin, the host loop of `DynamicProposer.propose_on_host`: the same tree, path
log-probabilities and reported distributions, for every pick rule and many budgets and depths."""
import pytest

from drafter_service.children import ChildPicker, PickRule
from drafter_service.dynamic import DynamicProposer
from drafter_service.state import DraftState
from treeserve.sampling import Sampling

RULES = [
    (Sampling(), PickRule.GREEDY),
    (Sampling(temperature=0.8, top_k=40, top_p=0.9, seed=5), PickRule.RANKED),
    (Sampling(temperature=1.0, seed=11), PickRule.DRAWN),
    (Sampling(temperature=0.6, top_p=0.8, seed=12), PickRule.DRAWN),
]


@pytest.mark.parametrize("sampling,rule", RULES, ids=["greedy", "ranked", "drawn", "drawn-top-p"])
@pytest.mark.parametrize("budget,depth", [(2, 1), (3, 2), (4, 6), (8, 3), (13, 4), (16, 6), (32, 2)])
def test_grown_tree_equals_host_loop(draft_model, prompt, sampling, rule, budget, depth):
    picker = ChildPicker(sampling, rule)
    proposer = DynamicProposer()
    state = DraftState.open("g", prompt[:-3], sampling, picker, draft_model)
    try:
        assert state.can_grow(budget, depth)
        for root in prompt[-3:]:
            grown = proposer.propose(state, root, budget, depth)
            assert state.verified is not None and state.verified.tree.size <= budget
            plain = proposer.propose_on_host(state, root, budget, depth)
            assert grown.tree.tokens == plain.tree.tokens
            assert grown.tree.parents == plain.tree.parents
            assert grown.logp == pytest.approx(plain.logp, abs=1e-5)
            assert (grown.tree.draft is None) == (plain.tree.draft is None)
            for g, h in zip(grown.tree.draft or (), plain.tree.draft or ()):
                assert (g is None) == (h is None)
                if g is not None:  # the two forwards pad the tree differently: rounding apart
                    assert g.tokens == h.tokens and g.probs == pytest.approx(h.probs, rel=1e-4, abs=1e-7)
            assert max(grown.tree.depths()) <= depth and grown.tree.size <= budget
            state.advance([root])  # the next root sits one token further on
    finally:
        state.release()


SAME_TRUNCATIONS = [
    [(Sampling(temperature=1.0, seed=11), PickRule.DRAWN), (Sampling(temperature=0.45, seed=3), PickRule.DRAWN),
     (Sampling(temperature=1.7, seed=4), PickRule.DRAWN)],
    [(Sampling(temperature=0.8, top_k=40, top_p=0.9, seed=5), PickRule.RANKED),
     (Sampling(temperature=1.3, top_k=3, top_p=0.5, seed=6), PickRule.RANKED)],
    [(Sampling(temperature=0.6, top_k=7, seed=12), PickRule.DRAWN),
     (Sampling(temperature=1.1, top_k=1000, seed=13), PickRule.DRAWN)],  # top_k past the vocabulary
]


@pytest.mark.parametrize("settings", SAME_TRUNCATIONS, ids=["drawn", "ranked-top-k-top-p", "drawn-top-k"])
def test_one_growth_serves_every_value_of_its_transform(draft_model, prompt, settings):
    """Settings that differ only in temperature, top-k, top-p and seed share one growth table (its
    graphs, when captured), built for the first of them; each still grows the host loop's tree."""
    growth, _ = assert_one_growth_serves(draft_model, prompt, settings, 9, 4, abs_logp=1e-5)
    assert growth.picker.sampling == settings[0][0]  # built once, for the first


def assert_one_growth_serves(model, prompt, settings, budget, depth, abs_logp):
    """Every (sampling, rule) of `settings` keys the same growth, and growing a tree after
    `prompt[:-1]` gives the host loop's tree for each; returns that growth and its steps."""
    from drafter_service import draftlm

    keys = {draftlm._growth_key(budget, depth, ChildPicker(s, rule)) for s, rule in settings}
    assert len(keys) == 1
    for sampling, rule in settings:
        proposer = DynamicProposer()
        state = DraftState.open("v", prompt[:-1], sampling, ChildPicker(sampling, rule), model)
        try:
            grown = proposer.propose(state, prompt[-1], budget, depth)
            plain = proposer.propose_on_host(state, prompt[-1], budget, depth)
            assert (grown.tree.tokens, grown.tree.parents) == (plain.tree.tokens, plain.tree.parents)
            assert grown.logp == pytest.approx(plain.logp, abs=abs_logp)
        finally:
            state.release()
    return model._growths[keys.pop()]


def test_grown_tree_commits_its_last_level(draft_model, prompt):
    """After growing, a path of the last level's tree is committed without a forward pass, and the
    state then equals one that decoded those tokens one by one."""

    def deepest_last_path(forwarded):
        path = [0]
        while forwarded.children(path[-1]):
            path.append(forwarded.children(path[-1])[-1])
        assert len(path) > 1
        return path

    assert_commit_equals_decoding(draft_model, prompt[:-1],
                                  lambda state: DynamicProposer().propose(state, prompt[-1], 12, 4), deepest_last_path)


def assert_commit_equals_decoding(model, prefix, grow, choose_path):
    """`grow(state)` on one state of `prefix`; the tokens of `choose_path(its last forward tree)` are
    committed there and decoded one by one on a second state; both then give the same logits."""
    s = Sampling()
    picker = ChildPicker(s, PickRule.GREEDY)
    grown_state = DraftState.open("a", prefix, s, picker, model)
    plain_state = DraftState.open("b", prefix, s, picker, model)
    try:
        grow(grown_state)
        forwarded = grown_state.verified.tree
        tokens = list(forwarded.tokens_along(choose_path(forwarded)))
        grown_state.advance(tokens)
        grown_state.catch_up()
        for t in tokens:
            plain_state.advance([t])
            plain_state.catch_up()
        a = model.verify(grown_state.slot, _one(7))[0]
        b = model.verify(plain_state.slot, _one(7))[0]
        assert (a - b).abs().max() < 1e-4
    finally:
        grown_state.release()
        plain_state.release()


def _one(token):
    from treeserve.tree import TokenTree

    return TokenTree((token,), (-1,))


class TableDraft(DraftState):
    """A draft state whose logits at a node are a table's row for the node's token."""

    def __init__(self, sampling, picker, length, table):
        from drafter_service.state import TokenHistory

        super().__init__("t", sampling, TokenHistory(()), picker)
        self._length, self._table = length, table

    @property
    def length(self) -> int:
        return self._length

    def logits(self, tree, nodes=None):
        rows = range(tree.size) if nodes is None else nodes
        return self._table[[tree.tokens[i] for i in rows]]


# a bigram draft over 5 tokens whose rows repeat probabilities: candidates tie on score, so the
# tie rule (shallower first, then older) decides the selection
TIES = [[0.25, 0.25, 0.25, 0.25, 0.0],
        [0.5, 0.25, 0.25, 0.0, 0.0],
        [0.25, 0.25, 0.25, 0.25, 0.0],
        [0.5, 0.5, 0.0, 0.0, 0.0],
        [0.2, 0.2, 0.2, 0.2, 0.2]]


@pytest.mark.parametrize("sampling,rule", [RULES[0], (Sampling(temperature=1.0, seed=2), PickRule.DRAWN)],
                         ids=["greedy", "drawn"])
@pytest.mark.parametrize("budget,depth", [(3, 2), (6, 3), (9, 4), (14, 5)])
def test_growth_breaks_ties_as_the_host_loop(sampling, rule, budget, depth):
    assert_ties_broken_as_the_host_loop(sampling, rule, budget, depth, roots=range(5), lengths=(0, 17))


@pytest.mark.parametrize("sampling,rule", [RULES[0], (Sampling(temperature=1.0, seed=2), PickRule.DRAWN)],
                         ids=["greedy", "drawn"])
@pytest.mark.parametrize("budget,depth", [(6, 3), (14, 5)])
def test_growth_kernel_breaks_ties_as_the_host_loop(sampling, rule, budget, depth, monkeypatch):
    """The same with the level's Triton kernel (interpreted here) in place of its twin."""
    from kernels import ops, tree_growth

    monkeypatch.setattr(ops, "grow_level", tree_growth.grow_level)
    assert_ties_broken_as_the_host_loop(sampling, rule, budget, depth, roots=(0, 3), lengths=(17,))


def assert_ties_broken_as_the_host_loop(sampling, rule, budget, depth, roots, lengths):
    import torch

    from drafter_service.growth import Growth
    from kernels.tree_growth import Shape

    table = torch.log(torch.tensor(TIES, dtype=torch.float64)).float()
    picker = ChildPicker(sampling, rule)

    def forward(tokens, positions, parents, rows):
        return table[tokens[rows]]

    for root in roots:
        for length in lengths:
            state = TableDraft(sampling, picker, length, table)
            plain = DynamicProposer().propose_on_host(state, root, budget, depth)
            g = Growth(Shape(budget, depth, 16, min(picker.support, 5) if picker.reports_dists else 0), picker,
                       forward, torch.device("cpu"))
            g.start(root, length, 0, sampling)
            g.reset()
            for _ in range(depth):
                g.level()
                if int(g.frontier_count) == 0:
                    break
            grown, _ = g.read(picker.reports_dists)
            assert (grown.tree.tokens, grown.tree.parents) == (plain.tree.tokens, plain.tree.parents)
            assert grown.logp == pytest.approx(plain.logp, abs=1e-9)
            assert grown.tree.draft == plain.tree.draft


def test_which_trees_grow_on_the_device(draft_model, monkeypatch):
    """Trees of one node or no depth never grow; with captured graphs, only the first MAX_GROWTHS
    shapes do (later ones take the host loop instead of capturing again)."""
    from collections import OrderedDict
    from types import SimpleNamespace

    from drafter_service import draftlm

    picker = ChildPicker(Sampling(), PickRule.GREEDY)
    assert not draft_model.can_grow(1, 4, picker) and not draft_model.can_grow(8, 0, picker)
    assert draft_model.can_grow(8, 4, picker)
    full = OrderedDict(((b, "x"), None) for b in range(draftlm.MAX_GROWTHS))
    monkeypatch.setattr(draft_model, "_growths", full)
    assert draft_model.can_grow(8, 4, picker)  # eager: the least recently used table makes room
    monkeypatch.setattr(draft_model.lm, "graphs", SimpleNamespace(capture=True))
    assert not draft_model.can_grow(8, 4, picker)
    full[draftlm._growth_key(8, 4, picker)] = None
    assert draft_model.can_grow(8, 4, picker) and not draft_model.can_grow(8, 6, picker)
    full[draftlm._growth_key(8, 7, picker)] = None
    assert draft_model.can_grow(8, 9, picker)  # no path of an 8-node tree is longer than 7


def test_graph_runner_taken_up_after_growing(tiny_pair, prompt):
    """Growth tables built before `use_graphs` wrote the model's own stash: they are dropped, so a
    later tree's commit reads the stash its forward wrote."""
    from drafter_service.draftlm import DraftModel

    model = DraftModel.load(str(tiny_pair[1]), max_slots=8, max_len=1024)

    def grow_before_and_after(state):
        DynamicProposer().propose(state, prompt[-2], 6, 3)
        model.use_graphs(capture=False)
        DynamicProposer().propose(state, prompt[-2], 6, 3)

    assert_commit_equals_decoding(model, prompt[:-2], grow_before_and_after,
                                  lambda forwarded: [0, forwarded.children(0)[0]])


def test_prepared_growths_are_the_ones_trees_then_use(draft_model, prompt, monkeypatch):
    """`prepare_growths` builds each (budget, depth) for each picker once (shapes `can_grow` refuses
    are skipped); a tree of a prepared shape, at another temperature, builds nothing more."""
    from drafter_service import draftlm

    pickers = [ChildPicker(Sampling(), PickRule.GREEDY), ChildPicker(Sampling(temperature=1.0), PickRule.DRAWN)]
    shapes = [(5, 3), (6, 20), (1, 4)]  # depth 20 is capped at 5; one node never grows
    draft_model.prepare_growths(shapes, pickers)
    want = {draftlm._growth_key(b, min(d, b - 1), p) for b, d in shapes[:2] for p in pickers}
    assert want <= set(draft_model._growths)
    assert draft_model.prepare_growths(shapes, pickers) == 0  # nothing left to build
    assert growths_built_by_a_tree(draft_model, prompt, Sampling(temperature=0.7, seed=9), 6, 20, monkeypatch) == []


def growths_built_by_a_tree(model, prompt, sampling, budget, depth, monkeypatch) -> list:
    """The growth tables that drafting one dynamic tree (drawn children) after `prompt[:-1]` builds."""
    built = []
    original = model._build_growth
    monkeypatch.setattr(model, "_build_growth", lambda *a: built.append(a) or original(*a))
    state = DraftState.open("b", prompt[:-1], sampling, ChildPicker(sampling, PickRule.DRAWN), model)
    try:
        DynamicProposer().propose(state, prompt[-1], budget, depth)
    finally:
        state.release()
    return built


def test_a_drafter_that_captures_prepares_its_default_shapes(draft_model, monkeypatch):
    from drafter_service import draftlm
    from drafter_service.draftlm import DraftModel
    from drafter_service.engine import PREPARED_BUDGETS, Drafter, Options

    monkeypatch.setattr(DraftModel, "captures_growths", property(lambda self: True))
    monkeypatch.setattr(draft_model, "_growths", type(draft_model._growths)())
    Drafter(draft_model, Options("dynamic", 12, 4, False), max_sequences=2, max_nodes=16, ahead=None,
            background_sweep=False)
    budgets = sorted({b for b in PREPARED_BUDGETS if b <= 16} | {12})
    got = {(k[0], k[1], k[2]) for k in draft_model._growths}
    assert got == {(b, min(4, b - 1), rule) for b in budgets for rule in (PickRule.GREEDY, PickRule.DRAWN)}
    assert draftlm.MAX_GROWTHS >= len(got) + 8  # room left for other shapes
