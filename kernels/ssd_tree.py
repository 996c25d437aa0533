"""Tree-masked SSD: every node of a packed batch of token trees through one Mamba2 layer's scan.

For node i with root-to-i path anc*(i), starting from the committed state h0 (design §4):

    y_i = sum_{j in anc*(i)} exp(dAcs_i - dAcs_j) (C_i . B_j) dt_j x_j
          + exp(dAcs_i) C_i . h0 + D x_i                            (times silu(z_i) if z is given)

with dAcs_i the sum of dt A over anc*(i). Per-node states are never formed; the state pool is only
read. The ancestor relation comes in as the per-forward bit mask of `kernels.tree_struct`.

`tree_ssd_scan_deferred_norm` also applies a one-group gated RMSNorm, less its scale (Mamba2 and
Bamba layers, whose out_proj has no bias): u_i = w * (y_i * silu(z_i)) and one partial sum of squares
of y_i * silu(z_i) per program and node, which the residual add after out_proj turns into the rstd
(`kernels.norms.SumOfSquares`), as the fused decode step does. That saves a verify the gated norm's
own launch, which had to wait for the whole scan.

Two launches: one program per (tree x row tile, head, headdim tile) (`_tree_ssd_kernel`, every tree
size), and for serving batches of trees of up to 16 nodes a persistent one whose programs take those
items in turn with the next item's loads pipelined (`_tree_ssd_persistent_kernel`; the rule is
`persistent_programs_per_sm`). Both run the same per-tile arithmetic (`_diagonal_block`, `_store_rows`).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import pdl, ssm_common
from kernels.norms import SumOfSquares, gated_rms_norm_deferred_ref
from kernels.pdl import release_next, wait_for_previous
from kernels.ssm_common import (
    NATIVE_HALF_DOT,
    as_int32,
    dot_precision,
    dt_activation,
    expand_groups,
    fast_exp,
    heads_per_group,
    limits,
    pow2,
    silu,
    silu_gate,
    softplus_clamped,
)
from kernels.tree_index import ancestor_mask, block_nodes, tree_sizes
from kernels.tree_struct import ancestor_bits, ancestor_mask_from_bits, words_per_row


def tree_ssd_scan_ref(x, dt, A, B, C, D, dt_bias, ssm_state, parents, cu_seqlens, slot_idx, max_nodes, dt_limit,
                      z=None, ancestors=None):
    """PyTorch twin of `tree_ssd_scan`.

    x (T, H, P), dt (T, H) raw, A (H,) fp32 negative, B/C (T, G, N), D (H,) or None, dt_bias (H,) or None,
    ssm_state (S, H, P, N) fp32, parents (T,) local, cu_seqlens (B+1,), slot_idx (B,), z (T, H, P) or None,
    ancestors (T, W) int32 from `tree_struct.ancestor_bits` or None (then built from parents)
    -> y (T, H, P) in x.dtype.
    """
    H = x.shape[1]
    n = int(max_nodes)
    sizes = tree_sizes(cu_seqlens)
    local = torch.arange(n, device=x.device)
    valid = local[None, :] < sizes[:, None]  # (Bt, n)
    rows = torch.where(valid, cu_seqlens[:-1].long()[:, None] + local[None, :], torch.zeros_like(local[None, :]))

    if ancestors is None:
        M = ancestor_mask(parents, cu_seqlens, n)  # (Bt, n, n)
    else:
        M = ancestor_mask_from_bits(ancestors, cu_seqlens, n)
    dtv = dt_activation(dt, dt_bias, dt_limit)[rows] * valid[..., None]  # (Bt, n, H)
    # path sums in float64: differences of large negative fp32 sums would lose the small segments
    dAcs = torch.einsum("bij,bjh->bih", M.double(), (dtv * A.float()).double())
    seg = (dAcs[:, :, None, :] - dAcs[:, None, :, :]).clamp(max=0.0)  # (Bt, i, j, H)
    L = torch.where(M[..., None], torch.exp(seg), torch.zeros_like(seg)).float()
    dAcs = dAcs.float()

    xs = x.float()[rows]  # (Bt, n, H, P)
    Bh = expand_groups(B.float()[rows], H)  # (Bt, n, H, N)
    Ch = expand_groups(C.float()[rows], H)
    h0 = ssm_state[slot_idx.long()].float()  # (Bt, H, P, N)

    CB = torch.einsum("bihn,bjhn->bijh", Ch, Bh)
    y = torch.einsum("bijh,bjh,bjhp->bihp", L * CB, dtv, xs)
    y = y + torch.exp(dAcs)[..., None] * torch.einsum("bihn,bhpn->bihp", Ch, h0)
    if D is not None:
        y = y + D.float()[None, None, :, None] * xs
    out = y[valid]  # packed order: trees in order, nodes in order
    return silu_gate(out, z).to(x.dtype)


def tree_ssd_scan_deferred_norm_ref(x, dt, A, B, C, D, dt_bias, ssm_state, parents, cu_seqlens, slot_idx, max_nodes,
                                    dt_limit, z, norm_weight, norm_eps: float, ancestors=None):
    """PyTorch twin of `tree_ssd_scan_deferred_norm`: the scan without its gate (y rounded to x.dtype,
    as the scan stores it), then `gated_rms_norm_deferred_ref(y, z, norm_weight, norm_eps, z.dtype)`
    over all H * P channels -> (u (T, H * P), SumOfSquares)."""
    T, H, P = x.shape
    y = tree_ssd_scan_ref(x, dt, A, B, C, D, dt_bias, ssm_state, parents, cu_seqlens, slot_idx, max_nodes, dt_limit,
                          ancestors=ancestors)
    return gated_rms_norm_deferred_ref(y.reshape(T, H * P), z.reshape(T, H * P), norm_weight, norm_eps, z.dtype)


# Node tiles are at most this tall: bigger trees are cut into row tiles x column blocks so the
# (rows x cols) decay/score tiles stay in registers.
MAX_TILE = 64
# d_state is swept in chunks of this many columns, except by one-tile trees with narrow headdim tiles
# (the small-batch launch), which take it whole: one round of loads, and registers to spare
N_CHUNK = 64


# Path sums. With M the ancestor-or-self mask and dA_j = dt_j A, node i's cumulative sum is
# dAcs_i = sum_j M[i, j] dA_j, and the decay from ancestor j to i is exp(dAcs_i - dAcs_j). Both are
# formed from the per-forward bit mask (kernels.tree_struct) with masked row sums, so no program walks
# parent pointers. The sums run in float64: a difference of two long fp32 sums would lose a short
# segment's value whenever the path above it is large (big dt, big |A|), while in float64 even sums
# of 256 terms near -1e4 keep the exponent's error below 1e-7, under fp32 rounding of the decay. Each
# dA is clamped at -1e4 first: any segment containing a clamped node still decays to exactly 0 in fp32
# (exp underflows below -104), and every sum stays finite. (tests/kernels/test_ssd_tree.py has a case
# that fp32 sums fail.)


@triton.jit
def _ancestor_tile(anc_ptr, sa_t, tok_rows, rows_ok, j0, BI: tl.constexpr):
    """(BI, BI) bool: is local node j0 + c an ancestor-or-self of packed node tok_rows[r]?"""
    cols = j0 + tl.arange(0, BI)
    words = tl.load(anc_ptr + tok_rows[:, None] * sa_t + (cols // 32)[None, :], mask=rows_ok[:, None], other=0)
    return ((words >> (cols % 32)[None, :]) & 1) != 0


@triton.jit
def _node_dt(dt_ptr, sdt_t, sdt_h, start, n, j0, h, bias, dt_lo, dt_hi, BI: tl.constexpr):
    """(BI,) activated fp32 dt of local nodes j0 .. j0 + BI of one tree and head (0 past the tree)."""
    raw, ok = _node_dt_raw(dt_ptr, sdt_t, sdt_h, start, n, j0, h, BI)
    return _activated(raw, ok, bias, dt_lo, dt_hi)


@triton.jit
def _node_dt_raw(dt_ptr, sdt_t, sdt_h, start, n, j0, h, BI: tl.constexpr):
    """The load half of `_node_dt`: ((BI,) raw dt, (BI,) inside the tree)."""
    j = j0 + tl.arange(0, BI)
    ok = j < n
    return tl.load(dt_ptr + (start + j) * sdt_t + h * sdt_h, mask=ok, other=0.0), ok


@triton.jit
def _activated(raw, ok, bias, dt_lo, dt_hi):
    """The arithmetic half of `_node_dt`."""
    return _computed_once(tl.where(ok, softplus_clamped(raw.to(tl.float32) + bias, dt_lo, dt_hi), 0.0))


@triton.jit
def _computed_once(v):
    """v, a (BI,) vector, through a reduction. A reduction's result has a layout of its own, so the
    compiler converts it (once, via shared memory) for each use instead of recomputing v, and the
    loads behind it, in the layout of every tile that uses it: for a column vector of a (BI, BI) tile
    that is once per column a thread holds, each recomputed load's latency exposed in turn."""
    return tl.sum(tl.where(tl.arange(0, 2)[None, :] == 0, v[:, None], 0.0), axis=1)


@triton.jit
def _masked_row_sum(m, dA):
    """(BI,) fp64 sum over columns j with m[:, j] of dA[j] ((BI,) fp32, each clamped at -1e4)."""
    dA64 = _computed_once(tl.maximum(dA, -1.0e4).to(tl.float64))
    return tl.sum(tl.where(m, dA64[None, :], 0.0), axis=1)


@triton.jit
def _path_sums(anc_ptr, sa_t, dt_ptr, sdt_t, sdt_h, start, n, tok, ok, nblk, h, bias, A, dt_lo, dt_hi,
               BI: tl.constexpr):
    """(BI,) fp64: for packed nodes `tok`, dA summed over their ancestors-or-self in column blocks
    0 .. nblk - 1. Each block is a mask tile and a dt vector: independent loads, no chains."""
    acc = tl.zeros([BI], dtype=tl.float64)
    for k in range(0, nblk):
        m = _ancestor_tile(anc_ptr, sa_t, tok, ok, k * BI, BI)
        acc += _masked_row_sum(m, _node_dt(dt_ptr, sdt_t, sdt_h, start, n, k * BI, h, bias, dt_lo, dt_hi, BI) * A)
    return acc


@triton.jit
def _decay(m, dacs_rows, dacs_cols):
    """(BI, BI) fp32: exp(dAcs_i - dAcs_j) where column j is an ancestor-or-self of row i, else 0.
    The exponent is clamped at 0 (exact for ancestors) and non-ancestors are selected away, never
    multiplied, so their possibly huge exponents cannot make inf * 0."""
    seg = (dacs_rows[:, None] - dacs_cols[None, :]).to(tl.float32)
    return tl.where(m, fast_exp(tl.minimum(seg, 0.0)), 0.0)


@triton.jit
def _cb_rows(ptr, rows, g, nn, mask, s_t, s_g, s_n, BI: tl.constexpr):
    """Group g's C or B at packed rows `rows` (R,) and d_state columns `nn` (BN,), masked (R, BN)
    -> (R, BN) in the dtype that `_cb_product` multiplies them in (R >= BI, the tile's rows).

    Tiles of 32 rows or more keep 2-byte activations as they are: the products are exact either way
    (as they are in tf32, whose mantissa holds theirs), and the tensor cores run bf16/fp16 at twice
    tf32's rate with no conversion first. One 32- to 128-node tree's scan then took 0.89-0.97x the
    time. 16-row tiles, which serving batches of small trees run, took up to 1.10x and stay in fp32
    (H100, BENCHMARKS.md twentieth round); so do fp32 activations and every interpreted kernel
    (whose bf16 dot is wrong)."""
    v = tl.load(ptr + rows[:, None] * s_t + g * s_g + nn[None, :] * s_n, mask=mask, other=0.0)
    if NATIVE_HALF_DOT and v.dtype != tl.float32 and BI >= 32:
        return v
    else:
        return v.to(tl.float32)


@triton.jit
def _cb_product(c, b, acc, PREC: tl.constexpr):
    """acc (BI, BJ) fp32 + C_i . B_j of rows c (BI, BN) and b (BJ, BN) from `_cb_rows`."""
    if c.dtype == tl.float32:
        return tl.dot(c, tl.trans(b), acc, input_precision=PREC)
    else:
        return tl.dot(c, tl.trans(b), acc)


# How `_diagonal_block` gets the committed state of a one-tile tree: read by the caller before the
# PDL wait (whole d_state), read here (in d_state chunks, or whole), or not at all (taller trees
# fetch it after their lower blocks, to keep registers free).
STATE_GIVEN, STATE_LOADED, STATE_LATER = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _diagonal_block(x_ptr, dt_ptr, B_ptr, C_ptr, D_ptr, z_ptr, anc_ptr, st, h0_whole,
                    start, n, row0, rt, h, g, A, bias, dt_lo, dt_hi, offs_p, p_ok,
                    sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n, ss_p, ss_n, sz_t, sz_h, sz_p,
                    sa_t, N: tl.constexpr, ROW_TILES: tl.constexpr, BI: tl.constexpr, BP: tl.constexpr,
                    BN: tl.constexpr, STATE: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                    PREC: tl.constexpr):
    """Row tile `rt` (rows row0 .. row0 + BI) of one tree, one head and headdim tile: its diagonal
    block, and for one-tile trees the committed-state term. `st` points at the head's state (P, N)
    in its slot. Returns (acc (BI, BP) fp32: the diagonal block's y plus the D skip, ch (BI, BP):
    C_i . h0 (zeros with STATE_LATER), dacs_i (BI,) fp64 path sums, z_rows (BI, BP) fp32 (x_rows
    without HAS_Z), tok_i (BI,) packed rows, row_ok (BI,), io_mask (BI, BP))."""
    offs_i = row0 + tl.arange(0, BI)
    row_ok = offs_i < n
    tok_i = start + offs_i  # int32 offsets: packed activations stay far below 2**31 elements
    offs_n = tl.arange(0, BN)

    # Every input of the diagonal block is loaded before any arithmetic, so that the loads can
    # overlap: at small batches the kernel's time is its chain of dependent memory round trips, not
    # bandwidth. (The compiler still stages C, B and h0 into shared memory one after the other;
    # asynchronous copies, which do not, were no faster at 64 nodes: BENCHMARKS.md fifth round.)
    # C_i . B_j of the diagonal block (its columns are this tile's own nodes) and, for one-tile trees,
    # the committed-state term C_i . h0 share one pass over d_state.
    io_mask = row_ok[:, None] & p_ok[None, :]
    x_rows = tl.load(x_ptr + tok_i[:, None] * sx_t + h * sx_h + offs_p[None, :] * sx_p,
                     mask=io_mask, other=0.0).to(tl.float32)
    if HAS_Z:
        z_rows = tl.load(z_ptr + tok_i[:, None] * sz_t + h * sz_h + offs_p[None, :] * sz_p,
                         mask=io_mask, other=0.0).to(tl.float32)
    else:
        z_rows = x_rows
    # the diagonal block's columns are the rows themselves: its ancestor tile and dt serve both the
    # path sums and the diagonal decay. dt is activated after the d_state pass is issued: its
    # reduction would otherwise hold back the loads behind it.
    dt_raw, dt_ok = _node_dt_raw(dt_ptr, sdt_t, sdt_h, start, n, row0, h, BI)
    m_diag = _ancestor_tile(anc_ptr, sa_t, tok_i, row_ok, row0, BI)
    ch = tl.zeros([BI, BP], dtype=tl.float32)
    cb_diag = tl.zeros([BI, BI], dtype=tl.float32)
    for n0 in tl.static_range(0, N, BN):
        nn = n0 + offs_n
        n_ok = nn < N
        c = _cb_rows(C_ptr, tok_i, g, nn, row_ok[:, None] & n_ok[None, :], sc_t, sc_g, sc_n, BI)
        b = _cb_rows(B_ptr, tok_i, g, nn, row_ok[:, None] & n_ok[None, :], sb_t, sb_g, sb_n, BI)
        if STATE == STATE_GIVEN:
            ch += tl.dot(c.to(tl.float32), tl.trans(h0_whole), input_precision=PREC)
        elif STATE == STATE_LOADED:
            h0 = tl.load(st + offs_p[:, None] * ss_p + nn[None, :] * ss_n,
                         mask=p_ok[:, None] & n_ok[None, :], other=0.0)
            ch += tl.dot(c.to(tl.float32), tl.trans(h0), input_precision=PREC)
        cb_diag = _cb_product(c, b, cb_diag, PREC)
    dt_i = _activated(dt_raw, dt_ok, bias, dt_lo, dt_hi)

    dacs_i = _masked_row_sum(m_diag, dt_i * A)
    if ROW_TILES > 1:
        dacs_i += _path_sums(anc_ptr, sa_t, dt_ptr, sdt_t, sdt_h, start, n, tok_i, row_ok, rt, h, bias, A,
                             dt_lo, dt_hi, BI)
    decay = _decay(m_diag, dacs_i, dacs_i)
    acc = tl.dot(decay * cb_diag, x_rows * dt_i[:, None], input_precision=PREC)
    if HAS_D:  # added now so x_rows need not stay live
        acc += tl.load(D_ptr + h).to(tl.float32) * x_rows
    return acc, ch, dacs_i, z_rows, tok_i, row_ok, io_mask


@triton.jit
def _store_rows(acc, ch, dacs_i, z_rows, io_mask, tok_i, row_ok, h, pt, offs_p, p_ok, x_ptr, y_ptr, sy_t, sy_h, sy_p,
                nw_ptr, part_ptr, s_part, P: tl.constexpr, BP: tl.constexpr, HAS_Z: tl.constexpr,
                DEFER_NORM: tl.constexpr):
    """Store a tile's scan output y = acc + exp(dacs_i) * ch (BI, BP) fp32 (the rows' own terms and
    their committed-state term, as `_diagonal_block` and the blocks below it leave them): gated
    (HAS_Z), or with DEFER_NORM rounded to x's dtype, gated, stored as w * gated in y's dtype, with
    each row's sum of gated squares at column h * N_PT + pt of part_ptr."""
    y = acc + fast_exp(tl.minimum(dacs_i.to(tl.float32), 0.0))[:, None] * ch
    if DEFER_NORM:
        # rounded where the unfused path rounds: the scan's output in x's dtype, the gated value in
        # the output's, then the product with the weight
        gated = tl.where(io_mask, y.to(x_ptr.dtype.element_ty).to(tl.float32) * silu(z_rows), 0.0)
        w = tl.load(nw_ptr + h * P + offs_p, mask=p_ok, other=0.0).to(tl.float32)
        y = w[None, :] * gated.to(y_ptr.dtype.element_ty).to(tl.float32)
        N_PT: tl.constexpr = (P + BP - 1) // BP
        tl.store(part_ptr + tok_i * s_part + h * N_PT + pt, tl.sum(gated * gated, axis=1), mask=row_ok)
    elif HAS_Z:
        y *= silu(z_rows)
    tl.store(y_ptr + tok_i[:, None] * sy_t + h * sy_h + offs_p[None, :] * sy_p,
             y.to(y_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _tree_ssd_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, state_ptr, z_ptr, y_ptr,
    anc_ptr, cu_ptr, slot_ptr, nw_ptr, part_ptr,
    heads_per_group, dt_lo, dt_hi,
    sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n,
    ss_s, ss_h, ss_p, ss_n, sz_t, sz_h, sz_p, sy_t, sy_h, sy_p, sa_t, s_part,
    P: tl.constexpr, N: tl.constexpr,
    ROW_TILES: tl.constexpr, BI: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    STATE: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, DEFER_NORM: tl.constexpr, PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (tree x row tile, head, headdim tile); rows are this tile's nodes. STATE:
    how the committed state is read (STATE_GIVEN: one-tile trees with d_state whole, before the PDL
    wait; STATE_LOADED: one-tile trees, in chunks; STATE_LATER: taller trees). Outputs as
    `_store_rows` writes them."""
    release_next(PDL)
    pid0 = tl.program_id(0)
    tree = pid0 // ROW_TILES
    rt = pid0 % ROW_TILES
    h = tl.program_id(1)
    pt = tl.program_id(2)
    offs_p = pt * BP + tl.arange(0, BP)
    p_ok = offs_p < P
    offs_n = tl.arange(0, BN)
    # The slot index is one of the step's tree tables, which no kernel of the step writes
    # (kernels/pdl.py): read before the wait, once.
    st = state_ptr + tl.load(slot_ptr + tree).to(tl.int64) * ss_s + h * ss_h
    if STATE == STATE_GIVEN:
        # A one-tile tree reads its committed state in one piece. Nothing in a verify step writes the
        # state pool (commits come after), so under PDL the read, the bulk of the scan's bytes at
        # small trees, runs while the kernel before finishes, as the fused decode step's does.
        h0_whole = tl.load(st + offs_p[:, None] * ss_p + offs_n[None, :] * ss_n,
                           mask=p_ok[:, None] & (offs_n < N)[None, :], other=0.0)
    else:
        h0_whole = 0.0  # not read
    wait_for_previous(PDL)  # every input below but the state may come from the kernel before
    start = tl.load(cu_ptr + tree)
    n = tl.load(cu_ptr + tree + 1) - start
    row0 = rt * BI
    if row0 >= n:
        return
    g = h // heads_per_group
    A = tl.load(A_ptr + h).to(tl.float32)
    bias = tl.load(bias_ptr + h).to(tl.float32)

    acc, ch, dacs_i, z_rows, tok_i, row_ok, io_mask = _diagonal_block(
        x_ptr, dt_ptr, B_ptr, C_ptr, D_ptr, z_ptr, anc_ptr, st, h0_whole,
        start, n, row0, rt, h, g, A, bias, dt_lo, dt_hi, offs_p, p_ok,
        sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n, ss_p, ss_n, sz_t, sz_h, sz_p, sa_t,
        N, ROW_TILES, BI, BP, BN, STATE, HAS_D, HAS_Z, PREC)

    for k in range(0, rt):  # blocks below the diagonal (trees taller than one tile)
        j0 = k * BI
        tok_j = start + j0 + tl.arange(0, BI)  # always inside the tree: j0 + BI <= row0 < n
        col_ok = j0 + tl.arange(0, BI) < n
        dacs_j = _path_sums(anc_ptr, sa_t, dt_ptr, sdt_t, sdt_h, start, n, tok_j, col_ok, k + 1, h, bias, A,
                            dt_lo, dt_hi, BI)
        decay = _decay(_ancestor_tile(anc_ptr, sa_t, tok_i, row_ok, j0, BI), dacs_i, dacs_j)
        cb = tl.zeros([BI, BI], dtype=tl.float32)
        for n0 in tl.static_range(0, N, BN):
            nn = n0 + offs_n
            n_ok = nn < N
            c = _cb_rows(C_ptr, tok_i, g, nn, row_ok[:, None] & n_ok[None, :], sc_t, sc_g, sc_n, BI)
            b = _cb_rows(B_ptr, tok_j, g, nn, n_ok[None, :], sb_t, sb_g, sb_n, BI)
            cb = _cb_product(c, b, cb, PREC)
        xj = tl.load(x_ptr + tok_j[:, None] * sx_t + h * sx_h + offs_p[None, :] * sx_p,
                     mask=p_ok[None, :], other=0.0).to(tl.float32)
        dt_j = _node_dt(dt_ptr, sdt_t, sdt_h, start, n, j0, h, bias, dt_lo, dt_hi, BI)
        acc += tl.dot(decay * cb, xj * dt_j[:, None], input_precision=PREC)

    if ROW_TILES > 1:
        for n0 in tl.static_range(0, N, BN):
            nn = n0 + offs_n
            n_ok = nn < N
            c = _cb_rows(C_ptr, tok_i, g, nn, row_ok[:, None] & n_ok[None, :], sc_t, sc_g, sc_n, BI)
            h0 = tl.load(st + offs_p[:, None] * ss_p + nn[None, :] * ss_n,
                         mask=p_ok[:, None] & n_ok[None, :], other=0.0)
            ch += tl.dot(c.to(tl.float32), tl.trans(h0), input_precision=PREC)
    _store_rows(acc, ch, dacs_i, z_rows, io_mask, tok_i, row_ok, h, pt, offs_p, p_ok, x_ptr, y_ptr, sy_t, sy_h, sy_p,
                nw_ptr, part_ptr, s_part, P, BP, HAS_Z, DEFER_NORM)


@triton.jit
def _tree_ssd_persistent_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, state_ptr, z_ptr, y_ptr,
    anc_ptr, cu_ptr, slot_ptr, nw_ptr, part_ptr,
    heads_per_group, dt_lo, dt_hi, n_items, n_programs, H,
    sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n,
    ss_s, ss_h, ss_p, ss_n, sz_t, sz_h, sz_p, sy_t, sy_h, sy_p, sa_t, s_part,
    P: tl.constexpr, N: tl.constexpr, BI: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, DEFER_NORM: tl.constexpr, PREC: tl.constexpr,
    STAGES: tl.constexpr, PDL: tl.constexpr,
):
    """The scan of one-tile trees at serving batches: `n_programs` programs take the (tree, head,
    headdim tile) items in turn, item = tree * H * N_PT + h * N_PT + pt, so that the compiler's
    software pipeline (STAGES deep) fetches the next item's rows and state while this item's
    products run. Same arithmetic and outputs as `_tree_ssd_kernel` with ROW_TILES == 1."""
    release_next(PDL)
    wait_for_previous(PDL)
    N_PT: tl.constexpr = (P + BP - 1) // BP
    for item in tl.range(tl.program_id(0), n_items, n_programs, num_stages=STAGES):
        pt = item % N_PT
        h = (item // N_PT) % H
        tree = item // (N_PT * H)
        offs_p = pt * BP + tl.arange(0, BP)
        p_ok = offs_p < P
        start = tl.load(cu_ptr + tree)
        n = tl.load(cu_ptr + tree + 1) - start
        slot = tl.load(slot_ptr + tree).to(tl.int64)
        acc, ch, dacs_i, z_rows, tok_i, row_ok, io_mask = _diagonal_block(
            x_ptr, dt_ptr, B_ptr, C_ptr, D_ptr, z_ptr, anc_ptr, state_ptr + slot * ss_s + h * ss_h, 0.0,
            start, n, 0, 0, h, h // heads_per_group, tl.load(A_ptr + h).to(tl.float32),
            tl.load(bias_ptr + h).to(tl.float32), dt_lo, dt_hi, offs_p, p_ok,
            sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n, ss_p, ss_n, sz_t, sz_h, sz_p, sa_t,
            N, 1, BI, BP, BN, STATE_LOADED, HAS_D, HAS_Z, PREC)
        _store_rows(acc, ch, dacs_i, z_rows, io_mask, tok_i, row_ok, h, pt, offs_p, p_ok, x_ptr, y_ptr, sy_t, sy_h,
                    sy_p, nw_ptr, part_ptr, s_part, P, BP, HAS_Z, DEFER_NORM)


def tree_ssd_scan_deferred_norm(x, dt, A, B, C, D, dt_bias, ssm_state, parents, cu_seqlens, slot_idx, max_nodes,
                                dt_limit, z, norm_weight, norm_eps: float, ancestors=None, *,
                                programs_per_sm: int | None = None):
    """Triton `tree_ssd_scan_deferred_norm`: same contract as its `_ref` twin -> (u (T, H * P) in the
    promoted dtype of norm_weight and z, SumOfSquares with one partial sum per headdim tile of a node).
    `programs_per_sm`: the launch, as for `tree_ssd_scan` (benchmarks)."""
    T, H, P = x.shape
    if z is None or z.shape != x.shape or norm_weight.shape != (H * P,):
        raise ValueError(f"the deferred norm needs z {tuple(x.shape)} and a norm weight ({H * P},)")
    out_dtype = torch.promote_types(norm_weight.dtype, z.dtype)
    return _launch(x, dt, A, B, C, D, dt_bias, ssm_state, parents, cu_seqlens, slot_idx, max_nodes, dt_limit, z,
                   ancestors, out_dtype=out_dtype, norm=(norm_weight.contiguous(), float(norm_eps)),
                   programs_per_sm=programs_per_sm)


def tree_ssd_scan(x, dt, A, B, C, D, dt_bias, ssm_state, parents, cu_seqlens, slot_idx, max_nodes, dt_limit, z=None,
                  ancestors=None, *, block_p: int | None = None, block_n: int | None = None,
                  num_warps: int | None = None, maxnreg: int | None = None, programs_per_sm: int | None = None):
    """Triton `tree_ssd_scan`: same contract as `tree_ssd_scan_ref`; `ssm_state` is only read.

    `ancestors` (T, W) int32 is `tree_struct.ancestor_bits(parents, cu_seqlens, max_nodes)`, built once
    per forward and shared by every layer; when None it is built here (one extra launch).
    Keyword-only tuning knobs (benchmarks): `block_p` headdim columns per program (power of two >= 16),
    `block_n` d_state columns per load round (power of two >= 32), `num_warps`, `maxnreg` register
    cap per thread (None or 0: none), `programs_per_sm` 0 for one program per tile, k > 0 for the
    persistent launch with k programs per SM (one-tile trees only); None picks the defaults below.
    """
    return _launch(x, dt, A, B, C, D, dt_bias, ssm_state, parents, cu_seqlens, slot_idx, max_nodes, dt_limit, z,
                   ancestors, block_p=block_p, block_n=block_n, num_warps=num_warps, maxnreg=maxnreg,
                   programs_per_sm=programs_per_sm)


def _launch(x, dt, A, B, C, D, dt_bias, ssm_state, parents, cu_seqlens, slot_idx, max_nodes, dt_limit, z, ancestors,
            *, out_dtype=None, norm=None, block_p=None, block_n=None, num_warps=None, maxnreg=None,
            programs_per_sm=None):
    """The scan's launch: -> y (T, H, P), or with `norm` = (weight, eps) -> (u (T, H * P) of `out_dtype`,
    SumOfSquares)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    hpg = heads_per_group(H, G)
    y = ssm_common.new_output((T, H, P), out_dtype or x.dtype, x.device)
    nb = cu_seqlens.numel() - 1
    if T == 0 or nb == 0:
        return y if norm is None else (y.view(T, H * P), SumOfSquares(torch.zeros(T, 1, device=x.device), H * P,
                                                                      norm[1]))
    if ancestors is None:
        ancestors = ancestor_bits(parents, cu_seqlens, max_nodes)
    elif (ancestors.shape != (T, words_per_row(max_nodes)) or ancestors.dtype != torch.int32
          or ancestors.stride(1) != 1):
        raise ValueError(f"ancestors must be ({T}, {words_per_row(max_nodes)}) int32 with contiguous rows, got "
                         f"{tuple(ancestors.shape)} {ancestors.dtype}")
    lo, hi = limits(dt_limit)
    bn = block_nodes(max_nodes)
    bi = min(bn, MAX_TILE)
    # Tiles are at least 32 wide (masked past P and N): with 16-wide headdim/d_state tiles and 64-node
    # trees, triton 3.6 compiled a scan that read shared memory out of bounds on sm_90
    # (compute-sanitizer); real layers have P, N >= 32 and are unaffected.
    bp = block_p or max(32, min(64, pow2(P)))
    items = nb * (bn // bi) * H * triton.cdiv(P, bp)  # (tree x row tile, head, headdim tile) programs
    if programs_per_sm is None:
        programs_per_sm = persistent_programs_per_sm(bn, items, _sm_count(x.device))
    if programs_per_sm and bn != bi:
        raise ValueError(f"the persistent scan takes one-tile trees (at most {MAX_TILE} nodes), not {max_nodes}")
    if not programs_per_sm and block_p is None and bp > 32 and bn == bi and items < 2 * _sm_count(x.device):
        # small batches of one-tile trees: split headdim so more SMs share the state read. Taller
        # trees keep whole heads: a split repeats every lower block's path sums and decay tile in
        # both halves, and at 128 nodes whole heads ran in 0.64-0.74x the time (H200 sweep,
        # bench.ssm_kernels, both layer shapes)
        bp = 32
    if num_warps is None:
        # One warpgroup per program, at every tree size and batch: after the loads were gathered into
        # one round, 4 warps were the fastest or within 4% of it at 16/64/128 nodes, batch 1 and 16,
        # both layer shapes (H200 sweep, BENCHMARKS.md fifth round); 8 warps cost up to 1.5x at batch 16.
        num_warps = 4
    if programs_per_sm:  # d_state whole: one round of loads per item, pipelined across items
        block_n = block_n or max(32, pow2(N))
    else:
        block_n = block_n or max(32, pow2(N) if bn == bi and bp <= 32 else min(N_CHUNK, pow2(N)))  # see N_CHUNK
    D_arg = D if D is not None else A
    bias = dt_bias if dt_bias is not None else torch.zeros_like(A)
    zt = z if z is not None else x
    # every node's row of partial sums is written (one column per (head, headdim tile) program);
    # rows past the last tree, if any, are not, and no real row reads them
    parts = ssm_common.new_output((T, H * triton.cdiv(P, bp)), torch.float32, x.device) if norm else A
    operands = (x, dt, A, B, C, D_arg, bias, ssm_state, zt, y,
                ancestors, as_int32(cu_seqlens), as_int32(slot_idx), norm[0] if norm else A, parts)
    strides = (*x.stride(), *dt.stride(), *B.stride(), *C.stride(),
               *ssm_state.stride(), *zt.stride(), *y.stride(), ancestors.stride(0), parts.stride(0))
    shared = dict(P=P, N=N, BI=bi, BP=bp, BN=block_n, HAS_D=D is not None, HAS_Z=z is not None,
                  DEFER_NORM=norm is not None, PREC=dot_precision(x.dtype), **pdl.launch_options(x.device),
                  num_warps=num_warps, maxnreg=maxnreg or None)  # no register cap unless asked: it never won
    if programs_per_sm:  # bp is as `items` counted it: only the one-tile launch splits headdim
        programs = min(items, programs_per_sm * _sm_count(x.device))
        _tree_ssd_persistent_kernel[(programs,)](
            *operands, hpg, lo, hi, items, programs, H, *strides,
            STAGES=PERSISTENT_STAGES, num_stages=PERSISTENT_STAGES, **shared)
    else:
        _tree_ssd_kernel[(nb * (bn // bi), H, triton.cdiv(P, bp))](
            *operands, hpg, lo, hi, *strides, ROW_TILES=bn // bi,
            STATE=STATE_LATER.value if bn > bi else STATE_GIVEN.value if block_n >= N else STATE_LOADED.value,
            num_stages=1, **shared)
    return y if norm is None else (y.view(T, H * P), SumOfSquares(parts, H * P, norm[1]))


# Serving batches of small trees: each program of the one-tile launch loads its rows and state, then
# computes, so an SM's memory traffic stops while its few resident programs compute. The persistent
# launch keeps PERSISTENT_PROGRAMS_PER_SM programs per SM that take items in turn, with the next
# item's loads pipelined under this one's products. On an H100 (BENCHMARKS.md, eighteenth round), at
# 64 sequences of 16-node trees, it ran the scan in 0.83-0.89x the one-tile launch's time (1.27-1.49x
# its floor, against 1.47-1.78x) and took 1.0-1.6 ms off the 2.7B verifier's forward; at 16 and 32
# sequences the forward did not change, at 4 it was 0.1 ms longer, and 64-node tiles ran 1.2-1.9x
# slower. 2 or 4 programs per SM gained nothing at 64 sequences. Below PERSISTENT_MIN_ITEMS_PER_SM
# items per SM the one-tile launch stays, which at one tree also reads the state before the PDL wait.
PERSISTENT_MAX_TILE = 16
PERSISTENT_PROGRAMS_PER_SM = 3
PERSISTENT_STAGES = 2
PERSISTENT_MIN_ITEMS_PER_SM = 8  # the 2.7B from 14 sequences on, the 8B's Mamba2 layers from 17


def persistent_programs_per_sm(tree_tile: int, items: int, sms: int) -> int:
    """Programs per SM of the persistent scan for trees padded to `tree_tile` rows, with `items`
    (tree, head, headdim tile) items of work on `sms` SMs; 0: the one-program-per-tile launch."""
    if tree_tile <= PERSISTENT_MAX_TILE and items >= PERSISTENT_MIN_ITEMS_PER_SM * sms:
        return PERSISTENT_PROGRAMS_PER_SM
    return 0


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
