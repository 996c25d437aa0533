"""The token tree: construction, structure, validation messages, wire round trip."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeserve.tree import SparseDist, TokenTree, TreeError, tree_from_proto, tree_to_proto

VOCAB = 50


@st.composite
def trees(draw, max_nodes=40, with_draft=False):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, VOCAB - 1))]
    used: set[tuple[int, int]] = set()
    for i in range(1, n):
        free = [t for t in range(VOCAB) if (parents[i], t) not in used]
        t = draw(st.sampled_from(free))
        used.add((parents[i], t))
        tokens.append(t)
    draft = None
    if with_draft:
        draft = []
        kids = {i: [tokens[j] for j in range(n) if parents[j] == i] for i in range(n)}
        for i in range(n):
            listed = sorted(set(kids[i]) | {draw(st.integers(0, VOCAB - 1))})
            w = [draw(st.floats(0.05, 1.0)) for _ in listed]
            residual = draw(st.sampled_from([0.0, 0.25]))
            s = sum(w) / (1.0 - residual)
            draft.append(SparseDist(tuple(listed), tuple(x / s for x in w), residual))
    return TokenTree(tuple(tokens), tuple(parents), None if draft is None else tuple(draft))


@settings(max_examples=150, deadline=None)
@given(trees())
def test_structure_invariants(tree):
    tree.validate(VOCAB, 64)
    depth = tree.depths()
    mask = tree.ancestor_mask()
    for i in range(tree.size):
        path = tree.path_to(i)
        assert path[0] == 0 and path[-1] == i and tree.is_path(path)
        assert len(path) == depth[i] + 1 == sum(mask[i])
        assert all(mask[i][j] for j in path)
    leaves = set(tree.leaves())
    assert all((not tree.children(i)) == (i in leaves) for i in range(tree.size))
    assert sum(len(tree.children(i)) for i in range(tree.size)) == tree.size - 1


@settings(max_examples=100, deadline=None)
@given(trees(with_draft=True))
def test_proto_round_trip(tree):
    back = tree_from_proto(tree_to_proto(tree), VOCAB, 64)
    assert back.tokens == tree.tokens and back.parents == tree.parents
    for a, b in zip(back.draft, tree.draft):
        assert a.tokens == b.tokens and a.residual == pytest.approx(b.residual)
        assert a.probs == pytest.approx(b.probs, rel=1e-6)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=6), max_size=8), st.integers(1, 30))
def test_prefix_merge(seqs, budget):
    tree = TokenTree.from_sequences(3, seqs, max_nodes=budget).validate(10, budget)
    # every stored continuation prefix is a path, and paths are unique per token sequence
    seen = {}
    for i in range(tree.size):
        key = tuple(tree.tokens_along(tree.path_to(i))[1:])
        assert key not in seen
        seen[key] = i
    if tree.size < budget:  # nothing was cut: every continuation is fully present
        for s in seqs:
            assert tuple(s) in seen
    # continuations are taken in order, each as far as the budget lets it go: an independent
    # account of which prefixes are kept
    kept = {()}
    for s in seqs:
        for n in range(1, len(s) + 1):
            if tuple(s[:n]) not in kept:
                if len(kept) >= budget:
                    break
                kept.add(tuple(s[:n]))
    assert set(seen) == kept


def test_chain_and_single():
    c = TokenTree.chain([4, 5, 6])
    assert c.parents == (-1, 0, 1) and c.leaves() == [2]
    assert TokenTree.single(7).size == 1


@pytest.mark.parametrize(
    "tokens,parents,message",
    [
        ((), (), "empty"),
        ((1, 2), (-1,), "2 tokens but 1 parents"),
        ((1, 2), (0, 0), "node 0 must be the root"),
        ((1, 2, 3), (-1, 0, -1), "second root"),
        ((1, 2, 3), (-1, 2, 0), "node 1 has parent 2"),
        ((1, 2, 3), (-1, 0, 5), "node 2 has parent 5"),
        ((1, 2), (-1, -7), "node 1 has parent -7"),
        ((1, 99), (-1, 0), "token 99 outside the vocabulary"),
        ((-1, 2), (-1, 0), "token -1 outside"),
        ((1, 2, 2), (-1, 0, 0), "siblings must differ"),
    ],
)
def test_rejects_malformed(tokens, parents, message):
    with pytest.raises(TreeError, match=message):
        TokenTree(tokens, parents).validate(VOCAB, 16)


@st.composite
def maybe_broken_trees(draw):
    """(tokens, parents): a valid tree, or one with a node's token or parent changed to anything
    nearby, or a parent dropped or added."""
    n = draw(st.integers(0, 9))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, VOCAB - 1)) for _ in range(n)]
    change = draw(st.sampled_from(["none", "none", "token", "parent", "drop", "add"]))
    if change == "token" and n:
        tokens[draw(st.integers(0, n - 1))] = draw(st.integers(-2, VOCAB + 1))
    elif change == "parent" and n:
        parents[draw(st.integers(0, n - 1))] = draw(st.integers(-2, n + 1))
    elif change == "drop" and n:
        parents.pop()
    elif change == "add":
        parents.append(draw(st.integers(-1, n)))
    return tokens, parents


@settings(max_examples=500, deadline=None)
@given(maybe_broken_trees(), st.integers(1, 9))
def test_fast_validity_check_agrees_with_the_full_one(tree_lists, max_nodes):
    """`validate` first runs C-level checks (`_plainly_valid`) and walks the nodes only when they fail:
    both must accept exactly the same trees, and the wire decoder must accept and refuse alike."""
    tokens, parents = tree_lists
    tree = TokenTree(tuple(tokens), tuple(parents))
    try:
        tree._check_structure(VOCAB, max_nodes)
        valid = True
    except TreeError:
        valid = False
    assert tree._plainly_valid(VOCAB, max_nodes) == valid
    from treeserve.v1 import treeserve_pb2 as pb

    msg = pb.TokenTree(tokens=tokens, parents=parents)
    if valid:
        assert tree_from_proto(msg, VOCAB, max_nodes) == tree
    else:
        with pytest.raises(TreeError):
            tree_from_proto(msg, VOCAB, max_nodes)


def test_rejects_oversized():
    with pytest.raises(TreeError, match="more than the limit of 4"):
        TokenTree.chain([1] * 5).validate(VOCAB, 4)


@pytest.mark.parametrize(
    "dist,message",
    [
        (SparseDist((2,), (0.5,)), "sum to 0.5"),
        (SparseDist((2, 2), (0.5, 0.5)), "repeated token"),
        (SparseDist((2,), (0.5, 0.5)), "1 tokens but 2 probabilities"),
        (SparseDist((2, 70), (0.5, 0.5)), "draft token 70 outside"),
        (SparseDist((2,), (float("nan"),)), "not finite"),
        (SparseDist((2, 3), (1.5, -0.5)), "negative"),
        (SparseDist((3,), (1.0,)), "draft probability 0"),
    ],
)
def test_rejects_bad_distributions(dist, message):
    tree = TokenTree((1, 2), (-1, 0), (dist, None))
    with pytest.raises(TreeError, match=message):
        tree.validate(VOCAB, 16)


def test_a_distribution_listing_more_than_the_cap_is_refused_before_it_is_copied():
    """A whole vocabulary per node would stall the model thread for seconds: refused on the wire
    form, by the cap, before the lists are turned into tuples (and by `validate` for a built tree)."""
    from treeserve.tree import MAX_DRAFT_SUPPORT, tree_from_proto, tree_to_proto

    n = MAX_DRAFT_SUPPORT + 1
    wide = SparseDist(tuple(range(n)), (1.0 / n,) * n)
    tree = TokenTree((1, 2), (-1, 0), (wide, None))
    with pytest.raises(TreeError, match=f"lists {n} tokens, more than {MAX_DRAFT_SUPPORT}"):
        tree.validate(10 * n, 16)
    with pytest.raises(TreeError, match=r"draft\[0\]: .* more than"):
        tree_from_proto(tree_to_proto(tree), 10 * n, 16)
    at_cap = SparseDist(tuple(range(n - 1)), (1.0 / (n - 1),) * (n - 1))
    ok = TokenTree((1, 2), (-1, 0), (at_cap, None))
    assert tree_from_proto(tree_to_proto(ok), 10 * n, 16) == ok


def test_draft_needed_for_inner_nodes():
    tree = TokenTree((1, 2), (-1, 0), (None, None))
    with pytest.raises(TreeError, match="children but no draft distribution"):
        tree.validate(VOCAB, 16)
    with pytest.raises(TreeError, match="2 nodes but 1 draft"):
        TokenTree((1, 2), (-1, 0), (SparseDist((2,), (1.0,)),)).validate(VOCAB, 16)


def test_residual_mass_gives_unlisted_probability():
    d = SparseDist((1,), (0.6,), 0.4)
    assert d.prob(1, 5) == pytest.approx(0.6)
    assert d.prob(3, 5) == pytest.approx(0.1)


def test_a_wire_distribution_within_the_tolerance_is_taken_with_its_mass_made_one():
    """0.6 + 0.4008 passes the wire's 1e-3 tolerance; acceptance then reads q as a distribution:
    each probability over the total, so every consumer of the tree sees the same exact q."""
    tree = TokenTree((1, 2), (-1, 0), (SparseDist((2, 3), (0.6, 0.3), 0.1008), None))
    got = tree_from_proto(tree_to_proto(tree), VOCAB, 16).draft[0]
    assert sum(got.probs) + got.residual == pytest.approx(1.0, abs=1e-12)
    assert got.probs[0] / got.probs[1] == pytest.approx(2.0) and got.tokens == (2, 3)
    exact = TokenTree((1, 2), (-1, 0), (SparseDist((2,), (1.0,)), None))
    assert tree_from_proto(tree_to_proto(exact), VOCAB, 16).draft[0] == SparseDist((2,), (1.0,))
