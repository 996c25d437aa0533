"""Random token trees for model tests, and the greedy acceptance walk."""
from __future__ import annotations

import random

import torch

from tests.kernels.tree_cases import make_parents
from tests.models.hf_zoo import VOCAB
from treeserve.tree import TokenTree


def random_tree(rng: random.Random, root: int, n: int, kind: str) -> TokenTree:
    """A tree of shape `kind` (chain, star, random, ...) with distinct tokens among siblings."""
    parents = make_parents(kind, n, rng)
    tokens = [root]
    used: dict[int, set] = {}
    for i in range(1, len(parents)):
        taken = used.setdefault(parents[i], set())
        t = rng.randrange(1, VOCAB)
        while t in taken:
            t = rng.randrange(1, VOCAB)
        taken.add(t)
        tokens.append(t)
    return TokenTree(tuple(tokens), tuple(parents))


def guided_tree(rng: random.Random, root: int, truth: list[int], n: int) -> TokenTree:
    """A random tree whose first branch follows `truth` (the target's true continuation) for a
    random number of steps, sometimes with a wrong token spliced in; other nodes are random."""
    follow = rng.randrange(0, min(len(truth), n - 1) + 1)
    seq = list(truth[:follow])
    if seq and rng.random() < 0.3:
        k = rng.randrange(len(seq))
        seq[k] = (seq[k] % (VOCAB - 1)) + 1
    others = []
    while sum(len(o) for o in others) + len(seq) < 2 * n:
        others.append([rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 4))])
    return TokenTree.from_sequences(root, [seq] + others, max_nodes=n)


def greedy_walk(tree: TokenTree, argmax: list[int]) -> tuple[list[int], int]:
    """Accepted path (from the root) and bonus token under greedy acceptance."""
    node, path = 0, [0]
    while True:
        child = tree.child_with_token(node, argmax[node])
        if child is None:
            return path, argmax[node]
        node = child
        path.append(node)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    return logits.argmax(-1).tolist()
