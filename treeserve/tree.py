"""The token tree: the one tree type every service uses.

A tree holds N nodes in topological order. Node 0, the root, is the last decided token that the
target has not consumed yet; `parents[0] == -1` and `parents[i] < i` for every other node. Node i
sits at position `committed_length + depth(i)`.

A node may carry the *draft distribution* its children were drawn from (`SparseDist`): a few listed
tokens with their probabilities plus a residual mass shared uniformly by every unlisted token of the
vocabulary. That is the exact q that lossless multi-draft acceptance needs.

Validation happens once, at the edge (`TokenTree.validate` or `from_proto`), and raises `TreeError`
with a message naming the offending node.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Iterable, Sequence

# Tolerance on probability sums: distributions come over the wire as float32.
_PROB_TOL = 1e-3
# Most tokens one draft distribution may list: a tree's distributions are checked on an RPC thread
# and turned into tables on the thread that holds the model, so one request listing whole
# vocabularies (tens of MB) must not stall everybody's forwards for seconds.
MAX_DRAFT_SUPPORT = 4096


class TreeError(ValueError):
    """A malformed tree or draft distribution. The message names the node and the rule broken."""


@dataclass(frozen=True)
class SparseDist:
    """A distribution over a vocabulary of size V: `probs[k]` for `tokens[k]`, and `residual` mass
    spread uniformly over the V - len(tokens) unlisted tokens."""

    tokens: tuple[int, ...]
    probs: tuple[float, ...]
    residual: float = 0.0

    def prob(self, token: int, vocab_size: int) -> float:
        """q(token)."""
        for t, p in zip(self.tokens, self.probs):
            if t == token:
                return p
        return self.unlisted_prob(vocab_size)

    def normalised(self) -> "SparseDist":
        """This distribution with each mass divided by the total, which makes it 1 to rounding (a
        wire one may be off by `_PROB_TOL`: acceptance with an unnormalised q would follow it, off
        the target by as much)."""
        total = sum(self.probs) + self.residual
        if total == 1.0:
            return self
        return SparseDist(self.tokens, tuple(p / total for p in self.probs), self.residual / total)

    def unlisted_prob(self, vocab_size: int) -> float:
        """q of each token the distribution does not list."""
        unlisted = vocab_size - len(self.tokens)
        return self.residual / unlisted if unlisted > 0 else 0.0

    def validate(self, vocab_size: int, where: str) -> None:
        if len(self.tokens) != len(self.probs):
            raise TreeError(f"{where}: {len(self.tokens)} tokens but {len(self.probs)} probabilities")
        if len(self.tokens) > MAX_DRAFT_SUPPORT:
            raise TreeError(f"{where}: the draft distribution lists {len(self.tokens)} tokens, more than "
                            f"{MAX_DRAFT_SUPPORT}")
        if len(set(self.tokens)) != len(self.tokens):
            raise TreeError(f"{where}: repeated token in the draft distribution")
        for t in self.tokens:
            if not 0 <= t < vocab_size:
                raise TreeError(f"{where}: draft token {t} outside the vocabulary [0, {vocab_size})")
        for p in (*self.probs, self.residual):
            if not (math.isfinite(p) and p >= 0.0):
                raise TreeError(f"{where}: probability {p} is negative or not finite")
        total = sum(self.probs) + self.residual
        if abs(total - 1.0) > _PROB_TOL:
            raise TreeError(f"{where}: draft probabilities sum to {total:.6f}, not 1")
        if self.residual > 0 and len(self.tokens) >= vocab_size:
            raise TreeError(f"{where}: residual mass {self.residual} but every token is listed")


@dataclass(frozen=True)
class TokenTree:
    """Tokens and parents in topological order; `draft[i]` is the distribution node i's children were
    drawn from (None where the drafter did not sample, e.g. greedy or n-gram drafting)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    draft: tuple[SparseDist | None, ...] | None = None
    _children: tuple[tuple[int, ...], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        if self.draft is not None:
            object.__setattr__(self, "draft", tuple(self.draft))

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def chain(cls, tokens: Sequence[int]) -> "TokenTree":
        """A single branch: root tokens[0], then each token the child of the previous."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def of_ints(cls, tokens: tuple[int, ...], parents: tuple[int, ...],
                draft: tuple[SparseDist | None, ...] | None = None) -> "TokenTree":
        """A tree from tuples that already hold Python ints (decoded from the wire), without the
        per-node conversion `__init__` does: the verifier decodes a tree for every item of every
        step."""
        tree = object.__new__(cls)
        object.__setattr__(tree, "tokens", tokens)
        object.__setattr__(tree, "parents", parents)
        object.__setattr__(tree, "draft", draft)
        object.__setattr__(tree, "_children", ())
        return tree

    @classmethod
    def single(cls, root: int) -> "TokenTree":
        """A one-node tree: plain decoding of `root`."""
        return cls((root,), (-1,))

    @classmethod
    def from_sequences(cls, root: int, continuations: Iterable[Sequence[int]], max_nodes: int | None = None) -> "TokenTree":
        """Prefix-tree merge: every continuation hangs below `root`, shared prefixes share nodes.
        Continuations are taken in order; nodes past `max_nodes` are dropped (a prefix of each
        continuation is kept, so the result is always a valid tree)."""
        tokens, parents = [root], [-1]
        child_of: dict[tuple[int, int], int] = {}
        for seq in continuations:
            node = 0
            for tok in seq:
                key = (node, int(tok))
                nxt = child_of.get(key)
                if nxt is None:
                    if max_nodes is not None and len(tokens) >= max_nodes:
                        break
                    nxt = len(tokens)
                    tokens.append(int(tok))
                    parents.append(node)
                    child_of[key] = nxt
                node = nxt
        return cls(tuple(tokens), tuple(parents))

    # ---- validation ---------------------------------------------------------------------
    def validate(self, vocab_size: int, max_nodes: int) -> "TokenTree":
        """Check every invariant; returns self so calls chain. Raises TreeError."""
        if not self._plainly_valid(vocab_size, max_nodes):
            self._check_structure(vocab_size, max_nodes)  # raises, naming the first rule broken
        if self.draft is not None:
            self._check_draft(vocab_size)
        return self

    def _plainly_valid(self, vocab_size: int, max_nodes: int) -> bool:
        """Whether the structural rules of `_check_structure` all hold, checked by a few passes
        that run in C (min, max, map, set) instead of a Python loop per node: the usual answer,
        on the verifier's path of every step. False sends the tree through `_check_structure`."""
        tokens, parents = self.tokens, self.parents
        n = len(tokens)
        if not 0 < n <= max_nodes or len(parents) != n or parents[0] != -1:
            return False
        if min(tokens) < 0 or max(tokens) >= vocab_size:
            return False
        if n == 1:
            return True
        rest = parents[1:]
        return (min(rest) >= 0 and all(map(operator.lt, rest, range(1, n)))
                and len(set(zip(rest, tokens[1:]))) == n - 1)

    def _check_structure(self, vocab_size: int, max_nodes: int) -> None:
        n = len(self.tokens)
        if n == 0:
            raise TreeError("tree is empty: it needs at least the root")
        if n > max_nodes:
            raise TreeError(f"tree has {n} nodes, more than the limit of {max_nodes}")
        if len(self.parents) != n:
            raise TreeError(f"tree has {n} tokens but {len(self.parents)} parents")
        if self.parents[0] != -1:
            raise TreeError(f"node 0 must be the root (parent -1), has parent {self.parents[0]}")
        for i in range(1, n):
            p = self.parents[i]
            if p == -1:
                raise TreeError(f"node {i} is a second root: a tree has exactly one root, node 0")
            if not 0 <= p < i:
                raise TreeError(f"node {i} has parent {p}: parents must satisfy 0 <= parent < node (topological order)")
        for i, t in enumerate(self.tokens):
            if not 0 <= t < vocab_size:
                raise TreeError(f"node {i} has token {t} outside the vocabulary [0, {vocab_size})")
        seen: set[tuple[int, int]] = set()
        for i in range(1, n):
            key = (self.parents[i], self.tokens[i])
            if key in seen:
                raise TreeError(f"node {i} repeats token {self.tokens[i]} under parent {self.parents[i]}: siblings must differ")
            seen.add(key)

    def _check_draft(self, vocab_size: int) -> None:
        n = len(self.tokens)
        if len(self.draft) != n:
            raise TreeError(f"tree has {n} nodes but {len(self.draft)} draft distributions")
        for i, dist in enumerate(self.draft):
            if dist is None:
                if self.children(i):
                    raise TreeError(f"node {i} has children but no draft distribution")
                continue
            dist.validate(vocab_size, f"node {i}")
            for c in self.children(i):
                if dist.prob(self.tokens[c], vocab_size) <= 0.0:
                    raise TreeError(f"node {c} has token {self.tokens[c]} with draft probability 0 under node {i}")

    # ---- structure ----------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.tokens)

    def children(self, i: int) -> tuple[int, ...]:
        """Children of node i in node order (the order a drafter drew them)."""
        if not self._children or len(self._children) != self.size:
            kids: list[list[int]] = [[] for _ in range(self.size)]
            for j in range(1, self.size):
                kids[self.parents[j]].append(j)
            object.__setattr__(self, "_children", tuple(tuple(k) for k in kids))
        return self._children[i]

    def depths(self) -> list[int]:
        d = [0] * self.size
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return d

    def path_to(self, i: int) -> list[int]:
        """Local node indices from the root down to i."""
        path = []
        while i >= 0:
            path.append(i)
            i = self.parents[i]
        return path[::-1]

    def leaves(self) -> list[int]:
        return [i for i in range(self.size) if not self.children(i)]

    def ancestor_mask(self) -> list[list[bool]]:
        """M[i][j] iff j lies on the root-to-i path (ancestor-or-self)."""
        m: list[list[bool]] = []
        for i in range(self.size):
            row = list(m[self.parents[i]]) if i > 0 else [False] * self.size
            row[i] = True
            m.append(row)
        return m

    def child_with_token(self, i: int, token: int) -> int | None:
        for c in self.children(i):
            if self.tokens[c] == token:
                return c
        return None

    def tokens_along(self, path: Sequence[int]) -> list[int]:
        return [self.tokens[i] for i in path]

    def is_path(self, path: Sequence[int]) -> bool:
        """Whether `path` starts at the root and follows parent links."""
        if not path or path[0] != 0:
            return False
        return all(0 < path[k] < self.size and self.parents[path[k]] == path[k - 1] for k in range(1, len(path)))


# ---- wire conversion ----------------------------------------------------------------------
def dist_to_proto(dist: SparseDist | None):
    from treeserve.v1 import treeserve_pb2 as pb

    if dist is None:
        return pb.SparseDistribution()
    return pb.SparseDistribution(tokens=dist.tokens, probs=dist.probs, residual=dist.residual)


def dist_from_proto(msg) -> SparseDist | None:
    if len(msg.tokens) == 0 and msg.residual == 0.0 and len(msg.probs) == 0:
        return None
    return SparseDist(tuple(msg.tokens), tuple(float(p) for p in msg.probs), float(msg.residual))


def tree_to_proto(tree: TokenTree):
    from treeserve.v1 import treeserve_pb2 as pb

    msg = pb.TokenTree(tokens=tree.tokens, parents=tree.parents)
    if tree.draft is not None:
        msg.draft.extend(dist_to_proto(d) for d in tree.draft)
    return msg


def tree_from_proto(msg, vocab_size: int, max_nodes: int) -> TokenTree:
    """Decode and validate a wire tree; raises TreeError naming the broken rule."""
    draft = None
    if len(msg.draft) > 0:
        for i, d in enumerate(msg.draft):  # before anything copies them (the lists may be vocabularies)
            if max(len(d.tokens), len(d.probs)) > MAX_DRAFT_SUPPORT:
                raise TreeError(f"draft[{i}]: the draft distribution lists {max(len(d.tokens), len(d.probs))} "
                                f"tokens, more than {MAX_DRAFT_SUPPORT}")
        draft = tuple(dist_from_proto(d) for d in msg.draft)
    # repeated integer fields yield Python ints: nothing to convert
    tree = TokenTree.of_ints(tuple(msg.tokens), tuple(msg.parents), draft).validate(vocab_size, max_nodes)
    if draft is not None:  # validated within the tolerance; acceptance takes them exact (as `of_ints` sets fields)
        object.__setattr__(tree, "draft", tuple(d.normalised() if d is not None else None for d in draft))
    return tree
