"""Per-node results, computed next to the logits on the model's device.

Only compact answers leave the device: one token per node, the multi-draft walk's outcome and
optional top-k log-probabilities. Full-vocabulary tensors never do. The tokens, every node's
acceptance outcome and the log-probs of a whole batch come back in one transfer; the walk then
follows the accepted children on the host.

`choose` is the target's token at a position (argmax, or the seeded sample); `multi_draft_walk` the
outcome of speculative sampling on one tree (`draft_tables`, `node_outcomes`, then
`treeserve.acceptance.walk`). Both dispatch to Triton kernels for CUDA tensors and to their PyTorch
twins otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import ops
from treeserve import sampling
from treeserve.acceptance import Outcome, walk
from treeserve.sampling import Sampling
from treeserve.tree import SparseDist, TokenTree


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


def _to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the device: on CUDA through pinned
    memory (PyTorch's caching host allocator keeps the buffer until the copy is done), so the host
    goes on queueing work behind the forward instead of waiting for it."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _next_positions(tree: TokenTree, committed_length: int) -> list[int]:
    """The absolute position each node's target token is chosen for (and its children are
    candidates for): L + depth + 1."""
    return [committed_length + 1 + d for d in tree.depths()]


def next_positions(tree: TokenTree, committed_length: int, device) -> torch.Tensor:
    """(N,) int64 on `device`: `_next_positions`."""
    return _to_device(torch.tensor(_next_positions(tree, committed_length), dtype=torch.long), device)


def choose(logits: torch.Tensor, s: Sampling, positions: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """The target's token at each of T positions: argmax when greedy, else the seeded sample.
    logits (T, V); positions (T,) absolute positions of the tokens being chosen; probs (T, V):
    `sampling.transform(logits, s)` when the caller has it (top-p then skips its sort).

    A sample is Gumbel-max over the row's log-probabilities up to a constant, with counter-based
    noise (`kernels.gumbel_argmax`, one launch on CUDA): the scaled logits, with top-k as a floor
    on them; with top-p, the log of `sampling.transform`'s probabilities. The token at a position
    depends only on (seed, position, distribution), never on the rows beside it."""
    if s.greedy:
        return logits.argmax(-1)
    key = sampling.stream_key(s.seed, sampling.STREAM_TARGET)
    if 0.0 < s.top_p < 1.0:
        probs = sampling.transform(logits, s) if probs is None else probs
        return ops.gumbel_argmax(torch.log(probs), 1.0, None, key, positions)
    if 0 < s.top_k < logits.shape[-1]:
        z = sampling.scaled_logits(logits, s)
        return ops.gumbel_argmax(z, 1.0, torch.topk(z, s.top_k, dim=-1).values[..., -1], key, positions)
    return ops.gumbel_argmax(logits, 1.0 / s.temperature, None, key, positions, shift=logits.amax(-1).float())


@dataclass(frozen=True)
class DraftTables:
    """What `kernels.node_acceptance` reads for every node of a tree, on the device:
    q (N, V) float64 dense draft distributions (zero rows where a node has none); children (N, M)
    int64 child tokens in draw order, padded with -1 (none where a node has no distribution);
    positions (N,) int64: node i's children are candidates for L + depth(i) + 1, which is also the
    position of node i's target token."""

    q: torch.Tensor
    children: torch.Tensor
    positions: torch.Tensor


def draft_tables(tree: TokenTree, vocab: int, committed_length: int, device) -> DraftTables:
    """`tree`'s tables, in one host-to-device copy (the float64 parts travel as their int64 bits)."""
    if tree.draft is None:
        raise ValueError("multi-draft acceptance needs a tree with draft distributions")
    n = tree.size
    kids = [tree.children(i) if tree.draft[i] is not None else () for i in range(n)]
    width = max(1, max(len(k) for k in kids))
    listed = max(1, max(len(d.tokens) if d is not None else 0 for d in tree.draft))
    fill, idx, val, child = [], [], [], []
    for i, d in enumerate(tree.draft):
        if d is None:
            fill.append(0.0)
            idx += [0] * listed
            val += [0.0] * listed
        else:
            fill.append(d.unlisted_prob(vocab))
            # padding repeats an entry already there, so the scatter writes nothing new
            pad = listed - len(d.tokens)
            idx += list(d.tokens) + [d.tokens[0] if d.tokens else 0] * pad
            val += list(d.probs) + [d.probs[0] if d.tokens else fill[-1]] * pad
        child += [tree.tokens[c] for c in kids[i]] + [-1] * (width - len(kids[i]))
    host = torch.cat([torch.tensor(fill + val, dtype=torch.float64).view(torch.int64),
                      torch.tensor(idx + child + _next_positions(tree, committed_length), dtype=torch.int64)])
    flat = _to_device(host, device)
    fill_d, val_d, idx_d, child_d, pos_d = torch.split(flat, [n, n * listed, n * listed, n * width, n])
    q = fill_d.view(torch.float64)[:, None].expand(n, vocab).clone()
    q.scatter_(1, idx_d.view(n, listed), val_d.view(torch.float64).view(n, listed))
    return DraftTables(q, child_d.view(n, width), pos_d)


def node_outcomes(tables: DraftTables, probs: torch.Tensor, seed: int) -> torch.Tensor:
    """(N, 2) int64 on probs' device, with no host synchronisation: at every node, the index in draw
    order of the child `treeserve.acceptance.accept_among_children` accepts (-1 for none) and the token it emits.
    probs (N, V): each node's transformed target distribution."""
    return ops.accept_nodes(probs, tables.q, tables.children, sampling.stream_key(seed, sampling.STREAM_ACCEPT),
                            sampling.stream_key(seed, sampling.STREAM_RESIDUAL), tables.positions)


def multi_draft_walk(tree: TokenTree, probs: torch.Tensor, committed_length: int, seed: int) -> Outcome:
    """Speculative sampling along the tree: `accept_among_children` at the root, then at each
    accepted child, until a node accepts none (or has no draft distribution or no children) and
    emits a draw from its residual. probs (N, V): every node's transformed target distribution."""
    tables = draft_tables(tree, probs.shape[-1], committed_length, probs.device)
    return walk(tree, node_outcomes(tables, probs, seed).tolist())


def compute(logits: torch.Tensor, offsets: list[int], queries: list[NodeQuery]) -> list[NodeResults]:
    """logits (T, V): trees packed in rows offsets[b]:offsets[b+1], one per query."""
    assert len(offsets) == len(queries) + 1
    tokens = logits.argmax(-1)  # greedy rows are done; sampled rows are overwritten below
    # parts packed behind the tokens, read back in this order
    walk_parts: list[torch.Tensor] = []
    topk_parts: list[torch.Tensor] = []
    for b, q in enumerate(queries):
        lo, hi = offsets[b], offsets[b + 1]
        if not q.sampling.greedy and q.tree.draft is not None:
            tables = draft_tables(q.tree, logits.shape[-1], q.committed_length, logits.device)
            probs = sampling.transform(logits[lo:hi], q.sampling)
            tokens[lo:hi] = choose(logits[lo:hi], q.sampling, tables.positions, probs)
            walk_parts.append(node_outcomes(tables, probs, q.sampling.seed).flatten())
        elif not q.sampling.greedy:
            pos = next_positions(q.tree, q.committed_length, logits.device)
            tokens[lo:hi] = choose(logits[lo:hi], q.sampling, pos)
        if q.top_logprobs > 0:
            k = min(q.top_logprobs, logits.shape[-1])
            top = torch.log_softmax(logits[lo:hi].float(), dim=-1).topk(k, dim=-1)
            topk_parts += [top.indices.float().flatten(), top.values.flatten()]
    # one device->host transfer for the whole batch: the tokens, the walks' node outcomes, and the
    # top-k ids and log-probs when asked for (then all in float32: ids < 2^24 are exact)
    if topk_parts:
        packed = torch.cat([tokens.float(), *(w.float() for w in walk_parts), *topk_parts]).cpu().tolist()
    else:
        packed = torch.cat([tokens, *walk_parts]).cpu().tolist() if walk_parts else tokens.cpu().tolist()
    node_tokens = [int(t) for t in packed[: len(tokens)]]
    out: list[NodeResults] = []
    cursor = len(tokens)
    for b, q in enumerate(queries):
        lo, hi = offsets[b], offsets[b + 1]
        res = NodeResults(node_tokens[lo:hi])
        if q.tree.draft is not None and not q.sampling.greedy:
            flat = packed[cursor : cursor + 2 * (hi - lo)]
            cursor += 2 * (hi - lo)
            res.walk = walk(q.tree, [(int(flat[2 * i]), int(flat[2 * i + 1])) for i in range(hi - lo)])
        out.append(res)
    for b, q in enumerate(queries):
        if q.top_logprobs > 0:
            lo, hi = offsets[b], offsets[b + 1]
            k = min(q.top_logprobs, logits.shape[-1])
            n = (hi - lo) * k
            ids, vals = packed[cursor : cursor + n], packed[cursor + n : cursor + 2 * n]
            cursor += 2 * n
            out[b].top_logprobs = [([int(t) for t in ids[i * k : (i + 1) * k]], vals[i * k : (i + 1) * k]) for i in range(hi - lo)]
    return out


def warm_up(vocab_size: int, device) -> None:
    """Run `compute` once for each kind of sampled query, so that on CUDA its kernels compile before
    the first request instead of at it (about 0.3 s, the first sampled request paid it): a sample
    with and without a top-k floor, one after top-p, and a multi-draft walk (the acceptance and its
    residual draw). Their sizes are not specialised on, so no other tree compiles anything new
    (tests/gpu/test_warm_up.py). A plain sample reads the logits in place, at its tree's first row:
    it runs at row 0 and at row 1, since with a vocabulary that is not a multiple of 4 the row's
    alignment picks one program or another. Greedy queries launch no kernel of their own. On the
    CPU the twins run the same calls, in a few milliseconds."""
    if vocab_size < 3:
        return
    branching = TokenTree((0, 1, 2), (-1, 0, 0), draft=(SparseDist((1, 2), (0.5, 0.5)), None, None))
    queries = [
        NodeQuery(TokenTree.chain([0]), 0, Sampling(temperature=1.0, seed=1)),  # row 0
        NodeQuery(TokenTree.chain([0, 1]), 0, Sampling(temperature=1.0, seed=1)),  # from row 1
        NodeQuery(TokenTree.chain([0]), 0, Sampling(temperature=0.7, top_k=2, seed=2)),
        NodeQuery(TokenTree.chain([0]), 0, Sampling(temperature=1.0, top_p=0.9, seed=3), top_logprobs=2),
        NodeQuery(branching, 0, Sampling(temperature=1.0, seed=4)),
    ]
    offsets = [0]
    for q in queries:
        offsets.append(offsets[-1] + q.tree.size)
    logits = torch.randn(offsets[-1], vocab_size, generator=torch.Generator().manual_seed(0)).to(device)
    compute(logits, offsets, queries)
