"""Static trees: a fixed shape table, filled with the draft model's candidates level by level.

A shape table gives, per depth d, the number of children of each node at depth d by its *rank*:
`branching[d][r]` children for the node of rank r (0 when r is past the end of the row). Nodes of
one depth are ranked in generation order: by their parent's rank, then by their own order among
the parent's children (the draft's most likely first, or the draw order when sampling). One batched
draft forward per level gives the candidates of every node of that level.

STree's 13-node tree of depth 4 (its Llama-3.1-Mamba2 drafts):

    branching = ((3,), (2, 1), (2, 1), (3,))

    root ── a ── a0 ── a00 ── a000, a001, a002
         │    │     └─ a01
         │    └─ a1 ── a10
         ├─ b ── b0
         └─ c

i.e. the root gets 3 children; the best depth-1 node 2 and the second 1; the same at depth 2; and
the best depth-3 node 3 children: 1 + 3 + 3 + 3 + 3 = 13 nodes.
"""
from __future__ import annotations

from dataclasses import dataclass

from drafter_service.nodes import NodeSet
from drafter_service.proposer import Draft
from drafter_service.state import DraftState


@dataclass(frozen=True)
class ShapeTable:
    name: str
    branching: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        if not self.branching or any(not row or min(row) < 0 for row in self.branching):
            raise ValueError(f"shape table {self.name!r}: every level needs one or more non-negative counts")

    @property
    def depth(self) -> int:
        return len(self.branching)

    def size(self) -> int:
        """Nodes of the full shape, root included."""
        total, width = 1, 1
        for row in self.branching:
            width = sum(row[:width])
            total += width
        return total

    @classmethod
    def parse(cls, text: str) -> "ShapeTable":
        """'3,2-1,2-1,3': levels separated by commas, per-rank counts by dashes."""
        rows = tuple(tuple(int(c) for c in level.split("-")) for level in text.split(","))
        return cls(text, rows)


STREE_13 = ShapeTable("stree-13", ((3,), (2, 1), (2, 1), (3,)))

PRESETS = {STREE_13.name: STREE_13}


class StaticProposer:
    name = "static"
    uses_model = True

    def __init__(self, table: ShapeTable = STREE_13):
        self.table = table

    def propose(self, state: DraftState, root: int, budget: int, depth: int) -> Draft:
        depth = min(depth, self.table.depth)
        ns = NodeSet(root)
        level = [0]  # ids of the current depth, in rank order
        for d in range(depth):
            row = self.table.branching[d]
            parents = [(r, nid) for r, nid in enumerate(level) if r < len(row) and row[r] > 0]
            if not parents or len(ns) >= budget:
                break
            tree, local = ns.tree(range(len(ns)))
            kids = state.expand(tree, [local[nid] for _, nid in parents], [nid for _, nid in parents], max(row))
            level = []
            for (r, nid), cand in zip(parents, kids):
                room = budget - len(ns)
                if room <= 0:
                    break
                level += ns.add_children(nid, cand, min(row[r], room))
        return ns.draft(range(len(ns)), state.picker.reports_dists)
