"""Dynamic trees: best-first expansion by cumulative draft probability under a node budget.

The tree we want holds the `budget` most probable nodes (path probability under the draft model,
depth at most `depth`). A path's probability never exceeds its prefix's, so that set is a tree.
It is found level by level with one batched draft forward per level (on the device, as
`drafter_service.growth`, when the draft state's model grows trees; otherwise on the host, below):

1. The selection starts as the root alone; the frontier is the root.
2. One forward pass over the selected tree gives the next-token distribution of every frontier
   node; each frontier node contributes its best `budget - 1` children as candidates.
3. The selection becomes the `budget` best of all candidates so far (ties: shallower, then older).
   Selected candidates that have not been expanded and are above the depth limit form the next
   frontier; stop when there is none.

The selection threshold only rises as candidates are added, so a candidate left out once is never
selected later, and every selected node above the depth limit has been expanded. Hence, when the
loop stops, every selected node's path probability is at least that of every candidate it left out
(the children of selected nodes): the result is exactly best-first.

When sampling, children are draws without replacement and must be a prefix of the draw order; a
child's ranking score is capped by its earlier-drawn sibling's (see `NodeSet.add_children`). A drawn
child is ranked by its place in the draw (the k-th draw by q's k-th largest probability), not by the
token it drew: the tree is then the best-first tree of what the draws are expected to give, and
whether a draw is kept never depends on its own token, which exact multi-draft acceptance needs
(`nodes.rank_logq`).
"""
from __future__ import annotations

from drafter_service.nodes import NodeSet
from drafter_service.proposer import Draft
from drafter_service.state import DraftState


class DynamicProposer:
    name = "dynamic"
    uses_model = True

    def propose(self, state: DraftState, root: int, budget: int, depth: int) -> Draft:
        if depth < 1 or budget < 2:
            return NodeSet(root).draft([0], False)
        if state.can_grow(budget, depth):
            return state.grow(root, budget, depth)
        return self.propose_on_host(state, root, budget, depth)

    def propose_on_host(self, state: DraftState, root: int, budget: int, depth: int) -> Draft:
        """The loop level by level on the host: the plain twin of `drafter_service.growth`, and the
        path for draft states without a model that grows trees (budgets past the node buckets)."""
        ns = NodeSet(root)
        selected, frontier = [0], [0] if depth > 0 and budget > 1 else []
        k, level = budget - 1, 0
        while frontier:
            tree, local = ns.tree(selected)
            kids = state.expand(tree, [local[n] for n in frontier], [ns.nodes[n].key for n in frontier], k)
            for f, (nid, cand) in enumerate(zip(frontier, kids)):
                ns.add_children(nid, cand, first_key=1 + level * k * k + f * k)
            selected = best(ns, budget)
            frontier = [n for n in selected if n not in ns.expanded and ns.nodes[n].depth < depth]
            level += 1
        return ns.draft(selected, state.picker.reports_dists)


def best(ns: NodeSet, budget: int) -> list[int]:
    """Ids of the `budget` best nodes by score (ties: shallower first, then older)."""
    ranked = sorted(ns.nodes, key=lambda n: (-n.score, n.depth, n.key))
    return sorted(n.id for n in ranked[:budget])
