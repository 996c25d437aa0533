"""Random token-tree shapes for kernel tests: chain, star, deep, random, single node."""
from __future__ import annotations

import random

import torch

KINDS = ("single", "chain", "star", "deep", "random", "bushy")


def make_parents(kind: str, n: int, rng: random.Random) -> list[int]:
    """Local parent list of a tree of `n` nodes (n is forced to 1 for 'single')."""
    if kind == "single" or n == 1:
        return [-1]
    if kind == "chain":
        return [-1] + list(range(n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    if kind == "deep":  # a long spine with a few short side branches
        parents = [-1]
        for i in range(1, n):
            parents.append(i - 1 if rng.random() < 0.8 else rng.randrange(i))
        return parents
    if kind == "bushy":  # wide, shallow: parents among the last few nodes
        return [-1] + [rng.randrange(max(0, i - 4), i) for i in range(1, n)]
    if kind == "random":
        return [-1] + [rng.randrange(i) for i in range(1, n)]
    raise ValueError(kind)


def packed_batch(sizes_and_kinds, rng: random.Random, device="cpu"):
    """Pack trees: returns (parents (T,) int32, cu_seqlens (B+1,) int32, max_nodes, per-tree parent lists)."""
    lists = [make_parents(kind, n, rng) for n, kind in sizes_and_kinds]
    parents = torch.tensor([p for lst in lists for p in lst], dtype=torch.int32, device=device)
    cu = [0]
    for lst in lists:
        cu.append(cu[-1] + len(lst))
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
    return parents, cu_seqlens, max(len(lst) for lst in lists), lists


def path_to(parents: list[int], i: int) -> list[int]:
    """Root-to-i local node indices."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def random_branch(parents: list[int], rng: random.Random) -> list[int]:
    """A root-to-node path ending at a random node (an accepted path)."""
    return path_to(parents, rng.randrange(len(parents)))
