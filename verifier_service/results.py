"""Per-node results, computed next to the logits on the model's device.

Only compact answers leave the device: one token per node, the multi-draft walk's outcome and
optional top-k log-probabilities. Full-vocabulary tensors never do. The tokens and log-probs of a
whole batch come back in one transfer; only the walk (a short, data-dependent loop) reads the
device more than once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treeserve import sampling
from treeserve.acceptance import Outcome, multi_draft_walk
from treeserve.sampling import Sampling
from treeserve.tree import TokenTree


@dataclass(frozen=True)
class NodeQuery:
    """What one verified tree asks for. `committed_length` is L: node i sits at L + depth(i) and its
    target token is chosen for position L + depth(i) + 1."""

    tree: TokenTree
    committed_length: int
    sampling: Sampling
    top_logprobs: int = 0


@dataclass
class NodeResults:
    target_tokens: list[int]
    walk: Outcome | None = None
    # per node: (tokens, logprobs), best first
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)


def next_positions(tree: TokenTree, committed_length: int, device) -> torch.Tensor:
    """(N,) int64: the absolute position each node's target token is chosen for."""
    depths = torch.tensor(tree.depths(), dtype=torch.long, device=device)
    return depths + (committed_length + 1)


def compute(logits: torch.Tensor, offsets: list[int], queries: list[NodeQuery]) -> list[NodeResults]:
    """logits (T, V): trees packed in rows offsets[b]:offsets[b+1], one per query."""
    assert len(offsets) == len(queries) + 1
    tokens = logits.argmax(-1)  # greedy rows are done; sampled rows are overwritten below
    topk_parts: list[torch.Tensor] = []
    for b, q in enumerate(queries):
        lo, hi = offsets[b], offsets[b + 1]
        if not q.sampling.greedy:
            pos = next_positions(q.tree, q.committed_length, logits.device)
            tokens[lo:hi] = sampling.choose(logits[lo:hi], q.sampling, pos)
        if q.top_logprobs > 0:
            k = min(q.top_logprobs, logits.shape[-1])
            top = torch.log_softmax(logits[lo:hi].float(), dim=-1).topk(k, dim=-1)
            topk_parts += [top.indices.float().flatten(), top.values.flatten()]
    # one device->host transfer for the whole batch: the tokens alone, or the tokens packed with
    # the top-k ids and log-probs in float32 (token ids < 2^24 are exact in float32)
    if topk_parts:
        packed = torch.cat([tokens.float(), *topk_parts]).cpu().tolist()
        node_tokens = [int(t) for t in packed[: len(tokens)]]
    else:
        packed, node_tokens = [], tokens.cpu().tolist()
    out: list[NodeResults] = []
    cursor = len(tokens)
    for b, q in enumerate(queries):
        lo, hi = offsets[b], offsets[b + 1]
        res = NodeResults(node_tokens[lo:hi])
        if q.top_logprobs > 0:
            k = min(q.top_logprobs, logits.shape[-1])
            n = (hi - lo) * k
            ids, vals = packed[cursor : cursor + n], packed[cursor + n : cursor + 2 * n]
            cursor += 2 * n
            res.top_logprobs = [([int(t) for t in ids[i * k : (i + 1) * k]], vals[i * k : (i + 1) * k]) for i in range(hi - lo)]
        if q.tree.draft is not None and not q.sampling.greedy:
            probs = sampling.transform(logits[lo:hi], q.sampling)
            res.walk = multi_draft_walk(q.tree, lambda i: probs[i], q.committed_length, q.sampling.seed)
        out.append(res)
    return out
