"""Every acceptance rule emits tokens distributed exactly as the target: chi-square tests on a toy
vocabulary with known target (p) and draft (q) distributions, fixed seeds.

- follow_target with seeded target samples (target-only sampling), over a two-level tree;
- the per-node speculative-sampling rule (`accept_among_children`): one child (Leviathan),
  several children drawn from q without replacement, q with residual mass, under temperature /
  top-k / top-p transforms applied to both p and q;
- the whole `multi_draft_walk` (its own counter-based randomness) over a two-level tree whose
  children are drawn without replacement: the first token follows p_root and the second, given
  the first, follows the target's next-token distribution.

Trial counts: follow_target runs 10^5 trials. The speculative-sampling rule costs ~0.1-0.3 ms per
trial on a CPU (many tiny torch ops), so by default it runs 1.5*10^4 trials per case and the walk
3*10^3; `TREESERVE_STATS_SCALE=7` gives ~10^5 for the rule (about 5 minutes on two cores).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from scipy import stats

from treeserve import sampling
from treeserve.acceptance import accept_among_children, dense, follow_target
from treeserve.sampling import Sampling
from treeserve.tree import SparseDist, TokenTree
from verifier_service.results import choose, multi_draft_walk

V = 8
SCALE = float(os.environ.get("TREESERVE_STATS_SCALE", "1"))
NODE_TRIALS = int(15_000 * SCALE)
WALK_TRIALS = int(3_000 * SCALE)
ALPHA = 1e-4  # fixed seeds make the tests deterministic; this only guards against a bad seed choice
TRANSFORMS = {
    "t1": Sampling(temperature=1.0),
    "t0.7-topk5": Sampling(temperature=0.7, top_k=5),
    "t1.3-topp0.8": Sampling(temperature=1.3, top_p=0.8),
}


def _logits(seed: int, rows: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g, dtype=torch.float64) * 1.5


def assert_follows(counts: np.ndarray, p: np.ndarray, what: str) -> None:
    """Chi-square goodness of fit of `counts` (V,) to `p` (V,): zero-probability tokens must never
    appear, and bins with tiny expectations are pooled."""
    p = np.asarray(p, dtype=np.float64)
    p = p / p.sum()
    n = counts.sum()
    assert counts[p == 0].sum() == 0, f"{what}: emitted a token the target gives probability 0: {counts}"
    exp = p * n
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if (~big & (p > 0)).any():
        obs_b.append(counts[~big & (p > 0)].sum())
        exp_b.append(exp[~big & (p > 0)].sum())
    if len(obs_b) < 2:
        return
    res = stats.chisquare(obs_b, exp_b)
    assert res.pvalue > ALPHA, f"{what}: chi-square p = {res.pvalue:.2e}\nobserved {counts}\nexpected {np.round(exp, 1)}"


def assert_follows_given(pairs: np.ndarray, p_next: np.ndarray, what: str) -> None:
    """Chi-square of the counts `pairs[a, b]` of b following a against p_next[a, b], every `a` that
    occurred at once (each row's total fixed by what it observed: one degree of freedom less per
    row); cells with tiny expectations are pooled."""
    rows = [a for a in range(len(pairs)) if pairs[a].sum() > 0]
    obs, exp = [], []
    small_obs = small_exp = 0.0
    for a in rows:
        p = np.asarray(p_next[a], dtype=np.float64)
        p = p / p.sum()
        assert pairs[a][p == 0].sum() == 0, f"{what}: after {a}, a token the target gives probability 0"
        e = p * pairs[a].sum()
        big = e >= 5
        obs += list(pairs[a][big])
        exp += list(e[big])
        small_obs += pairs[a][~big & (p > 0)].sum()
        small_exp += e[~big & (p > 0)].sum()
    if small_exp > 0:
        obs.append(small_obs)
        exp.append(small_exp)
    assert len(obs) > len(rows), f"{what}: nothing to test"
    res = stats.chisquare(obs, exp, ddof=len(rows) - 1)
    assert res.pvalue > ALPHA, f"{what}: chi-square p = {res.pvalue:.2e} over {len(rows)} first tokens"


def draws_without_replacement(q: np.ndarray, k: int, n: int, rng) -> np.ndarray:
    """(n, k) ordered samples without replacement from q (Gumbel-top-k)."""
    with np.errstate(divide="ignore"):
        keys = np.log(q)[None, :] + rng.gumbel(size=(n, len(q)))
    return np.argsort(-keys, axis=1)[:, :k]


# ---- follow_target: target-only sampling --------------------------------------------------------
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_follow_target_with_sampling(name):
    s = TRANSFORMS[name]
    n = 100_000
    # a toy "bigram" target: p_root, and the next-token distribution after each token
    p_root = sampling.transform(_logits(1)[0], s)
    p_next = sampling.transform(_logits(2, V), s)
    # root; children carry tokens 0..3; node 1 (token 0) has children with tokens 1 and 2
    tree = TokenTree((5, 0, 1, 2, 3, 1, 2), (-1, 0, 0, 0, 0, 1, 1))
    depth = tree.depths()
    base = torch.arange(n, dtype=torch.long) * 4  # committed length per trial: positions never repeat
    per_node = []
    for i in range(tree.size):
        probs = (p_root if i == 0 else p_next[tree.tokens[i]]).expand(n, V)
        per_node.append(choose(torch.log(probs), Sampling(1.0, seed=s.seed or 11), base + depth[i] + 1))
    target = torch.stack(per_node, 1).tolist()
    first = np.zeros(V, dtype=np.int64)
    second = np.zeros((V, V), dtype=np.int64)
    for row in target:
        emitted = follow_target(tree, row).emitted(tree)
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[0], emitted[1]] += 1
    assert_follows(first, p_root.numpy(), f"{name}: first token")
    for tok in (0, 1, 2, 3):  # tokens that are children of the root: their successor was verified too
        assert_follows(second[tok], p_next[tok].numpy(), f"{name}: second token after {tok}")


# ---- the per-node rule, 10^5 trials each -------------------------------------------------------
def _node_trials(p: torch.Tensor, q: torch.Tensor, k: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    kids = draws_without_replacement(q.numpy(), k, n, rng)
    u = rng.random((n, k))
    residual_u = torch.from_numpy(rng.random((n, V)))
    counts = np.zeros(V, dtype=np.int64)
    for t in range(n):
        _, tok = accept_among_children(p, q, kids[t].tolist(), u[t].tolist(), residual_u[t])
        counts[tok] += 1
    return counts


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_leviathan_one_child(name):
    s = TRANSFORMS[name]
    p = sampling.transform(_logits(3)[0], s).double()
    q = sampling.transform(_logits(4)[0], s).double()
    assert_follows(_node_trials(p, q, 1, NODE_TRIALS, seed=5), p.numpy(), f"{name}: one child")


@pytest.mark.parametrize("name", ["t1", "t1.3-topp0.8"])
def test_several_children_without_replacement(name):
    s = TRANSFORMS[name]
    p = sampling.transform(_logits(6)[0], s).double()
    q = sampling.transform(_logits(7)[0], s).double()
    k = min(3, int((q > 0).sum()))
    assert_follows(_node_trials(p, q, k, NODE_TRIALS, seed=8), p.numpy(), f"{name}: {k} children")


def test_residual_mass_in_q():
    """q lists three tokens and spreads the rest uniformly (a truncated drafter distribution)."""
    p = sampling.transform(_logits(9)[0], Sampling(temperature=1.0)).double()
    sparse = SparseDist((2, 5, 6), (0.35, 0.25, 0.15), 0.25)
    q = dense(sparse, V)
    assert_follows(_node_trials(p, q, 3, NODE_TRIALS, seed=10), p.numpy(), "residual q, 3 children")
    assert_follows(_node_trials(p, q, 1, NODE_TRIALS, seed=11), p.numpy(), "residual q, 1 child")


def test_draft_equal_to_target_accepts_first_child():
    """Sanity of the rule itself: when q == p the first child is always accepted."""
    p = sampling.transform(_logits(12)[0], Sampling(temperature=1.0)).double()
    rng = np.random.default_rng(0)
    for t in range(200):
        kids = draws_without_replacement(p.numpy(), 2, 1, rng)[0].tolist()
        k, tok = accept_among_children(p, p, kids, rng.random(2).tolist(), torch.from_numpy(rng.random(V)))
        assert (k, tok) == (0, kids[0])


# ---- the whole walk --------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["chain", "tree"])
def test_multi_draft_walk(case):
    """Two levels drawn from q (with residual mass) without replacement: 'chain' is one child per
    node (Leviathan), 'tree' three children at the root and two below the first."""
    s = Sampling(temperature=0.9, top_k=6, seed=1234)
    n = WALK_TRIALS
    p_root = sampling.transform(_logits(13)[0], s).double()
    p_next = sampling.transform(_logits(14, V), s).double()
    q_root_np = sampling.transform(_logits(15)[0], s).double().numpy()
    # the drafter reports its top-4 exactly and the rest as residual mass (non-zero everywhere)
    q_root = _truncated(q_root_np, 4)
    q_child = _truncated(sampling.transform(_logits(16)[0], s).double().numpy(), 4)
    k_root, k_child = (1, 1) if case == "chain" else (3, 2)
    rng = np.random.default_rng(17)
    roots = draws_without_replacement(dense(q_root, V).numpy(), k_root, n, rng)
    grand = draws_without_replacement(dense(q_child, V).numpy(), k_child, n, rng)
    first = np.zeros(V, dtype=np.int64)
    second = np.zeros((V, V), dtype=np.int64)
    for t in range(n):
        toks = [7, *roots[t].tolist(), *grand[t].tolist()]
        parents = [-1, *[0] * k_root, *[1] * k_child]
        draft = [q_root, q_child, *[None] * (k_root - 1 + k_child)]
        tree = TokenTree(tuple(toks), tuple(parents), tuple(draft)).validate(V, 16)
        probs = torch.stack([p_root, *(p_next[tok] for tok in tree.tokens[1:])])
        emitted = multi_draft_walk(tree, probs, 5 * t, s.seed).emitted(tree)
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[0], emitted[1]] += 1
    assert_follows(first, p_root.numpy(), f"walk {case}: first token")
    for tok in range(V):
        if second[tok].sum() >= 300:
            assert_follows(second[tok], p_next[tok].numpy(), f"walk {case}: second token after {tok}")
    # and every first token's second together (the rarer ones too), in one test
    assert second.sum() > n // 2, "too few walks went past their first token for the test to say anything"
    assert_follows_given(second, p_next.numpy(), f"walk {case}: second token given the first")


def _truncated(q: np.ndarray, keep: int) -> SparseDist:
    top = np.argsort(-q)[:keep]
    probs = tuple(float(q[i]) * 0.9 for i in top)
    return SparseDist(tuple(int(i) for i in top), probs, 1.0 - sum(probs))
