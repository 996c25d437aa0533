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


def test_the_random_runs_stop_both_ways():
    """The runs compared above end both ways: deep ones at their depth limit, others earlier, when
    no child of a level is selected."""
    ends = {(levels == depth) for budget, depth, nodes in SHAPES if depth >= 4 for seed in range(2)
            for levels in [growth_runs.run(Shape(budget, depth, nodes), seed, False, False,
                                           grow_level_ref, grow_level_ref, "cpu")]}
    assert ends == {True, False}


@pytest.mark.parametrize("budget,depth,nodes", [(5, 4, 8), (16, 5, 16)])
def test_ranking_probabilities_above_one(budget, depth, nodes):
    """A child's score is capped by its parent's, so even ranking probabilities above 1 (which no
    picker gives) keep every selection a tree, and both twins agree."""
    for seed in range(2):
        growth_runs.run(Shape(budget, depth, nodes), seed, False, False, grow_level, grow_level_ref, "cpu", scale=3.0)


@pytest.mark.parametrize("layout", ["row-slices", "column-major"])
def test_inputs_of_any_layout(layout):
    """Children given as slices of wider tensors (row strides past their width) or column-major."""
    def view(x):
        if layout == "row-slices":
            return torch.cat([x, torch.zeros_like(x)], dim=1)[:, : x.shape[1]]
        return x.t().contiguous().t()

    growth_runs.run(Shape(9, 3, 16), 0, False, True, grow_level, grow_level_ref, "cpu", view=view)
    growth_runs.run(Shape(9, 3, 16, 6), 1, True, False, grow_level, grow_level_ref, "cpu", view=view)


def test_tables_reused_after_a_run():
    """Tables reset after a whole run grow the next tree as fresh ones do (nothing left over is read)."""
    shape = Shape(8, 4, 8, 5)
    used = growth_runs.tables(shape, 0, 0, "cpu")
    for seed, drawn in [(0, False), (1, True), (2, False)]:
        growth_runs.run(shape, seed, drawn, seed == 2, grow_level, grow_level_ref, "cpu", used=used)


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


@pytest.mark.parametrize("step", [grow_level, grow_level_ref], ids=["kernel", "twin"])
def test_arguments_that_do_not_fit_are_refused(step):
    t = GrowthTables(Shape(4, 2, 4, 3), torch.device("cpu"))
    tokens, probs, order = growth_runs.draws(random.Random(0), 3, 3, 5, False, "cpu")
    with pytest.raises(ValueError, match="distributions of 5 tokens"):
        step(t, tokens, probs, order)
    tokens, probs = growth_runs.children(random.Random(0), 3, 4, False, "cpu")
    with pytest.raises(ValueError, match="4 children a node for a budget of 4"):
        step(t, tokens, probs)


def test_no_tree_for_a_budget_of_one():
    with pytest.raises(ValueError, match="no tree to grow"):
        GrowthTables(Shape(1, 2, 4), torch.device("cpu"))


def test_compiles_for_sm90():
    """The level kernel, at a small and the largest node bucket, ranked and drawn, compiles for an
    H100 without register spills (its GPU tests are the only other place it meets a compiler)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from kernels import tree_growth
    from tests.kernels.ssm_oracle import assert_compiles_for_sm90

    def run_all():
        for shape, drawn in ((Shape(5, 4, 8), False), (Shape(16, 5, 16, 16), True), (Shape(24, 4, 32), False)):
            growth_runs.run(shape, 0, drawn, False, grow_level, grow_level_ref, "cpu")

    assert_compiles_for_sm90([tree_growth._grow_level_kernel], run_all)
