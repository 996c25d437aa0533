"""One level of best-first tree growth over a fixed candidate table, as one launch.

A draft tree grown best-first (`drafter_service.growth`) keeps its candidates in fixed places on the
device. With budget B, depth limit D and K = B - 1 (the most children a node gets, and the most
frontier nodes a level has), a run makes at most C = 1 + D·K·K candidates. Candidate `key` has a
fixed place: 0 is the root, and child j of the f-th frontier node of level l is

    key = 1 + l·K·K + f·K + j.

Keys grow with creation order, so "older" in the tie rule is "smaller key", a parent's key is smaller
than its children's, and the selected keys in key order are a tree in topological order with
siblings in draw order.

`grow_level` runs what a level does after the draft forward has given its frontier's children:

1. the children are written to their keys. A child's score is its parent's plus the log of what it
   is ranked by, capped by its earlier siblings' and its parent's (a running minimum along the row,
   started at the parent's score: with probabilities up to 1 the parent's cap changes nothing, but
   it keeps every selection a tree, since a parent then outranks its children whatever comes in);
2. the selection becomes the B best live candidates by (-score, key). The selection threshold only
   rises as candidates are added, so a candidate left out once is never selected later: the
   candidates are the previous selection and this level's children, not the whole table. Key order
   is (depth, key) order, since level l creates every key of depth l + 1;
3. the selected keys, in key order, become the next forward's tree (local index = rank among them,
   rows past it padded with extra children of the root), and the tree the forward just ran over is
   kept for the caller's commit;
4. the next frontier is the selected children of this level, when they are above the depth limit.
   Every earlier selected node has been expanded or sits at the limit, so nothing else can be.

`grow_level_ref` is the plain PyTorch twin (a stable sort over the candidates); the Triton kernel
finds the B-th best candidate by bisection on the bits of the ordered score and then of the key,
so one program does the level with no sort and no host synchronisation (a CUDA graph holds it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Shape:
    """budget B (nodes, root included), depth limit D, node bucket N >= B of the forward, support m
    of a drawn node's reported distribution (0 unless children are drawn)."""

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


class GrowthTables:
    """The device buffers of one growth run for one `Shape` (C = capacity, E = expansions,
    N = nodes, m = max(1, support), B = budget, K = B - 1).

    Candidates: token, parent (key, -1 for the root), depth, expansion (a drawn node's row in
    dist_*) (C + 1,) int64; logp, score (C + 1,) float64; dist_tokens (E + 1, m) int64, dist_probs
    (E + 1, m) float32. The last row of each is a spare that writes going nowhere may use.
    Selection: chosen (B,) int64, the selected keys in key order (rows past their count are stale:
    the kernel leaves them, the twin zeroes them); counts (4,) int64: selected,
    frontier size, levels run, size of the tree the last forward ran over.
    Frontier: rows (K,) its nodes' rows in the forward's tree, fkey (K,) their keys (0 past its size).
    Forward: tree_tokens, tree_positions (N,) int64 and tree_parents (N,) int32, the selected tree
    padded with extra children of the root; last_tokens (N,) int64, last_parents (N,) int32, the
    tree of the forward before. inputs (4,) int64: root token, committed length, slot, stream key;
    inputs32 (3,) int32: the first three, filled by `reset`."""

    def __init__(self, shape: Shape, device: torch.device):
        if shape.budget < 2 or shape.depth < 1 or shape.nodes < shape.budget:
            raise ValueError(f"no tree to grow for {shape}")
        self.shape = shape
        C, E, N, B, K = shape.capacity, shape.expansions, shape.nodes, shape.budget, shape.k
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.token = torch.zeros(C + 1, **i64)
        self.parent = torch.full((C + 1,), -1, **i64)
        self.depth = torch.zeros(C + 1, **i64)
        self.expansion = torch.zeros(C + 1, **i64)
        self.logp = torch.zeros(C + 1, dtype=torch.float64, device=device)
        self.score = torch.full((C + 1,), -math.inf, dtype=torch.float64, device=device)
        self.score[0] = 0.0  # the root's place: only its token changes between runs
        m = max(1, shape.support)
        self.dist_tokens = torch.zeros(E + 1, m, **i64)
        self.dist_probs = torch.zeros(E + 1, m, dtype=torch.float32, device=device)
        self.chosen = torch.zeros(B, **i64)
        self.counts = torch.zeros(4, **i64)
        self.rows = torch.zeros(K, **i64)
        self.fkey = torch.zeros(K, **i64)
        self.tree_tokens = torch.zeros(N, **i64)
        self.tree_positions = torch.zeros(N, **i64)
        self.tree_parents = torch.zeros(N, **i32)
        self.last_tokens = torch.zeros(N, **i64)
        self.last_parents = torch.zeros(N, **i32)
        self.inputs = torch.zeros(4, **i64)
        self.inputs32 = torch.zeros(3, **i32)
        # what `reset` writes that does not depend on the run
        self._start_counts = torch.tensor([1, 1, 0, 0], **i64)
        self._start_parents = torch.zeros(N, **i32)
        self._start_parents[0] = -1
        self._start_depths = torch.ones(N, **i64)
        self._start_depths[0] = 0

    def reset(self) -> None:
        """Start a run from `inputs`, filled beforehand: the root alone is selected and is the frontier."""
        self.inputs32.copy_(self.inputs[:3])
        self.token[:1].copy_(self.inputs[:1])
        self.chosen.zero_()
        self.counts.copy_(self._start_counts)
        self.rows.zero_()
        self.fkey.zero_()
        self.tree_tokens.zero_()
        self.tree_tokens[:1].copy_(self.inputs[:1])
        self.tree_parents.copy_(self._start_parents)
        torch.add(self._start_depths, self.inputs[1], out=self.tree_positions)

    @property
    def committed_length(self) -> torch.Tensor:
        return self.inputs[1:2]

    @property
    def frontier_count(self) -> torch.Tensor:
        return self.counts[1:2]


# ---- the plain twin -----------------------------------------------------------------------------
def grow_level_ref(t: GrowthTables, tokens: torch.Tensor, probs: torch.Tensor,
                   draw_order: torch.Tensor | None = None) -> None:
    """One level's selection after the forward (module docstring), in place on `t`.

    Children per frontier row f < counts[1], in the order they join the tree: without draw_order,
    tokens (K, k') int64 and probs (K, k') float32 are each row's top-k' children, ranked by their own
    probability; with draw_order (K, k') int64, tokens (K, m) and probs (K, m) are each row's
    distribution (largest first) and draw_order the columns drawn, the j-th draw ranked by the j-th
    largest probability, and the distributions are kept in dist_*. Probability 0 marks a row's end:
    that child is none, and the running minimum leaves none after it either."""
    sh = t.shape
    B, K, C, D, N = sh.budget, sh.k, sh.capacity, sh.depth, sh.nodes
    dev = t.chosen.device
    kk = _children_width(t, tokens, draw_order)
    n_chosen, n_front, level = t.counts[0], t.counts[1], t.counts[2]
    if draw_order is None:
        kid_tokens, kid_probs, rank_probs = tokens, probs, probs
    else:
        kid_tokens, kid_probs = tokens.gather(1, draw_order), probs.gather(1, draw_order)
        rank_probs = probs[:, :kk]
    f = torch.arange(K, device=dev)
    real = f < n_front
    fk = t.fkey
    # 1. the children, written to their keys (those that are none go to the spare row)
    valid = (kid_probs > 0) & real[:, None]
    ckey = 1 + level * (K * K) + f[:, None] * K + torch.arange(kk, device=dev)[None, :]
    parent_score = t.score[fk][:, None]
    capped = torch.minimum(torch.cummin(parent_score + torch.log(rank_probs.double()), dim=1).values, parent_score)
    cscore = torch.where(valid, capped, -math.inf)
    wkey = torch.where(valid, ckey, C)
    t.token[wkey] = kid_tokens
    t.parent[wkey] = fk[:, None].expand_as(wkey)
    t.depth[wkey] = (t.depth[fk] + 1)[:, None].expand_as(wkey)
    t.logp[wkey] = t.logp[fk][:, None] + torch.log(kid_probs.double())
    t.score[wkey] = cscore
    t.score[C:].fill_(-math.inf)
    if draw_order is not None:
        e = torch.where(real, 1 + level * K + f, sh.expansions)
        t.dist_tokens[e] = tokens
        t.dist_probs[e] = probs
        t.expansion[torch.where(real, fk, C)] = e
    # 2. the B best of the previous selection and the children, which are in key order already
    old = torch.arange(B, device=dev) < n_chosen
    keys = torch.cat([torch.where(old, t.chosen, C), wkey.flatten()])
    scores = t.score[keys]
    best = torch.sort(scores, descending=True, stable=True).indices[:B]
    sel = torch.zeros_like(keys, dtype=torch.bool)
    sel[best] = scores[best] > -math.inf
    # 3. the kept forward tree, then the new one
    t.last_tokens.copy_(t.tree_tokens)
    t.last_parents.copy_(t.tree_parents)
    t.counts[3:4].copy_(n_chosen.reshape(1))
    rank = torch.cumsum(sel.long(), 0) - 1
    place = torch.where(sel, rank, B)
    chosen = torch.zeros(B + 1, dtype=torch.int64, device=dev)
    chosen[place] = keys
    t.chosen.copy_(chosen[:B])
    n_new = sel.sum()
    local = torch.zeros(C + 1, dtype=torch.int64, device=dev)
    local[torch.where(sel, keys, C)] = rank
    rows = torch.arange(N, device=dev)
    inside = rows < n_new
    ckeys = t.chosen[rows.clamp(max=B - 1)]
    par = t.parent[ckeys]
    t.tree_tokens.copy_(torch.where(inside, t.token[ckeys], 0))
    t.tree_parents.copy_(torch.where(inside, torch.where(par >= 0, local[par.clamp(min=0)], -1), 0))
    t.tree_positions.copy_(t.committed_length + torch.where(inside, t.depth[ckeys], 1))
    # 4. the next frontier: the selected children, when above the depth limit
    front = sel & (torch.arange(keys.numel(), device=dev) >= B) & (level + 1 < D)
    frank = torch.where(front, torch.cumsum(front.long(), 0) - 1, K)
    nxt = torch.zeros(2, K + 1, dtype=torch.int64, device=dev)
    nxt[0][frank] = rank
    nxt[1][frank] = keys
    t.rows.copy_(nxt[0, :K])
    t.fkey.copy_(nxt[1, :K])
    t.counts[:3].copy_(torch.stack([n_new, front.sum(), level + 1]))


# ---- the kernel ---------------------------------------------------------------------------------
@triton.jit
def _min(a, b):
    return tl.minimum(a, b)


@triton.jit
def _ordered(score):
    """float64 -> int64 whose signed order is the scores' order (-0.0 taken as 0.0)."""
    bits = (score + 0.0).to(tl.int64, bitcast=True)
    return bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF)


@triton.jit
def _grow_level_kernel(
        token_ptr, parent_ptr, depth_ptr, expansion_ptr, logp_ptr, score_ptr, dist_tok_ptr, dist_prob_ptr,
        chosen_ptr, counts_ptr, rows_ptr, fkey_ptr, tree_tok_ptr, tree_pos_ptr, tree_par_ptr,
        last_tok_ptr, last_par_ptr, inputs_ptr,
        tok_ptr, prob_ptr, order_ptr, tok_stride, prob_stride, order_stride,
        B, K, KK, M, D, N,
        BP: tl.constexpr, KP: tl.constexpr, KKP: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr,
        KEY_BITS: tl.constexpr, DRAWN: tl.constexpr):
    n_chosen = tl.load(counts_ptr)
    n_front = tl.load(counts_ptr + 1)
    level = tl.load(counts_ptr + 2)
    length = tl.load(inputs_ptr + 1)
    lowest = tl.full([], -9223372036854775807 - 1, tl.int64)

    # the tree the forward ran over, kept for the commit
    n_i = tl.arange(0, NP)
    n_m = n_i < N
    ran_tok = tl.load(tree_tok_ptr + n_i, mask=n_m)
    ran_par = tl.load(tree_par_ptr + n_i, mask=n_m)

    # the previous selection, in key order
    b = tl.arange(0, BP)
    b_m = b < n_chosen
    okey = tl.load(chosen_ptr + b, mask=b_m, other=0)
    otok = tl.load(token_ptr + okey, mask=b_m, other=0)
    opar = tl.load(parent_ptr + okey, mask=b_m, other=-1)
    odep = tl.load(depth_ptr + okey, mask=b_m, other=0)
    oval = tl.where(b_m, _ordered(tl.load(score_ptr + okey, mask=b_m, other=0.0)), lowest)

    # 1. the frontier's children (rows f, draws j)
    f = tl.arange(0, KP)
    f_m = f < n_front
    fk = tl.load(fkey_ptr + f, mask=f_m, other=0)
    fscore = tl.load(score_ptr + fk, mask=f_m, other=0.0)
    flogp = tl.load(logp_ptr + fk, mask=f_m, other=0.0)
    fdep = tl.load(depth_ptr + fk, mask=f_m, other=0)
    j = tl.arange(0, KKP)
    c_m = f_m[:, None] & (j[None, :] < KK)
    if DRAWN:
        col = tl.load(order_ptr + f[:, None] * order_stride + j[None, :], mask=c_m, other=0)
        ctok = tl.load(tok_ptr + f[:, None] * tok_stride + col, mask=c_m, other=0)
        cprob = tl.load(prob_ptr + f[:, None] * prob_stride + col, mask=c_m, other=0.0)
        crank = tl.load(prob_ptr + f[:, None] * prob_stride + j[None, :], mask=c_m, other=0.0)
    else:
        ctok = tl.load(tok_ptr + f[:, None] * tok_stride + j[None, :], mask=c_m, other=0)
        cprob = tl.load(prob_ptr + f[:, None] * prob_stride + j[None, :], mask=c_m, other=0.0)
        crank = cprob
    valid = c_m & (cprob > 0)
    ckey = 1 + level * (K * K) + f[:, None] * K + j[None, :]
    pscore = fscore[:, None] + tl.log(crank.to(tl.float64))
    capped = tl.minimum(tl.associative_scan(tl.where(c_m, pscore, float("inf")), 1, _min), fscore[:, None])
    live = valid & (capped > float("-inf"))
    cdep = fdep[:, None] + 1
    tl.store(token_ptr + ckey, ctok, mask=valid)
    tl.store(parent_ptr + ckey, fk[:, None] + tl.zeros_like(ckey), mask=valid)
    tl.store(depth_ptr + ckey, cdep + tl.zeros_like(ckey), mask=valid)
    tl.store(logp_ptr + ckey, flogp[:, None] + tl.log(cprob.to(tl.float64)), mask=valid)
    tl.store(score_ptr + ckey, tl.where(valid, capped, float("-inf")), mask=valid)
    if DRAWN:
        e = 1 + level * K + f
        mcol = tl.arange(0, MP)
        d_m = f_m[:, None] & (mcol[None, :] < M)
        dtok = tl.load(tok_ptr + f[:, None] * tok_stride + mcol[None, :], mask=d_m)
        dprob = tl.load(prob_ptr + f[:, None] * prob_stride + mcol[None, :], mask=d_m)
        tl.store(dist_tok_ptr + e[:, None] * M + mcol[None, :], dtok, mask=d_m)
        tl.store(dist_prob_ptr + e[:, None] * M + mcol[None, :], dprob, mask=d_m)
        tl.store(expansion_ptr + fk, e, mask=f_m)

    # 2. the B-th best candidate by (-score, key): bisection on the ordered score's bits (with the
    # sign bit fixed first, the lower bits order as the signed value), then on the key's among ties
    cval = tl.where(live, _ordered(capped), lowest)
    top = tl.where(tl.sum((oval >= 0).to(tl.int32), 0) + tl.sum(tl.sum((cval >= 0).to(tl.int32), 1), 0) >= B,
                   tl.zeros([], tl.int64), lowest)
    for bit in range(62, -1, -1):
        trial = top | (tl.full([], 1, tl.int64) << bit)
        above = tl.sum((oval >= trial).to(tl.int32), 0) + tl.sum(tl.sum((cval >= trial).to(tl.int32), 1), 0)
        top = tl.where(above >= B, trial, top)
    need = B - tl.sum((oval > top).to(tl.int32), 0) - tl.sum(tl.sum((cval > top).to(tl.int32), 1), 0)
    otie = oval == top
    ctie = cval == top
    last_key = tl.zeros([], tl.int64)  # the largest key with fewer than `need` tied keys below it
    for bit in range(KEY_BITS - 1, -1, -1):
        trial = last_key | (tl.full([], 1, tl.int64) << bit)
        below = tl.sum((otie & (okey < trial)).to(tl.int32), 0) + \
            tl.sum(tl.sum((ctie & (ckey < trial)).to(tl.int32), 1), 0)
        last_key = tl.where(below < need, trial, last_key)
    osel = b_m & ((oval > top) | (otie & (okey <= last_key)))
    csel = live & ((cval > top) | (ctie & (ckey <= last_key)))

    # 3. places in key order: the kept selection first, then the children row by row
    n_old = tl.sum(osel.to(tl.int32), 0)
    opos = tl.cumsum(osel.to(tl.int32), 0) - 1
    row_count = tl.sum(csel.to(tl.int32), 1)
    row_start = tl.cumsum(row_count, 0) - row_count
    cpos = n_old + row_start[:, None] + tl.cumsum(csel.to(tl.int32), 1) - 1
    n_kids = tl.sum(row_count, 0)
    n_new = n_old + n_kids
    # parents' new places: a kept node's parent is kept (a parent outranks its children), and a
    # child's parent is a frontier node of the previous selection
    same = (opar[:, None] == okey[None, :]) & b_m[None, :]
    opar_local = tl.where(opar < 0, -1, tl.sum(tl.where(same, opos[None, :], 0), 1))
    fsame = (fk[:, None] == okey[None, :]) & b_m[None, :]
    fpos = tl.sum(tl.where(fsame, opos[None, :], 0), 1)

    # every read of the buffers rewritten below is done
    tl.debug_barrier()
    tl.store(last_tok_ptr + n_i, ran_tok, mask=n_m)
    tl.store(last_par_ptr + n_i, ran_par, mask=n_m)
    tl.store(chosen_ptr + opos, okey, mask=osel)
    tl.store(chosen_ptr + cpos, ckey, mask=csel)
    tl.store(tree_tok_ptr + opos, otok, mask=osel)
    tl.store(tree_par_ptr + opos, opar_local.to(tl.int32), mask=osel)
    tl.store(tree_pos_ptr + opos, length + odep, mask=osel)
    tl.store(tree_tok_ptr + cpos, ctok, mask=csel)
    tl.store(tree_par_ptr + cpos, (fpos[:, None] + tl.zeros_like(cpos)).to(tl.int32), mask=csel)
    tl.store(tree_pos_ptr + cpos, length + cdep + tl.zeros_like(ckey), mask=csel)
    pad = n_m & (n_i >= n_new)
    tl.store(tree_tok_ptr + n_i, tl.zeros_like(ran_tok), mask=pad)
    tl.store(tree_par_ptr + n_i, tl.zeros_like(ran_par), mask=pad)
    tl.store(tree_pos_ptr + n_i, length + 1 + tl.zeros_like(ran_tok), mask=pad)
    # 4. the next frontier: the selected children (all of one depth), when above the depth limit
    deeper = (level + 1) < D
    front = csel & deeper
    frank = cpos - n_old
    tl.store(rows_ptr + frank, cpos.to(tl.int64), mask=front)
    tl.store(fkey_ptr + frank, ckey, mask=front)
    n_next = tl.where(deeper, n_kids, 0)
    k_i = tl.arange(0, KP)
    k_pad = (k_i < K) & (k_i >= n_next)
    tl.store(rows_ptr + k_i, tl.zeros_like(fk), mask=k_pad)
    tl.store(fkey_ptr + k_i, tl.zeros_like(fk), mask=k_pad)
    tl.store(counts_ptr, n_new.to(tl.int64))
    tl.store(counts_ptr + 1, n_next.to(tl.int64))
    tl.store(counts_ptr + 2, level + 1)
    tl.store(counts_ptr + 3, n_chosen)


def grow_level(t: GrowthTables, tokens: torch.Tensor, probs: torch.Tensor,
               draw_order: torch.Tensor | None = None) -> None:
    """Triton twin of `grow_level_ref` (same arguments): one program, one launch."""
    sh = t.shape
    kk = _children_width(t, tokens, draw_order)
    m = tokens.shape[1] if draw_order is not None else 1
    if tokens.stride(1) != 1 or probs.stride(1) != 1:
        tokens, probs = tokens.contiguous(), probs.contiguous()
    order = tokens if draw_order is None else draw_order.contiguous()
    kp, kkp = _block(sh.k), _block(kk)
    _grow_level_kernel[(1,)](
        t.token, t.parent, t.depth, t.expansion, t.logp, t.score, t.dist_tokens, t.dist_probs,
        t.chosen, t.counts, t.rows, t.fkey, t.tree_tokens, t.tree_positions, t.tree_parents,
        t.last_tokens, t.last_parents, t.inputs,
        tokens, probs, order, tokens.stride(0), probs.stride(0), order.stride(0),
        sh.budget, sh.k, kk, t.dist_tokens.shape[1], sh.depth, sh.nodes,
        BP=_block(sh.budget), KP=kp, KKP=kkp, MP=_block(m), NP=_block(sh.nodes), KEY_BITS=max(1, sh.capacity.bit_length()),
        DRAWN=draw_order is not None, num_warps=4 if kp * kkp <= 1024 else 8 if kp * kkp <= 4096 else 16)


def _children_width(t: GrowthTables, tokens: torch.Tensor, draw_order: torch.Tensor | None) -> int:
    """k', the children a frontier row gives, after checking the arguments fit the tables."""
    kk = (tokens if draw_order is None else draw_order).shape[1]
    if kk > t.shape.k:  # a row's keys would run into the next row's
        raise ValueError(f"{kk} children a node for a budget of {t.shape.budget}")
    if draw_order is not None and tokens.shape[1] != t.dist_tokens.shape[1]:
        raise ValueError(f"distributions of {tokens.shape[1]} tokens for tables of {t.dist_tokens.shape[1]}")
    return kk


def _block(n: int) -> int:
    """Block size for n entries: a power of two, at least 16. Triton 3.6 fails to compile this
    kernel (a layout conversion that no longer dominates its use) for some smaller blocks, 8 x 8
    children among them."""
    return max(16, triton.next_power_of_2(n))
