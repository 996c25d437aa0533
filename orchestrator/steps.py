"""The pure parts of a speculation step: fitting a drafted tree to what may be verified, deciding
acceptance from the verifier's answer, and advancing a request's committed-token log."""
from __future__ import annotations

from typing import Sequence

from treeserve.acceptance import Outcome, follow_target
from treeserve.tree import TokenTree
from orchestrator.request import EOS, LENGTH, RequestState


def fit_tree(tree: TokenTree, max_nodes: int, max_depth: int) -> tuple[TokenTree, tuple[int, ...] | None]:
    """The largest part of `tree` with no node deeper than `max_depth` and at most `max_nodes` nodes
    (of those, a prefix in node order), and the original index of each kept node (None when
    nothing was cut). Both cuts keep every kept node's parent and each node's children a prefix of
    their draw order.

    The depth cut keeps the draft distributions: whether it keeps a node depends on the node's
    depth alone. A cut by node count drops them, so the verifier samples from the target alone
    (exact for any tree): a node's place in node order can depend on the tokens drawn for it and
    its descendants (they rank other nodes in or out of a dynamic tree), and multi-draft acceptance
    is exact only when keeping a drawn child never depends on the token drawn."""
    depths = tree.depths()
    shallow = [i for i in range(tree.size) if depths[i] <= max(0, max_depth)]
    keep = shallow[: max(1, max_nodes)]
    if len(keep) == tree.size:
        return tree, None
    new_index = {old: new for new, old in enumerate(keep)}
    parents = tuple(-1 if i == 0 else new_index[tree.parents[i]] for i in keep)
    draft = None
    if tree.draft is not None and len(keep) == len(shallow):
        draft = tuple(tree.draft[i] for i in keep)
    return TokenTree(tuple(tree.tokens[i] for i in keep), parents, draft), tuple(keep)


def in_original(outcome: Outcome, kept: tuple[int, ...] | None) -> Outcome:
    """An outcome on a fitted tree, in the node indices of the tree the drafter sent."""
    if kept is None:
        return outcome
    return Outcome(tuple(kept[i] for i in outcome.accepted_nodes), outcome.bonus)


def accept(tree: TokenTree, target_tokens: Sequence[int], walk: Outcome | None) -> Outcome:
    """The verifier's multi-draft walk when it did one (trees with draft distributions, sampling),
    else follow the target's own tokens (greedy, or target-only sampling)."""
    if walk is not None:
        if not tree.is_path(walk.accepted_nodes):
            raise ValueError(f"verifier walk {walk.accepted_nodes} is not a root path of the tree")
        return walk
    if len(target_tokens) != tree.size:
        raise ValueError(f"verifier returned {len(target_tokens)} target tokens for a tree of {tree.size} nodes")
    return follow_target(tree, target_tokens)


def advance(state: RequestState, tree: TokenTree, outcome: Outcome, eos_ids: frozenset[int]) -> tuple[list[int], str | None]:
    """Apply a step's outcome to the log. Returns (tokens for the client, finish reason or None).
    The log takes every decided token; the client gets them up to EOS (excluded) or the length
    limit."""
    length = state.committed
    emitted = outcome.emitted(tree)
    state.pending_commit = (length, tuple(outcome.accepted_nodes))
    state.tokens.extend(emitted)
    state.forwards += 1
    return take_output(state, emitted, eos_ids)


def take_output(state: RequestState, emitted: Sequence[int], eos_ids: frozenset[int]) -> tuple[list[int], str | None]:
    out: list[int] = []
    for tok in emitted:
        if tok in eos_ids:
            return out, EOS
        out.append(int(tok))
        state.generated += 1
        if state.generated >= state.spec.max_new_tokens:
            return out, LENGTH
    return out, None


def tree_limits(state: RequestState, max_tree_nodes: int, max_sequence_length: int) -> tuple[int, int]:
    """(max nodes, max depth) worth verifying for this request now. A step emits at most depth + 1
    tokens, so nothing deeper than the tokens still wanted; and the verifier holds the whole tree
    after the committed tokens, so committed + nodes stays within its length limit."""
    nodes = max(1, min(max_tree_nodes, max_sequence_length - state.committed))
    return nodes, max(0, min(state.remaining - 1, nodes - 1))
