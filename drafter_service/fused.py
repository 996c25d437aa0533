"""Fused drafting: the draft model's dynamic tree merged with the n-gram tree.

N-gram continuations are exact copies of earlier text and often run deeper than a draft model
would dare, while the draft model covers what has not been seen before. The merge:

1. the n-gram tree with at most `budget // 2` nodes (its continuations are kept whole);
2. the dynamic draft tree with the full budget;
3. the union by longest-prefix matching (a draft path that the n-gram tree already holds costs
   nothing), filling the remaining budget with draft-only nodes in order of draft path probability;
   the least probable draft-only nodes are the ones pruned.

Draft-only nodes are taken best-first, and a node's path probability never exceeds its parent's, so
the result is a tree. Fused trees carry no draft distributions (n-gram children were not drawn from
q): with temperature > 0 the verifier uses target-only sampling, which is exact for any tree, and
the draft children are then ranked by the transformed distribution instead of drawn.
"""
from __future__ import annotations

from drafter_service.dynamic import DynamicProposer
from drafter_service.ngram import NgramProposer
from drafter_service.proposer import Draft
from drafter_service.state import DraftState
from treeserve.tree import TokenTree


class FusedProposer:
    name = "fused"
    uses_model = True

    def __init__(self, ngram: NgramProposer | None = None, model_tree: DynamicProposer | None = None):
        self.ngram = ngram or NgramProposer()
        self.model_tree = model_tree or DynamicProposer()

    def propose(self, state: DraftState, root: int, budget: int, depth: int) -> Draft:
        lookup = self.ngram.propose(state, root, max(1, budget // 2), depth).tree
        drafted = self.model_tree.propose(state, root, budget, depth)
        return Draft(merge(lookup, drafted, budget))


def merge(lookup: TokenTree, drafted: Draft, budget: int) -> TokenTree:
    """Union of the two trees (same root) within `budget` nodes: every node of `lookup`, then the
    nodes of `drafted` by descending path log-probability."""
    paths = [tuple(lookup.tokens_along(lookup.path_to(i))[1:]) for i in range(1, lookup.size)]
    have = set(paths)
    tree = drafted.tree
    ranked = sorted(range(1, tree.size), key=lambda i: (-drafted.logp[i], len(tree.path_to(i)), i))
    for i in ranked:
        path = tuple(tree.tokens_along(tree.path_to(i))[1:])
        if path in have:
            continue
        if len(have) + 1 >= budget:
            break
        have.add(path)
        paths.append(path)
    return TokenTree.from_sequences(tree.tokens[0], paths, max_nodes=budget)
