"""Random best-first growth runs for `kernels.tree_growth`: the same children fed level by level to
two implementations of `grow_level`, every buffer compared after each level.

Children come from a seeded generator rather than a model, so runs reach every tree shape (chains
when each node has one child, stars at depth 1, deep trees, bushy ones) and tie often: probabilities
drawn from a few powers of two give equal scores, and then the key decides."""
from __future__ import annotations

import math
import random

import torch

from kernels.tree_growth import GrowthTables, Shape

TIED = (0.5, 0.25, 0.125, 0.0625)


def children(rng: random.Random, K: int, kk: int, ties: bool, device, scale: float = 1.0):
    """Top-k children of K frontier rows: tokens (K, kk) int64, probs (K, kk) float32, largest first
    in most rows (out of order in some, where the cap by earlier siblings decides), zero (no child)
    past a random count per row. `scale` > 1 gives ranking probabilities above 1, where the cap by
    the parent's score decides."""
    tokens, probs = [], []
    for _ in range(K):
        n = rng.choice([kk, kk, rng.randint(0, kk)])
        ps = sorted((rng.choice(TIED) if ties else rng.random() ** 3 for _ in range(n)), reverse=True)
        if rng.random() < 0.25:
            rng.shuffle(ps)
        probs.append([p * scale for p in ps] + [0.0] * (kk - n))
        tokens.append([rng.randrange(1000) for _ in range(kk)])
    return (torch.tensor(tokens, dtype=torch.int64, device=device),
            torch.tensor(probs, dtype=torch.float32, device=device))


def draws(rng: random.Random, K: int, kk: int, m: int, ties: bool, device):
    """Distributions of K rows (tokens (K, m), probs (K, m), largest first, zero-padded) and the
    columns drawn from each (K, kk): the positive-mass columns in a random order, then the rest."""
    tokens, probs, orders = [], [], []
    for _ in range(K):
        n = rng.randint(1, m)
        ps = sorted((rng.choice(TIED) if ties else rng.random() + 1e-3 for _ in range(n)), reverse=True)
        total = sum(ps)
        probs.append([p / total for p in ps] + [0.0] * (m - n))
        tokens.append(rng.sample(range(1000), m))
        drawn = rng.sample(range(n), n) + list(range(n, m))
        orders.append(drawn[:kk])
    return (torch.tensor(tokens, dtype=torch.int64, device=device),
            torch.tensor(probs, dtype=torch.float32, device=device),
            torch.tensor(orders, dtype=torch.int64, device=device))


def tables(shape: Shape, root: int, length: int, device) -> GrowthTables:
    t = GrowthTables(shape, device)
    t.inputs.copy_(torch.tensor([root, length, 0, 0]))
    t.reset()
    return t


def assert_same_selection(a: GrowthTables, b: GrowthTables) -> None:
    """What the next level and the caller read: the counts, the selection and its fields, the
    frontier, and the forward's trees."""
    n = int(a.counts[0])
    assert a.counts.tolist() == b.counts.tolist()
    keys = a.chosen[:n]
    assert keys.tolist() == b.chosen[:n].tolist()
    for name in ("rows", "fkey", "tree_tokens", "tree_positions", "tree_parents", "last_tokens", "last_parents"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    for name in ("token", "parent", "depth", "logp", "score"):
        torch.testing.assert_close(getattr(a, name)[keys], getattr(b, name)[keys], rtol=1e-14, atol=0, msg=name)


def assert_same(a: GrowthTables, b: GrowthTables) -> None:
    """Every buffer, equal (the spare rows excepted: the twin parks writes there)."""
    assert_same_selection(a, b)
    for name in ("token", "parent", "depth", "expansion", "dist_tokens", "dist_probs"):
        assert torch.equal(getattr(a, name)[:-1].cpu(), getattr(b, name)[:-1].cpu()), name
    # the two take float64 logs with different libraries (numpy's or CUDA's, and torch's): a last
    # bit apart now and then. Equal probabilities still give equal logs within each, so ties hold.
    for name in ("logp", "score"):
        torch.testing.assert_close(getattr(a, name)[:-1].cpu(), getattr(b, name)[:-1].cpu(), rtol=1e-14, atol=0,
                                   msg=name)


def run(shape: Shape, seed: int, drawn: bool, ties: bool, step, twin, device, scale: float = 1.0,
        view=lambda x: x, used: GrowthTables | None = None) -> int:
    """Grow one random tree with `step` and with `twin`, comparing after every level; returns the
    number of levels run. `view` is applied to each argument `step` gets (a layout test); `used`:
    tables of an earlier run that `step` starts from, reset, instead of fresh ones."""
    rng = random.Random(seed)
    root, length = rng.randrange(1000), rng.randrange(100)
    b = tables(shape, root, length, device)
    if used is None:
        a = tables(shape, root, length, device)
    else:
        a = used
        a.inputs.copy_(b.inputs)
        a.reset()
    compare = assert_same if used is None else assert_same_selection
    K = shape.k
    kk = rng.randint(1, K) if rng.random() < 0.3 else K
    for level in range(shape.depth):
        if drawn:
            args = draws(rng, K, min(kk, shape.support), shape.support, ties, device)
        else:
            args = children(rng, K, kk, ties, device, scale)
        step(a, *[view(x) for x in args])
        twin(b, *args)
        compare(a, b)
        check_tree(a, shape, length)
        if int(a.counts[1]) == 0:
            return level + 1
    return shape.depth


def check_tree(t: GrowthTables, shape: Shape, length: int) -> None:
    """The selection is a tree in key order within the budget and depth, scores never rise along a
    path, and the next forward's tree is it (tokens, positions after the committed `length`),
    padded with children of the root."""
    n = int(t.counts[0])
    keys = t.chosen[:n].tolist()
    assert 1 <= n <= shape.budget and keys[0] == 0 and keys == sorted(set(keys))
    parents = t.tree_parents.tolist()
    score, depth = t.score.tolist(), t.depth.tolist()
    assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, n))
    assert all(p == 0 for p in parents[n:])
    assert t.tree_tokens.tolist() == [int(t.token[k]) for k in keys] + [0] * (shape.nodes - n)
    assert t.tree_positions.tolist() == [length + depth[k] for k in keys] + [length + 1] * (shape.nodes - n)
    for i in range(1, n):
        assert t.parent[keys[i]] == keys[parents[i]]
        assert score[keys[i]] <= score[keys[parents[i]]] and math.isfinite(score[keys[i]])
        assert depth[keys[i]] == depth[keys[parents[i]]] + 1 <= shape.depth
