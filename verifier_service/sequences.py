"""The sequence table and the commit rule.

Each live sequence owns one state slot of the model. Its committed length only moves through a
commit of the tree it verified last, and every commit names the length it was planned at, so the
rule below makes retries safe (see the .proto): the commit last applied, sent again, is a no-op;
any other mismatch (a different commit to the length reached, a stale or future length) is
FAILED_PRECONDITION.

The table is used by whichever thread holds the model (one at a time); others may read `len()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

from treeserve.errors import FailedPrecondition, InvalidArgument, NotFound
from treeserve.sampling import Sampling
from treeserve.tree import TokenTree


@dataclass(frozen=True)
class VerifiedTree:
    """The last tree a sequence verified: `pending` is the runtime's handle for committing it."""

    tree: TokenTree
    pending: object
    at_length: int


@dataclass
class Sequence:
    id: str
    slot: int
    prompt: tuple[int, ...]
    sampling: Sampling
    first_token: int  # the Prefill answer, repeated to a retried Prefill
    length: int
    last_used: float
    verified: VerifiedTree | None = None
    last_commit: tuple[int, tuple[int, ...]] | None = None  # (length it was planned at, path): a retry matches it


def plan_commit(seq: Sequence, committed_length: int, accepted_nodes: Seq[int]) -> list[int] | None:
    """The path to commit for `seq`, or None when the commit is a no-op (already applied).

    Raises InvalidArgument for a path that is not a root path of the last tree, FailedPrecondition
    for a stale or future length or when there is no verified tree to commit."""
    path = [int(n) for n in accepted_nodes]
    if not path or path[0] != 0:
        raise InvalidArgument(f"sequence {seq.id!r}: accepted_nodes must start at the root (node 0), got {path}")
    target = committed_length + len(path)
    if target == seq.length:
        if seq.last_commit == (committed_length, tuple(path)):
            return None  # this very commit, applied already: a retry
        raise FailedPrecondition(
            f"sequence {seq.id!r}: commit of {path} at length {committed_length} was not applied; the sequence "
            f"reached length {seq.length} by {_described(seq.last_commit)}")
    if committed_length != seq.length:
        when = "stale" if committed_length < seq.length else "future"
        raise FailedPrecondition(
            f"sequence {seq.id!r}: commit names length {committed_length} ({when}); the sequence is at length {seq.length}"
        )
    if seq.verified is None or seq.verified.at_length != seq.length:
        raise FailedPrecondition(f"sequence {seq.id!r}: no verified tree to commit at length {seq.length}")
    if not seq.verified.tree.is_path(path):
        raise InvalidArgument(
            f"sequence {seq.id!r}: accepted_nodes {path} is not a root-to-node path of the last verified tree"
        )
    return path


def applied(seq: Sequence, path: Seq[int]) -> None:
    """Record a commit the runtime has applied: the tree is consumed."""
    seq.last_commit = (seq.length, tuple(int(n) for n in path))
    seq.length += len(path)
    seq.verified = None


def _described(commit: tuple[int, tuple[int, ...]] | None) -> str:
    if commit is None:
        return "its prefill"
    return f"the commit of {list(commit[1])} at length {commit[0]}"


class SequenceTable:
    def __init__(self) -> None:
        self._by_id: dict[str, Sequence] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self._by_id

    def find(self, sequence_id: str) -> Sequence | None:
        return self._by_id.get(sequence_id)

    def get(self, sequence_id: str) -> Sequence:
        seq = self._by_id.get(sequence_id)
        if seq is None:
            raise NotFound(f"unknown sequence {sequence_id!r} (never prefilled, released, or idle-expired)")
        return seq

    def add(self, seq: Sequence) -> None:
        assert seq.id not in self._by_id
        self._by_id[seq.id] = seq

    def pop(self, sequence_id: str) -> Sequence | None:
        return self._by_id.pop(sequence_id, None)

    def idle(self, now: float, timeout_s: float) -> list[Sequence]:
        """Sequences not used for `timeout_s` seconds (none when the timeout is 0)."""
        if timeout_s <= 0:
            return []
        return [s for s in self._by_id.values() if now - s.last_used > timeout_s]
