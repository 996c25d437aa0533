"""Acceptance rules: which path of a verified tree is kept, and the target's bonus token.

Every rule is lossless: the emitted tokens follow the target distribution exactly.
- `follow_target`: greedy (target_tokens = argmax) and target-only sampling (target_tokens =
  seeded samples). Exact for any tree.
- the multi-draft walk: SpecInfer-style speculative sampling for children drawn from q without
  replacement; a chain (one child per node) is the Leviathan rule. `accept_among_children` defines
  it at one node. A node's decision never depends on the path that reached it, so the verifier
  decides every node at once on the device (`verifier_service.results.node_outcomes`) and `walk`
  follows the accepted children from the root.

Positions: the children of node i are candidates for absolute position `L + depth(i) + 1`; the
random numbers of the walk are drawn at that position (see treeserve.sampling).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from treeserve.tree import SparseDist, TokenTree


@dataclass(frozen=True)
class Outcome:
    """accepted_nodes: root-to-node path (starts with 0); bonus: the target's next token."""

    accepted_nodes: tuple[int, ...]
    bonus: int

    def emitted(self, tree: TokenTree) -> list[int]:
        """Tokens this step adds to the output: accepted children, then the bonus token."""
        return [tree.tokens[i] for i in self.accepted_nodes[1:]] + [self.bonus]

    def to_proto(self):
        from treeserve.v1 import treeserve_pb2 as pb

        return pb.Outcome(accepted_nodes=self.accepted_nodes, bonus_token=self.bonus)

    @classmethod
    def from_proto(cls, msg) -> "Outcome":
        return cls(tuple(msg.accepted_nodes), int(msg.bonus_token))


def follow_target(tree: TokenTree, target_tokens: Sequence[int]) -> Outcome:
    """From the root, move to the child carrying the target's token while one exists."""
    node, path = 0, [0]
    while True:
        nxt = tree.child_with_token(node, int(target_tokens[node]))
        if nxt is None:
            return Outcome(tuple(path), int(target_tokens[node]))
        node = nxt
        path.append(node)


def dense(dist: SparseDist, vocab: int, device=None) -> torch.Tensor:
    """(V,) float64 dense form of a sparse draft distribution."""
    q = torch.full((vocab,), dist.unlisted_prob(vocab), dtype=torch.float64, device=device)
    if dist.tokens:
        q[torch.tensor(dist.tokens, device=device)] = torch.tensor(dist.probs, dtype=torch.float64, device=device)
    return q


def accept_among_children(
    p: torch.Tensor, q: torch.Tensor, child_tokens: Sequence[int], u: Sequence[float], residual_u: torch.Tensor
) -> tuple[int | None, int]:
    """One node of the multi-draft walk.

    p (V,) target probs, q (V,) draft probs the children were drawn from without replacement,
    child_tokens in draw order, u[k] uniform for child k, residual_u (V,) uniforms for the
    residual draw. Returns (index of the accepted child or None, emitted token).
    """
    p = p.double().clone()
    q = q.double().clone()
    for k, tok in enumerate(child_tokens):
        pc, qc = float(p[tok]), float(q[tok])
        if qc > 0.0 and u[k] * qc < pc:  # accept with probability min(1, p/q)
            return k, int(tok)
        r = torch.clamp(p - q, min=0.0)
        total = float(r.sum())
        # p <= q everywhere can only happen when p == q up to rounding: keep p then.
        p = r / total if total > 1e-12 else p
        q[tok] = 0.0
        qs = float(q.sum())
        q = q / qs if qs > 0.0 else q
    # Gumbel-max on the residual with the given uniforms
    g = -torch.log(-torch.log(residual_u.double()))
    return None, int((torch.log(p) + g).argmax())


def walk(tree: TokenTree, outcomes: Sequence[Sequence[int]]) -> Outcome:
    """Follow accepted children from the root. outcomes[i] = (index in draw order of node i's
    accepted child or -1, the token node i emits): `verifier_service.results.node_outcomes` on the
    host."""
    node, path = 0, [0]
    while True:
        child, token = outcomes[node]
        if child < 0:
            return Outcome(tuple(path), int(token))
        node = tree.children(node)[child]
        path.append(node)
