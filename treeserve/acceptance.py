"""Acceptance rules: which path of a verified tree is kept, and the target's bonus token.

Every rule is lossless: the emitted tokens follow the target distribution exactly.
- `follow_target`: greedy (target_tokens = argmax) and target-only sampling (target_tokens =
  seeded samples). Exact for any tree.
- `multi_draft_walk`: SpecInfer-style speculative sampling for children drawn from q without
  replacement; a chain (one child per node) is the Leviathan rule.

Positions: the children of node i are candidates for absolute position `L + depth(i) + 1`; the
random numbers of the walk are drawn at that position (see treeserve.sampling).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from treeserve import sampling
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
    unlisted = vocab - len(dist.tokens)
    q = torch.full((vocab,), dist.residual / unlisted if unlisted > 0 else 0.0, dtype=torch.float64, device=device)
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


def multi_draft_walk(
    tree: TokenTree,
    target_probs: Callable[[int], torch.Tensor],
    committed_length: int,
    seed: int,
) -> Outcome:
    """Speculative sampling along the tree. `target_probs(i)` gives node i's transformed target
    distribution (V,) (only visited nodes are asked). Nodes without a draft distribution (or
    without children) end the walk with a target sample from the residual stream."""
    if tree.draft is None:
        raise ValueError("multi_draft_walk needs a tree with draft distributions")
    depths = tree.depths()
    node, path = 0, [0]
    while True:
        p = target_probs(node)
        vocab = p.shape[-1]
        kids = tree.children(node)
        position = torch.tensor([committed_length + depths[node] + 1], dtype=torch.long, device=p.device)
        residual_u = sampling.uniforms(
            seed, position[:, None], sampling.STREAM_RESIDUAL, torch.arange(vocab, device=p.device)[None, :]
        )[0]
        dist = tree.draft[node]
        if not kids or dist is None:
            _, tok = accept_among_children(p, torch.zeros_like(p, dtype=torch.float64), (), (), residual_u)
            return Outcome(tuple(path), tok)
        u = sampling.uniforms(
            seed, position.expand(len(kids)), sampling.STREAM_ACCEPT, torch.arange(len(kids), device=p.device)
        ).tolist()
        q = dense(dist, vocab, p.device)
        k, tok = accept_among_children(p, q, [tree.tokens[c] for c in kids], u, residual_u)
        if k is None:
            return Outcome(tuple(path), tok)
        node = kids[k]
        path.append(node)
