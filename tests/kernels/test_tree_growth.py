"""grow_level (Triton, interpreted) vs grow_level_ref, level by level over random growth runs, and
the twin's selection against a plain sort of every candidate in the table."""
import math
import random

import pytest
import torch

from kernels.tree_growth import GrowthTables, Shape, grow_level, grow_level_ref
from tests.kernels import growth_runs

# (budget, depth, node bucket): chains and pairs, stars (depth 1), deep limits, bushy trees, buckets
# past the budget and block sizes that are not powers of two
SHAPES = [(2, 1, 2), (2, 5, 16), (3, 2, 4), (9, 1, 16), (5, 4, 8), (16, 5, 16), (8, 7, 16), (13, 3, 32), (24, 4, 32)]


@pytest.mark.parametrize("budget,depth,nodes", SHAPES)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
def test_top_k_children(budget, depth, nodes, ties):
    for seed in range(2):
        growth_runs.run(Shape(budget, depth, nodes), seed, False, ties, grow_level, grow_level_ref, "cpu")


@pytest.mark.parametrize("budget,depth,nodes,support", [(3, 2, 4, 4), (8, 4, 16, 6), (16, 5, 16, 16), (12, 3, 16, 5)])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
def test_drawn_children(budget, depth, nodes, support, ties):
    for seed in range(3):
        growth_runs.run(Shape(budget, depth, nodes, support), seed, True, ties, grow_level, grow_level_ref, "cpu")


def test_runs_reach_every_depth_and_stop_at_the_limit():
    """The random runs the tests above compare are not all cut short: some reach the depth limit."""
    levels = [growth_runs.run(Shape(6, 4, 8), seed, False, False, grow_level_ref, grow_level_ref, "cpu")
              for seed in range(6)]
    assert max(levels) == 4 and min(levels) >= 1


def test_twin_selects_the_best_of_the_whole_table():
    """The twin ranks only the previous selection and the new children; a plain sort of every
    candidate ever made, by (-score, depth, key), selects the same nodes at every level."""
    rng = random.Random(3)
    shape = Shape(10, 5, 16)
    t = growth_runs.tables(shape, 7, 3, "cpu")
    made = {0}
    for level in range(shape.depth):
        n_front = int(t.counts[1])
        fk = t.fkey[:n_front].tolist()
        tokens, probs = growth_runs.children(rng, shape.k, shape.k, True, "cpu")
        grow_level_ref(t, tokens, probs)
        for f in range(n_front):
            for j in range(shape.k):
                if probs[f, j] > 0:
                    made.add(1 + level * shape.k ** 2 + f * shape.k + j)
        ranked = sorted(made, key=lambda k: (-float(t.score[k]), int(t.depth[k]), k))[: shape.budget]
        ranked = sorted(k for k in ranked if t.score[k] > -math.inf)
        assert t.chosen[: int(t.counts[0])].tolist() == ranked
        assert all(int(t.parent[k]) in fk for k in made if t.depth[k] == level + 1)
        if int(t.counts[1]) == 0:
            break


def test_mismatched_distribution_width_is_refused():
    t = GrowthTables(Shape(4, 2, 4, 3), torch.device("cpu"))
    tokens, probs, order = growth_runs.draws(random.Random(0), 3, 3, 5, False, "cpu")
    with pytest.raises(ValueError, match="distributions of 5 tokens"):
        grow_level(t, tokens, probs, order)


def test_no_tree_for_a_budget_of_one():
    with pytest.raises(ValueError, match="no tree to grow"):
        GrowthTables(Shape(1, 2, 4), torch.device("cpu"))
