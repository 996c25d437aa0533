"""`multi_draft_walk` decides every node at once (`node_outcomes`) and then follows pointers. It
must emit what the walk defined node by node emits: visit the root, apply `accept_among_children`
with the counter-based uniforms at the node's position, move to the accepted child, repeat.
The statistics of the rule itself are in tests/orchestrator/test_acceptance_stats.py."""
from __future__ import annotations

import random

import pytest
import torch

from tests.verifier.trees import random_tree, with_drafts
from treeserve import sampling
from treeserve.acceptance import Outcome, accept_among_children, dense, walk
from treeserve.tree import SparseDist, TokenTree
from verifier_service.results import draft_tables, multi_draft_walk

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


def walk_node_by_node(tree: TokenTree, probs: torch.Tensor, committed_length: int, seed: int) -> Outcome:
    """The walk's definition: only the visited nodes are decided, in order."""
    depths = tree.depths()
    vocab = probs.shape[-1]
    node, path = 0, [0]
    while True:
        position = torch.tensor([committed_length + depths[node] + 1])
        residual_u = sampling.uniforms(seed, position[:, None], sampling.STREAM_RESIDUAL, torch.arange(vocab)[None, :])[0]
        kids, dist = tree.children(node), tree.draft[node]
        if not kids or dist is None:
            _, tok = accept_among_children(probs[node], torch.zeros(vocab, dtype=torch.float64), (), (), residual_u)
            return Outcome(tuple(path), tok)
        u = sampling.uniforms(seed, position.expand(len(kids)), sampling.STREAM_ACCEPT, torch.arange(len(kids))).tolist()
        k, tok = accept_among_children(probs[node], dense(dist, vocab), [tree.tokens[c] for c in kids], u, residual_u)
        if k is None:
            return Outcome(tuple(path), tok)
        node = kids[k]
        path.append(node)


def target_probs(tree: TokenTree, vocab: int, rng: random.Random, sharp: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return torch.softmax(torch.randn(tree.size, vocab, generator=g) * sharp, -1)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_every_node_at_once_equals_the_walk_node_by_node(kernels, monkeypatch):
    monkeypatch.setenv("TREESERVE_KERNELS", kernels)
    rng = random.Random(20261127)
    vocab = 40
    lengths = set()
    trials = 60 if kernels == "reference" else 20
    for t in range(trials):
        tree = with_drafts(rng, random_tree(rng, rng.randrange(vocab), vocab, rng.randrange(1, 14)), vocab,
                           flat=t % 3 == 0)
        probs = target_probs(tree, vocab, rng, sharp=0.3 if t % 3 == 0 else 2.0)
        length, seed = rng.randrange(1000), rng.randrange(1 << 40)
        got = multi_draft_walk(tree, probs, length, seed)
        assert got == walk_node_by_node(tree, probs, length, seed), t
        lengths.add(len(got.accepted_nodes))
    assert len(lengths) >= 3  # the cases reach several depths, not only the root


def test_draft_tables_are_the_dense_distributions_and_draw_order():
    vocab = 10
    dist = SparseDist((4, 2, 7), (0.5, 0.2, 0.1), 0.2)
    tree = TokenTree((1, 4, 2, 3), (-1, 0, 0, 1), (dist, SparseDist((3,), (1.0,)), None, None))
    t = draft_tables(tree, vocab, committed_length=6, device="cpu")
    q, children, positions = t.q, t.children, t.positions
    assert torch.equal(q[0], dense(dist, vocab))
    assert q[1].tolist() == [0.0, 0.0, 0.0, 1.0] + [0.0] * 6
    assert (q[2:] == 0).all()
    assert children.tolist() == [[4, 2], [3, -1], [-1, -1], [-1, -1]]
    assert positions.tolist() == [7, 8, 8, 9]


def test_walk_follows_the_accepted_children():
    tree = TokenTree((1, 4, 2, 3, 5), (-1, 0, 0, 2, 2))
    assert walk(tree, [(1, 2), (-1, 9), (1, 5), (-1, 8), (-1, 6)]) == Outcome((0, 2, 4), 6)
    assert walk(tree, [(-1, 9)] + [(0, 0)] * 4) == Outcome((0,), 9)


def test_multi_draft_walk_needs_draft_distributions():
    with pytest.raises(ValueError, match="draft distributions"):
        multi_draft_walk(TokenTree((1, 2), (-1, 0)), torch.full((2, 5), 0.2), 0, 1)
