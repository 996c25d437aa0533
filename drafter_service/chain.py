"""Chain drafting: one child per node, the draft model's top token (greedy) or one draw from q."""
from __future__ import annotations

from drafter_service.nodes import NodeSet
from drafter_service.proposer import Draft, reachable_depth
from drafter_service.state import DraftState


class ChainProposer:
    name = "chain"
    uses_model = True

    def propose(self, state: DraftState, root: int, budget: int, depth: int) -> Draft:
        length = reachable_depth(budget, depth)
        ns, last = NodeSet(root), 0
        for _ in range(length):
            tree, local = ns.tree(range(len(ns)))
            [kids] = state.expand(tree, [local[last]], [last], 1)
            added = ns.add_children(last, kids, 1)
            if not added:
                break
            last = added[0]
        return ns.draft(range(len(ns)), state.picker.reports_dists)
