"""The one interface every drafting strategy implements.

A proposer turns a sequence's draft state and the next root token into a token tree:

    proposer.propose(state, root, budget, depth) -> Draft

`budget` is the most nodes the tree may have, root included; `depth` the most edges on any
root-to-leaf path. A proposer is stateless across calls (everything per sequence lives in
`DraftState`) and deterministic: the same state and arguments give the same tree, which is what lets
draft-ahead prepare a tree that is identical to the one fresh drafting would produce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from treeserve.tree import TokenTree

if TYPE_CHECKING:
    from drafter_service.state import DraftState


@dataclass(frozen=True)
class Draft:
    """A proposed tree. `logp[i]` is node i's cumulative draft log-probability along its path (0 at
    the root), when the proposer has one (model-based trees); None otherwise (n-gram)."""

    tree: TokenTree
    logp: tuple[float, ...] | None = None


class Proposer(Protocol):
    name: str
    uses_model: bool

    def propose(self, state: "DraftState", root: int, budget: int, depth: int) -> Draft:
        ...


def reachable_depth(budget: int, depth: int) -> int:
    """The deepest a tree of at most `budget` nodes can reach under the depth limit `depth`: a
    path of `budget` nodes has `budget - 1` edges."""
    return min(depth, budget - 1)


def draft_tree(proposer: Proposer, state: "DraftState", root: int, budget: int, depth: int) -> Draft:
    """`proposer.propose` with the budget and depth cut to what the draft model's maximum length
    leaves room for (a verified tree's nodes sit after the committed tokens). Fresh drafting and
    draft-ahead both go through here, so both cut the same way."""
    room = state.room()
    if room is not None:
        if room < 1:  # the root itself has no position left: nothing to run the model on
            return Draft(TokenTree.single(root))
        budget = max(1, min(budget, room))
        depth = max(0, min(depth, room - 1))
    return proposer.propose(state, root, budget, depth)


def fits(state: "DraftState", tree: TokenTree) -> bool:
    """Whether a forward over `tree` placed after the state's committed tokens stays within the
    draft model's maximum length (what draft-ahead runs on each tree it drafted)."""
    room = state.room()
    return room is None or tree.size <= room
