"""Per-sequence draft state, kept in step with the verifier's committed length.

`DraftState` holds the committed tokens (for n-gram lookup) and, with a draft model, the state slot
that has consumed those tokens (or will, before its next forward pass: trees that need no model
leave it behind) plus the last verification done on it. Catching up reuses that verification: the
accepted path's per-node states are committed without another forward pass, and only tokens
outside the verified tree are decoded.

Every forward pass is on this one slot with one tree, so a state forked from it and driven through
the same calls ends up bit-identical (draft-ahead depends on it).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from drafter_service.children import ChildPicker, Children
from drafter_service.draftlm import DraftModel, Verified
from treeserve.sampling import Sampling
from treeserve.tree import TokenTree

if TYPE_CHECKING:
    from drafter_service.proposer import Draft


class Abandoned(Exception):
    """Raised before a forward pass when the work on a state is no longer wanted (draft-ahead)."""


class TokenHistory:
    """The committed tokens of a sequence: an append-only int64 array."""

    def __init__(self, tokens: Sequence[int] = ()):
        self._buf = np.zeros(max(64, 2 * len(tokens)), dtype=np.int64)
        self._n = 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        k = len(tokens)
        if self._n + k > len(self._buf):
            grown = np.zeros(max(2 * len(self._buf), self._n + k), dtype=np.int64)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n : self._n + k] = np.asarray(tokens, dtype=np.int64)
        self._n += k

    def view(self) -> np.ndarray:
        """The tokens so far (a view: do not keep it across `extend`)."""
        return self._buf[: self._n]

    def copy(self) -> "TokenHistory":
        out = TokenHistory()
        out.extend(self.view())
        return out

    def __len__(self) -> int:
        return self._n


@dataclass
class DraftState:
    """Draft state of one sequence. `picker` decides children from logits (None without a model)."""

    sequence_id: str
    sampling: Sampling
    history: TokenHistory
    picker: ChildPicker | None = None
    model: DraftModel | None = None
    slot: int | None = None
    verified: Verified | None = field(default=None, repr=False)
    # committed tokens the model's slot has not consumed yet (`advance` leaves them to `catch_up`)
    behind: list[int] = field(default_factory=list, repr=False)
    # checked before every forward pass: background work on a forked state stops within one pass
    abandoned: Callable[[], bool] | None = field(default=None, repr=False)

    @classmethod
    def open(cls, sequence_id: str, tokens: Sequence[int], sampling: Sampling, picker: ChildPicker | None,
             model: DraftModel | None) -> "DraftState":
        """With a model, the picker is bound to the model's head, so children come out as token ids
        whatever columns the head has (a trimmed vocabulary)."""
        slot = model.open(tokens) if model is not None else None
        if picker is not None and model is not None:
            picker = picker.bind(model.head)
        return cls(sequence_id, sampling, TokenHistory(tokens), picker, model, slot)

    @property
    def length(self) -> int:
        """Committed length: tokens the draft state has taken (the model's slot may be behind)."""
        return len(self.history)

    def room(self) -> int | None:
        """Positions left before the draft model's maximum length (None: no limit)."""
        if self.model is None or self.model.max_len is None:
            return None
        return self.model.max_len - self.length

    # ---- drafting ---------------------------------------------------------------------------
    def logits(self, tree: TokenTree, rows: Sequence[int] | None = None) -> torch.Tensor | None:
        """One forward pass of the draft model over `tree` (root at the committed length): logits
        (len(rows), K) over the head's columns at nodes `rows` (None: all N nodes; empty: none).
        Leaves the slot ready to commit any path of `tree` without a forward pass."""
        self.catch_up()
        # the previous verification can no longer be committed from once this one exists: let go of
        # it first, so a shared graph stash need not copy its rows out before the replay
        self.verified = None
        logits, self.verified = self.model.verify(self.slot, tree, rows)
        return logits

    def can_grow(self, budget: int, depth: int) -> bool:
        """Whether `grow` takes a tree of this budget and depth (`DraftModel.can_grow`)."""
        return self.model is not None and self.picker is not None and self.model.can_grow(budget, depth, self.picker)

    def grow(self, root: int, budget: int, depth: int) -> "Draft":
        """A dynamic tree grown on the model's device (`DraftModel.grow`); leaves the slot ready to
        commit any path of the last level's tree without a forward pass."""
        self.catch_up()
        self.verified = None  # as in `logits`: the last verification is let go first
        draft, self.verified = self.model.grow(self.slot, root, budget, depth, self.picker, self._still_wanted)
        return draft

    def prepare(self, tree: TokenTree) -> None:
        """The forward over `tree` for its commits only (no logits are computed)."""
        self.logits(tree, ())

    def expand(self, tree: TokenTree, nodes: Sequence[int], salts: Sequence[int], k: int) -> list[Children]:
        """Candidate children (at most k each) of `nodes` of `tree`, from one forward pass over the
        whole tree (logits only at `nodes`). `salts`: a stable id per node (keys the sampling noise)."""
        nodes = list(nodes)
        if not nodes:
            self.prepare(tree)
            return []
        with self._exclusive():
            return self.picker.pick(self.logits(tree, nodes), k, self.length, salts)

    def node_probs(self, tree: TokenTree) -> torch.Tensor:
        """(N, K) ranking probabilities over the head's columns at every node of `tree`
        (draft-ahead's outcome prediction); leaves the slot ready to commit any path of `tree`."""
        with self._exclusive():
            return self.picker.ranking_probs(self.logits(tree))

    def _exclusive(self):
        # the picker's device ops must not run beside another thread's graph capture
        return self.model.exclusive() if self.model is not None else contextlib.nullcontext()

    # ---- keeping in step ----------------------------------------------------------------------
    def advance(self, tokens: Sequence[int]) -> None:
        """Take newly committed tokens: into the history at once, into the model's slot before its
        next forward pass (`catch_up`). So an n-gram tree drafted for a sequence that has a model
        (a per-tree shape) costs no forward, and the model later consumes every token it missed
        in one pass, still reusing its last verification."""
        if not tokens:
            return
        if self.model is not None:
            self.behind.extend(tokens)
        self.history.extend(tokens)

    def catch_up(self) -> None:
        """Let the model's slot consume the tokens it is behind by (before any forward pass on it,
        before a fork copies it, and before a model tree is drafted: a tree cut to its root runs no
        forward, and draft-ahead's worker must not be the one to catch up)."""
        self._still_wanted()
        if self.behind:
            self.model.advance(self.slot, self.verified, self.behind)
            self.verified = None
            self.behind = []

    def _still_wanted(self) -> None:
        if self.abandoned is not None and self.abandoned():
            raise Abandoned(self.sequence_id)

    def fork(self) -> "DraftState | None":
        """An independent copy (a forked slot, no verification); None when no slot is free."""
        slot = None
        if self.model is not None:
            self.catch_up()
            slot = self.model.fork(self.slot)
            if slot is None:
                return None
        return DraftState(self.sequence_id, self.sampling, self.history.copy(), self.picker, self.model, slot)

    def release(self) -> None:
        if self.model is not None and self.slot is not None:
            self.model.free(self.slot)
        self.slot = None
        self.verified = None
        self.behind = []
