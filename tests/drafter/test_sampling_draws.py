"""Sampled children are draws without replacement from exactly the reported distribution."""
import itertools
import math

import torch
from scipy.stats import chi2

from drafter_service.children import ChildPicker, PickRule
from treeserve.sampling import Sampling

Q = [0.35, 0.25, 0.15, 0.12, 0.08, 0.05]
TOKENS = [11, 3, 250, 40, 7, 99]
VOCAB = 320


def logits_for(n: int) -> torch.Tensor:
    row = torch.full((VOCAB,), -30.0)
    row[TOKENS] = torch.log(torch.tensor(Q))
    return row.expand(n, VOCAB).clone()


def without_replacement(order) -> float:
    p, left = 1.0, 1.0
    for t in order:
        q = Q[TOKENS.index(t)]
        p *= q / left
        left -= q
    return p


def test_reported_distribution_is_the_transformed_one():
    s = Sampling(temperature=1.0, top_k=6, seed=1)
    [kids] = ChildPicker(s, PickRule.DRAWN).pick(logits_for(1), 3, position=10, salts=[0])
    d = kids.dist
    assert d.residual == 0.0 and sorted(d.tokens) == sorted(TOKENS)
    for t, p in zip(d.tokens, d.probs):
        assert abs(p - Q[TOKENS.index(t)]) < 1e-6
    assert len(kids.tokens) == 3 and len(set(kids.tokens)) == 3


def test_large_support_is_truncated_and_renormalised():
    s = Sampling(temperature=1.5, seed=2)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    out = ChildPicker(s, PickRule.DRAWN, support=16).pick(logits, 4, position=3, salts=[0, 1])
    for kids in out:
        assert len(kids.dist.tokens) == 16 and kids.dist.residual == 0.0
        assert abs(sum(kids.dist.probs) - 1.0) < 1e-5
        assert set(kids.tokens) <= set(kids.dist.tokens)


def test_draw_order_follows_without_replacement_probabilities():
    n, k = 24000, 3
    s = Sampling(temperature=1.0, top_k=6, seed=7)
    picker = ChildPicker(s, PickRule.DRAWN)
    counts: dict[tuple, int] = {}
    # distinct salts and positions: independent draws, as for different nodes and steps
    for pos in range(4):
        for kids in picker.pick(logits_for(n // 4), k, position=100 + pos, salts=range(n // 4)):
            counts[kids.tokens] = counts.get(kids.tokens, 0) + 1
    cells = list(itertools.permutations(TOKENS, k))
    expected = [n * without_replacement(c) for c in cells]
    assert abs(sum(expected) - n) < 1e-6 * n
    stat = sum((counts.get(c, 0) - e) ** 2 / e for c, e in zip(cells, expected))
    assert set(counts) <= set(cells)
    assert stat < chi2.ppf(0.999, len(cells) - 1), stat


def test_draws_depend_on_seed_position_and_node():
    s = Sampling(temperature=1.0, top_k=6, seed=7)
    picker = ChildPicker(s, PickRule.DRAWN)
    a = picker.pick(logits_for(64), 6, position=5, salts=range(64))
    again = picker.pick(logits_for(64), 6, position=5, salts=range(64))
    assert [x.tokens for x in a] == [x.tokens for x in again]  # reproducible
    assert len({x.tokens for x in a}) > 10  # nodes draw independently
    other = ChildPicker(Sampling(1.0, 6, 0.0, 8), PickRule.DRAWN).pick(logits_for(64), 6, position=5, salts=range(64))
    assert [x.tokens for x in a] != [x.tokens for x in other]
    assert not math.isnan(sum(a[0].logq))
