"""Dynamic trees grown on the device: the best-first loop of `drafter_service.dynamic` as tensor
operations over a fixed candidate table, so that one level (the draft forward over the tree so far,
the children of its frontier, the new selection) is one CUDA graph replay and the host reads one
number per level (whether a frontier is left) instead of every candidate.

The table. With budget B, depth limit D and K = B - 1 (the most children a node gets, and the most
frontier nodes a level has), a run makes at most 1 + D·K·K candidates. Candidate `key` has a fixed
place: 0 is the root, and child j of the f-th frontier node of level l is

    key = 1 + l·K·K + f·K + j.

Keys grow with creation order (levels in turn, frontier nodes by key, children in draw order), so
"older" in the tie rule is "smaller key", a parent's key is smaller than its children's, and the
selected keys in order are a tree in topological order with siblings in draw order. Each level:

1. the selected nodes, in key order, become the forward's tree (local index = rank among them),
   padded to the graph's node bucket with extra children of the root;
2. the frontier (selected, not yet expanded, above the depth limit), in key order, gets its
   children from the draft logits at its rows (`ChildPicker.pick_tensors`), written to their keys;
3. the selection becomes the B best valid candidates by (-score, depth, key).

`dynamic.DynamicProposer`'s host loop is this loop's plain twin: it keys each node's draws by the
same `key`, so both build the same tree for the same logits (`tests/drafter/test_growth.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from drafter_service.children import ChildPicker
from drafter_service.proposer import Draft
from treeserve.tree import SparseDist, TokenTree

# Largest candidate table grown on the device (about 60 bytes a candidate); larger trees (a deep
# limit on a large budget) take the host loop.
MAX_CANDIDATES = 1 << 17

# forward(tokens (N,), positions (N,), parents (N,) int32 local, rows (F,)) -> (F, columns) fp32 logits
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Shape:
    """budget B (nodes, root included), depth limit D, node bucket N >= B of the forward, support m
    of a drawn node's reported distribution (0 unless the picker draws)."""

    budget: int
    depth: int
    nodes: int
    support: int = 0

    @property
    def k(self) -> int:
        return self.budget - 1

    @property
    def capacity(self) -> int:
        return 1 + self.depth * self.k * self.k

    @property
    def expansions(self) -> int:
        return 1 + self.depth * self.k


class Growth:
    """The candidate table of one run and its level step, for one `Shape` on one device.

    `reset` starts a run from `inputs` (root, committed length, slot, stream key), which the caller
    fills with one copy; `level` runs one level and leaves the frontier's size in `frontier_count`;
    `read` brings the result to the host. `level` launches only device work whose shapes
    depend on the `Shape` alone, so it can be captured once and replayed for every run of it.

    Tables (C = capacity, E = expansions, N = nodes, m = support): token, parent (key, -1 for the
    root), depth, expansion (C + 1,) int64; logp, score (C + 1,) float64; expanded, selected
    (C + 1,) bool; dist_tokens (E + 1, m) int64, dist_probs (E + 1, m) float32."""

    def __init__(self, shape: Shape, picker: ChildPicker, forward: Forward, device: torch.device):
        if shape.budget < 2 or shape.depth < 1 or shape.nodes < shape.budget:
            raise ValueError(f"no tree to grow for {shape}")
        self.shape, self.picker, self.forward = shape, picker, forward
        C, E, N, K = shape.capacity, shape.expansions, shape.nodes, shape.k
        i64 = dict(dtype=torch.int64, device=device)
        # one spare row past the end of each table: writes that must go nowhere go there
        self.token = torch.zeros(C + 1, **i64)
        self.parent = torch.full((C + 1,), -1, **i64)
        self.depth = torch.zeros(C + 1, **i64)
        self.logp = torch.zeros(C + 1, dtype=torch.float64, device=device)
        self.score = torch.full((C + 1,), -math.inf, dtype=torch.float64, device=device)
        self.expanded = torch.zeros(C + 1, dtype=torch.bool, device=device)
        self.selected = torch.zeros(C + 1, dtype=torch.bool, device=device)
        self.expansion = torch.zeros(C + 1, **i64)  # a drawn node's row in dist_*
        self.keys = torch.arange(C + 1, **i64)
        m = max(1, shape.support)
        self.dist_tokens = torch.zeros(E + 1, m, **i64)
        self.dist_probs = torch.zeros(E + 1, m, dtype=torch.float32, device=device)
        # inputs of a run: root, committed length, slot, stream key
        self.inputs = torch.zeros(4, **i64)
        self.level_index = torch.zeros(1, **i64)
        # the forward's tree (its tokens, parents and positions are static buffers a graph reads)
        self.fwd_tokens = torch.zeros(N + 1, **i64)
        self.fwd_parents = torch.zeros(N + 1, **i64)
        self.fwd_depth = torch.ones(N + 1, **i64)
        self.fwd_size = torch.zeros(1, **i64)
        self.frontier_count = torch.zeros(1, **i64)
        self._f = torch.arange(K, **i64)
        self._j = torch.arange(K, **i64)

    # ---- a run ----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a run from `inputs` (4,) int64, filled beforehand: root token, committed length,
        slot, stream key."""
        self.token.zero_()
        self.token[:1].copy_(self.inputs[:1])
        self.parent.fill_(-1)
        self.depth.zero_()
        self.logp.zero_()
        self.score.fill_(-math.inf)
        self.score[:1].fill_(0.0)
        self.expanded.zero_()
        self.selected.zero_()
        self.selected[:1].fill_(True)
        self.level_index.zero_()
        self.fwd_size.zero_()
        self.frontier_count.fill_(1)

    @property
    def committed_length(self) -> torch.Tensor:
        return self.inputs[1:2]

    @property
    def slot(self) -> torch.Tensor:
        return self.inputs[2:3]

    def level(self) -> None:
        """One level: forward over the selected tree, children of the frontier, new selection."""
        sh = self.shape
        C, N, K = sh.capacity, sh.nodes, sh.k
        sel = self.selected[:C]
        dep = self.depth[:C]
        front = self._frontier()
        # 1. the selected nodes in key order are the forward's tree
        local, where = _places(sel, N)
        self.fwd_tokens.zero_()
        self.fwd_parents.zero_()
        self.fwd_depth.fill_(1)
        self.fwd_tokens[where] = self.token[:C]
        par = self.parent[:C]
        self.fwd_parents[where] = torch.where(par >= 0, local[par.clamp(min=0)], -1)
        self.fwd_depth[where] = dep
        self.fwd_size.copy_(sel.sum().reshape(1))
        # 2. the frontier's rows and keys, in key order (rows past its size stand on the root)
        _, place = _places(front, K)
        rows = torch.zeros(K + 1, dtype=torch.int64, device=sel.device)
        rows[place] = local
        fkey = torch.zeros(K + 1, dtype=torch.int64, device=sel.device)
        fkey[place] = self.keys[:C]
        rows, fkey = rows[:K], fkey[:K]
        n_front = front.sum()
        logits = self.forward(self.fwd_tokens[:N], self.committed_length + self.fwd_depth[:N],
                              self.fwd_parents[:N].to(torch.int32), rows)
        picked = self.picker.pick_tensors(logits, K, self.committed_length, fkey, self.inputs[3:4])
        tokens, probs = picked.tokens, picked.probs  # (K, kk) each
        kk = tokens.shape[1]
        real = self._f < n_front  # (K,) frontier rows that are nodes
        valid = (probs > 0) & real[:, None]
        base = 1 + self.level_index * (K * K)
        child = base + self._f[:, None] * K + self._j[None, :kk]  # (K, kk) keys
        child = torch.where(valid, child, C)
        pscore = self.score[fkey][:, None] + picked.rank_logq
        # a later draw never outranks an earlier one: cap by the running minimum along the row
        capped = torch.cummin(pscore, dim=1).values
        self.token[child] = tokens
        self.parent[child] = fkey[:, None].expand_as(child)
        self.depth[child] = (self.depth[fkey] + 1)[:, None].expand_as(child)
        self.logp[child] = self.logp[fkey][:, None] + torch.log(probs.double())
        self.score[child] = torch.where(valid, capped, -math.inf)
        self.score[C:].fill_(-math.inf)
        done = torch.where(real, fkey, C)
        self.expanded.index_fill_(0, done, True)
        if picked.draw_order is not None:
            e = torch.where(real, 1 + self.level_index * K + self._f, sh.expansions)
            self.dist_tokens[e] = picked.dist_tokens
            self.dist_probs[e] = picked.dist_probs
            self.expansion[done] = e
        # 3. the new selection: the B best by (-score, depth, key), valid candidates only. Key order
        # is (depth, key) order already: level l creates keys above every earlier level's, all at
        # depth l + 1 (its frontier is the selected nodes of depth l: a candidate left out once is
        # never selected later), so one stable sort by score gives the whole order.
        best = torch.sort(self.score[:C], descending=True, stable=True).indices[: sh.budget]
        self.selected.zero_()
        self.selected[best] = self.score[best] > -math.inf
        self.frontier_count.copy_(self._frontier().sum().reshape(1))
        self.level_index += 1

    def _frontier(self) -> torch.Tensor:
        """(C,) bool: selected, not yet expanded, above the depth limit."""
        C = self.shape.capacity
        return self.selected[:C] & ~self.expanded[:C] & (self.depth[:C] < self.shape.depth)

    # ---- results --------------------------------------------------------------------------------
    def read(self, with_dists: bool) -> tuple[Draft, TokenTree]:
        """The grown tree (with the distributions its drawn nodes were drawn from, if asked) and the
        last level's forward tree, brought to the host in one transfer."""
        sh = self.shape
        C, B, N = sh.capacity, sh.budget, sh.nodes
        sel = self.selected[:C]
        local, where = _places(sel, B)
        keys = torch.zeros(B + 1, dtype=torch.int64, device=sel.device)
        keys[where] = self.keys[:C]
        keys = keys[:B]  # the selected keys in order, then the root again as padding
        par = self.parent[keys]
        parents = torch.where(par >= 0, local[par.clamp(min=0)], -1)
        parts = [sel.sum().reshape(1), self.fwd_size, self.token[keys], parents, self.logp[keys],
                 self.fwd_tokens[:N], self.fwd_parents[:N]]
        if with_dists:
            e = self.expansion[keys]
            parts += [self.dist_tokens[e].flatten(), self.dist_probs[e].flatten()]
        flat = torch.cat([t.double() for t in parts]).cpu().numpy()
        n, fn = int(flat[0]), int(flat[1])
        at = 2
        tokens = flat[at:at + n].astype("int64").tolist()
        parents = flat[at + B:at + B + n].astype("int64").tolist()
        logp = tuple(flat[at + 2 * B:at + 2 * B + n].tolist())
        at += 3 * B
        forwarded = TokenTree(tuple(flat[at:at + fn].astype("int64").tolist()),
                              tuple(flat[at + N:at + N + fn].astype("int64").tolist()))
        # a node reports its distribution only when it has children in the final tree
        has_kids = set(parents[1:])
        if not with_dists or not has_kids:
            return Draft(TokenTree(tuple(tokens), tuple(parents)), logp), forwarded
        at += 2 * N
        m = self.dist_tokens.shape[1]
        dt = flat[at:at + B * m].reshape(B, m).astype("int64")
        dp = flat[at + B * m:at + 2 * B * m].reshape(B, m)
        dists = tuple(SparseDist(tuple(dt[i][dp[i] > 0].tolist()), tuple(dp[i][dp[i] > 0].tolist()), 0.0)
                      if i in has_kids else None for i in range(n))
        return Draft(TokenTree(tuple(tokens), tuple(parents), dists), logp), forwarded


def _places(mask: torch.Tensor, spare: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a (C,) bool mask: each entry's rank among the set ones (C,), and the same with every
    unset entry sent to `spare` (the row past a table's end, where writes go nowhere)."""
    rank = torch.cumsum(mask.long(), 0) - 1
    return rank, torch.where(mask, rank, spare)
