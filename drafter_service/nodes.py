"""Bookkeeping for trees grown by a draft model: candidate nodes with stable ids, their cumulative
draft log-probabilities and the distributions their children were drawn from.

Ids are assigned in creation order, and a node is always created after its parent and after its
earlier-drawn siblings; a tree built from any parent-closed set of ids sorted by id is therefore in
topological order with siblings in draw order (what multi-draft acceptance needs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from drafter_service.children import Children
from drafter_service.proposer import Draft
from treeserve.tree import SparseDist, TokenTree


@dataclass(frozen=True)
class Node:
    id: int
    parent: int  # parent id, -1 for the root
    token: int
    depth: int
    logp: float  # cumulative draft log-probability of the path
    # ranking key: the parent's plus `rank_logq` (logp itself, unless the children were drawn),
    # non-increasing along each parent's draw order
    score: float
    # the node's place in the fixed candidate table of `kernels.tree_growth` (0 for the root):
    # it keys the noise of the node's own draws, so the host loop and the device loop draw alike
    key: int = 0


class NodeSet:
    def __init__(self, root: int):
        self.nodes: list[Node] = [Node(0, -1, int(root), 0, 0.0, 0.0)]
        self.dists: dict[int, SparseDist] = {}
        self.expanded: set[int] = set()

    def __len__(self) -> int:
        return len(self.nodes)

    def add_children(self, parent: int, children: Children, count: int | None = None, first_key: int = 0) -> list[int]:
        """Create nodes for the first `count` candidates (all when None) of `parent`; returns ids.
        The k-th candidate's key is `first_key + k`.

        A child's score is its parent's plus `rank_logq` of its place among the candidates, capped
        by its earlier sibling's, so ranking by score never prefers a later draw over an earlier
        one (children must form a prefix of the draw order), and by its parent's, so a parent
        always outranks its children."""
        p = self.nodes[parent]
        self.expanded.add(parent)
        if children.dist is not None:
            self.dists[parent] = children.dist
        # capped by the parent's score too: a no-op for probabilities up to 1, and what keeps every
        # selection a tree whatever the ranking probabilities
        ids, cap = [], p.score
        for k, (tok, lq, rank_lq) in enumerate(list(zip(children.tokens, children.logq, rank_logq(children)))[:count]):
            logp = p.logp + lq
            cap = min(cap, p.score + rank_lq)
            node = Node(len(self.nodes), parent, int(tok), p.depth + 1, logp, cap, first_key + k)
            self.nodes.append(node)
            ids.append(node.id)
        return ids

    def tree(self, ids: Iterable[int]) -> tuple[TokenTree, dict[int, int]]:
        """The tree of the (parent-closed) node set `ids`, and each id's local index in it."""
        order = sorted(ids)
        local = {nid: i for i, nid in enumerate(order)}
        tokens = [self.nodes[n].token for n in order]
        parents = [-1 if self.nodes[n].parent < 0 else local[self.nodes[n].parent] for n in order]
        return TokenTree(tuple(tokens), tuple(parents)), local

    def draft(self, ids: Iterable[int], with_dists: bool) -> Draft:
        order = sorted(ids)
        tree, local = self.tree(order)
        logp = tuple(self.nodes[n].logp for n in order)
        if not with_dists:
            return Draft(tree, logp)
        # a node reports its distribution only when it has children in the final tree
        has_kids = {self.nodes[n].parent for n in order[1:]}
        if not has_kids:
            return Draft(tree, logp)
        draft = tuple(self.dists[n] if n in has_kids else None for n in order)
        return Draft(TokenTree(tree.tokens, tree.parents, draft), logp)


def rank_logq(children: Children) -> tuple[float, ...]:
    """The log-probability each candidate is ranked by: its own for top-k children (greedy, ranked),
    and for the k-th of children drawn from q (multi-draft sampling) the k-th largest probability
    of q, whichever token the draw gave (the picker computes it: `ChildPicker.pick_tensors`).

    Multi-draft acceptance is exact only if whether a node gets its k-th drawn child depends on
    nothing but what came before that draw (its ancestors, its earlier-drawn siblings and their
    subtrees), never on the token the draw gave. Ranking a draw by its own q would keep
    high-probability draws more often than q draws them, and the verifier's output would drift
    from the target's distribution towards the draft's."""
    return children.logq if children.rank is None else children.rank
