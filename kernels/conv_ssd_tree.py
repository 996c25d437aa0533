"""A Mamba2 layer's verify pass between its projections, as one launch: tree conv + SiLU, the tree
SSD scan, and the commit stash.

Verification used three launches here: `conv_tree.tree_conv1d` over xBC, `ssd_tree.tree_ssd_scan`
over its output, and `copy_rows.copy_rows_pair` to keep what a commit needs (the raw xBC | dt and
the conv output's x | B). At 16 nodes each is a few microseconds of dependent memory round trips,
paid in every Mamba2 layer. Here, for trees that fit one node tile (at most `MAX_TILE` nodes), the
scan's programs compute the conv themselves:

- every ancestor of a node lies in the node's own tile, so the raw rows the scan would load anyway
  hold every conv window; tap k of node i is the row of its k-th ancestor, the ancestor-or-self j
  with depth(j) = depth(i) - k. Depths are the popcounts of the ancestor bits' rows. Picking those
  rows is a product with a 0/1 selection tile (exact: one nonzero term per output);
- taps above the root come from the committed conv state, whose W-1 columns are loaded up front
  and selected per row by depth;
- the conv output is rounded to the activation dtype, as the separate conv's output is, so the
  scan sees the same inputs.

All loads are issued before any arithmetic and none depends on another. Each program writes the
stash columns it read or computed: its head's raw x, conv x and raw dt; the first program of each
group also that group's raw B and C and conv B. Taller trees take the three separate launches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl, ssm_common
from kernels.conv_tree import tree_conv1d, tree_conv1d_ref
from kernels.copy_rows import copy_rows_pair
from kernels.pdl import release_next, wait_for_previous
from kernels.ssd_tree import (
    MAX_TILE,
    _activated,
    _ancestor_tile,
    _decay,
    _masked_row_sum,
    _node_dt_raw,
    _sm_count,
    tree_ssd_scan,
    tree_ssd_scan_ref,
)
from kernels.ssm_common import as_int32, dot_precision, heads_per_group, last_axis_contiguous, limits, pow2
from kernels.tree_index import block_nodes
from kernels.tree_struct import ancestor_bits, words_per_row


def _dims(xbc_dt, conv_weight, ssm_state):
    """(conv_dim, H, P, G, N) from the operands' shapes, checked."""
    conv_dim = conv_weight.shape[0]
    H = xbc_dt.shape[1] - conv_dim
    P, N = ssm_state.shape[2], ssm_state.shape[3]
    gn2 = conv_dim - H * P
    if H <= 0 or ssm_state.shape[1] != H or gn2 <= 0 or gn2 % (2 * N):
        raise ValueError(f"tree_conv_ssd_scan: xbc_dt {tuple(xbc_dt.shape)}, conv weight {tuple(conv_weight.shape)} "
                         f"and ssm_state {tuple(ssm_state.shape)} do not describe one Mamba2 layer")
    return conv_dim, H, P, gn2 // (2 * N), N


def tree_conv_ssd_scan_ref(xbc_dt, conv_weight, conv_bias, conv_state, A, D, dt_bias, ssm_state, parents,
                           cu_seqlens, slot_idx, max_nodes, dt_limit, stash_raw, stash_xB, ancestors=None):
    """PyTorch twin of `tree_conv_ssd_scan`: the separate reference conv and scan, then the stash.

    xbc_dt (T, conv_dim + H): in_proj's raw xBC | dt columns; conv_weight (conv_dim, W), conv_bias
    (conv_dim,) or None, conv_state (S, conv_dim, W-1); A (H,) fp32 negative, D (H,) or None, dt_bias
    (H,) or None, ssm_state (S, H, P, N) fp32; parents (T,) local, cu_seqlens (B+1,), slot_idx (B,);
    ancestors (T, words) int32 from `tree_struct.ancestor_bits` or None. Writes stash_raw
    (T, conv_dim + H) <- xbc_dt and stash_xB (T, H*P + G*N) <- the conv output's x | B columns.
    -> y (T, H, P) in xbc_dt.dtype, ungated (the gated norm follows). Both state pools are only read.
    """
    conv_dim, H, P, G, N = _dims(xbc_dt, conv_weight, ssm_state)
    T = xbc_dt.shape[0]
    xbc, dt = xbc_dt[:, :conv_dim], xbc_dt[:, conv_dim:]
    conv_out = tree_conv1d_ref(xbc, conv_weight, conv_bias, conv_state, parents, cu_seqlens, slot_idx, max_nodes)
    x, B, C = conv_out.split([H * P, G * N, G * N], dim=-1)
    y = tree_ssd_scan_ref(x.reshape(T, H, P), dt, A, B.reshape(T, G, N), C.reshape(T, G, N), D, dt_bias, ssm_state,
                          parents, cu_seqlens, slot_idx, max_nodes, dt_limit, ancestors=ancestors)
    stash_raw.copy_(xbc_dt)
    stash_xB.copy_(conv_out[:, : H * P + G * N])
    return y


@triton.jit
def _conv_taps(st_ptr, w_ptr, cb_ptr, chan, ok, s_cs_d, s_w, W: tl.constexpr, HAS_CBIAS: tl.constexpr):
    """The conv's per-channel operands for channels `chan` ((BC,), masked by `ok`): the committed
    state's columns s0, s1, s2 (oldest first; zeros past W-1), the weights w0..w3 (w[W-1] multiplies
    the node itself; zeros past W) and the bias, all fp32 (BC,). Read-only: weights and the state."""
    s0 = tl.load(st_ptr + chan * s_cs_d + 0, mask=ok & (W > 1), other=0.0).to(tl.float32)
    s1 = tl.load(st_ptr + chan * s_cs_d + 1, mask=ok & (W > 2), other=0.0).to(tl.float32)
    s2 = tl.load(st_ptr + chan * s_cs_d + 2, mask=ok & (W > 3), other=0.0).to(tl.float32)
    w0 = tl.load(w_ptr + chan * s_w + 0, mask=ok, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + chan * s_w + 1, mask=ok & (W > 1), other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + chan * s_w + 2, mask=ok & (W > 2), other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + chan * s_w + 3, mask=ok & (W > 3), other=0.0).to(tl.float32)
    if HAS_CBIAS:
        bias = tl.load(cb_ptr + chan, mask=ok, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros_like(w0)
    return s0, s1, s2, w0, w1, w2, w3, bias


@triton.jit
def _pick(w0, w1, w2, w3, j: tl.constexpr):
    """w_j of four values, j a compile-time index."""
    if j == 0:
        return w0
    elif j == 1:
        return w1
    elif j == 2:
        return w2
    else:
        return w3


@triton.jit
def _tree_conv_tile(raw, m, depth, row_ok, s0, s1, s2, w0, w1, w2, w3, bias, out_ty: tl.constexpr,
                    W: tl.constexpr, PREC: tl.constexpr):
    """(BI, BC) SiLU(tree conv) of one tile of channels, rounded to `out_ty` and back to fp32.

    raw (BI, BC) fp32: the tile's own rows' raw inputs; m (BI, BI) ancestor-or-self tile of those
    rows; depth (BI,) their depths (-1 past the tree). Accumulates tap by tap, the node itself
    first, as `conv_tree` does."""
    acc = raw * _pick(w0, w1, w2, w3, W - 1)[None, :]
    for k in tl.static_range(1, W):
        # the k-th ancestor's row: exactly one 1 in row i of sel when depth(i) >= k, none otherwise
        sel = tl.where(m & ((depth[:, None] - depth[None, :]) == k), 1.0, 0.0)
        val = tl.dot(sel, raw, input_precision=PREC)
        # above the root: state column W-1-k+depth(i) (in 0..W-2 exactly when depth(i) < k)
        col = (W - 1 - k + depth)[:, None]
        val += tl.where(col == 0, s0[None, :], 0.0) + tl.where(col == 1, s1[None, :], 0.0) \
            + tl.where(col == 2, s2[None, :], 0.0)
        acc += val * _pick(w0, w1, w2, w3, W - 1 - k)[None, :]
    acc += bias[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    return tl.where(row_ok[:, None], y.to(out_ty).to(tl.float32), 0.0)


@triton.jit
def _tree_conv_ssd_kernel(
    xbc_ptr, dt_ptr, w_ptr, cb_ptr, cs_ptr, A_ptr, D_ptr, bias_ptr, state_ptr, y_ptr, kraw_ptr, kxb_ptr,
    anc_ptr, cu_ptr, slot_ptr,
    heads_per_group, dt_lo, dt_hi, conv_dim, d_inner, GN,
    s_xt, s_dt, s_w, s_cs_s, s_cs_d, ss_s, ss_h, ss_p, ss_n, sy_t, sy_h, s_kraw, s_kxb, sa_t,
    P: tl.constexpr, N: tl.constexpr, W: tl.constexpr,
    BI: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_D: tl.constexpr, HAS_CBIAS: tl.constexpr, PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (tree, head, headdim tile); rows are the tree's nodes (one tile holds it)."""
    release_next(PDL)
    wait_for_previous(PDL)  # the raw inputs come from the kernel before
    tree = tl.program_id(0)
    h = tl.program_id(1)
    pt = tl.program_id(2)
    start = tl.load(cu_ptr + tree)
    n = tl.load(cu_ptr + tree + 1) - start
    g = h // heads_per_group
    slot = tl.load(slot_ptr + tree).to(tl.int64)
    A = tl.load(A_ptr + h).to(tl.float32)
    bias = tl.load(bias_ptr + h).to(tl.float32)
    out_ty = y_ptr.dtype.element_ty
    # the first program of each group writes the group's B and C columns of the stash
    group_writer = (h % heads_per_group == 0) & (pt == 0)

    offs_i = tl.arange(0, BI)
    row_ok = offs_i < n
    tok = start + offs_i
    offs_p = pt * BP + tl.arange(0, BP)
    p_ok = offs_p < P
    io_mask = row_ok[:, None] & p_ok[None, :]
    offs_n = tl.arange(0, BN)
    cs = cs_ptr + slot * s_cs_s
    st = state_ptr + slot * ss_s + h * ss_h

    # every load first (scan inputs, conv operands, ancestor tile); none depends on another
    cx = h * P + offs_p
    x_raw = tl.load(xbc_ptr + tok[:, None] * s_xt + cx[None, :], mask=io_mask, other=0.0)
    xs0, xs1, xs2, xw0, xw1, xw2, xw3, xcb = _conv_taps(cs, w_ptr, cb_ptr, cx, p_ok, s_cs_d, s_w, W, HAS_CBIAS)
    dt_raw, dt_ok = _node_dt_raw(dt_ptr, s_dt, 1, start, n, 0, h, BI)
    m = _ancestor_tile(anc_ptr, sa_t, tok, row_ok, 0, BI)
    depth = tl.sum(m.to(tl.int32), axis=1) - 1  # every ancestor is in this tile

    x = _tree_conv_tile(x_raw.to(tl.float32), m, depth, row_ok, xs0, xs1, xs2, xw0, xw1, xw2, xw3, xcb,
                        out_ty, W, PREC)
    tl.store(kraw_ptr + tok[:, None] * s_kraw + cx[None, :], x_raw, mask=io_mask)
    tl.store(kxb_ptr + tok[:, None] * s_kxb + cx[None, :], x.to(out_ty), mask=io_mask)
    tl.store(kraw_ptr + tok * s_kraw + conv_dim + h, dt_raw, mask=row_ok & (pt == 0))

    ch = tl.zeros([BI, BP], dtype=tl.float32)
    cb_diag = tl.zeros([BI, BI], dtype=tl.float32)
    for n0 in tl.static_range(0, N, BN):
        nn = n0 + offs_n
        n_ok = nn < N
        cB = d_inner + g * N + nn
        cC = cB + GN
        tile_mask = row_ok[:, None] & n_ok[None, :]
        b_raw = tl.load(xbc_ptr + tok[:, None] * s_xt + cB[None, :], mask=tile_mask, other=0.0)
        c_raw = tl.load(xbc_ptr + tok[:, None] * s_xt + cC[None, :], mask=tile_mask, other=0.0)
        bs0, bs1, bs2, bw0, bw1, bw2, bw3, bcb = _conv_taps(cs, w_ptr, cb_ptr, cB, n_ok, s_cs_d, s_w, W, HAS_CBIAS)
        cs0, cs1, cs2, cw0, cw1, cw2, cw3, ccb = _conv_taps(cs, w_ptr, cb_ptr, cC, n_ok, s_cs_d, s_w, W, HAS_CBIAS)
        h0 = tl.load(st + offs_p[:, None] * ss_p + nn[None, :] * ss_n, mask=p_ok[:, None] & n_ok[None, :], other=0.0)
        b = _tree_conv_tile(b_raw.to(tl.float32), m, depth, row_ok, bs0, bs1, bs2, bw0, bw1, bw2, bw3, bcb,
                            out_ty, W, PREC)
        c = _tree_conv_tile(c_raw.to(tl.float32), m, depth, row_ok, cs0, cs1, cs2, cw0, cw1, cw2, cw3, ccb,
                            out_ty, W, PREC)
        ch += tl.dot(c, tl.trans(h0), input_precision=PREC)
        cb_diag += tl.dot(c, tl.trans(b), input_precision=PREC)
        keep = tile_mask & group_writer
        tl.store(kraw_ptr + tok[:, None] * s_kraw + cB[None, :], b_raw, mask=keep)
        tl.store(kraw_ptr + tok[:, None] * s_kraw + cC[None, :], c_raw, mask=keep)
        tl.store(kxb_ptr + tok[:, None] * s_kxb + cB[None, :], b.to(out_ty), mask=keep)

    # the scan of `ssd_tree` for a one-tile tree, on the conv's output
    dt_i = _activated(dt_raw, dt_ok, bias, dt_lo, dt_hi)
    dacs_i = _masked_row_sum(m, dt_i * A)
    decay = _decay(m, dacs_i, dacs_i)
    acc = tl.dot(decay * cb_diag, x * dt_i[:, None], input_precision=PREC)
    if HAS_D:
        acc += tl.load(D_ptr + h).to(tl.float32) * x
    y = acc + tl.exp(tl.minimum(dacs_i.to(tl.float32), 0.0))[:, None] * ch
    tl.store(y_ptr + tok[:, None] * sy_t + h * sy_h + offs_p[None, :], y.to(out_ty), mask=io_mask)


# Largest tree the one launch takes. The kernel is correct for any one-tile tree (up to MAX_TILE
# nodes); past 16 nodes its tiles no longer fit in registers on sm_90 and it spills.
FUSED_MAX_NODES = 16


def fuses(max_nodes: int) -> bool:
    """Whether trees of up to `max_nodes` nodes take the one-launch kernel."""
    return block_nodes(max_nodes) <= min(FUSED_MAX_NODES, MAX_TILE)


def tree_conv_ssd_scan(xbc_dt, conv_weight, conv_bias, conv_state, A, D, dt_bias, ssm_state, parents, cu_seqlens,
                       slot_idx, max_nodes, dt_limit, stash_raw, stash_xB, ancestors=None, *, block_n: int | None = None,
                       num_warps: int | None = None):
    """Triton `tree_conv_ssd_scan`: same contract as the twin. One launch when `fuses(max_nodes)`,
    else the separate conv, scan and stash copy. `ancestors` is built here when None.
    Keyword-only tuning knobs (benchmarks): `block_n` d_state columns per chunk, `num_warps`."""
    conv_dim, H, P, G, N = _dims(xbc_dt, conv_weight, ssm_state)
    T = xbc_dt.shape[0]
    W = conv_weight.shape[1]
    if not 1 <= W <= 4:
        raise ValueError(f"conv width {W} is not in 1..4")
    if stash_raw.shape != xbc_dt.shape or stash_xB.shape != (T, H * P + G * N):
        raise ValueError(f"stash buffers {tuple(stash_raw.shape)} and {tuple(stash_xB.shape)} do not fit "
                         f"{T} rows of this layer")
    xbc_dt = last_axis_contiguous(xbc_dt)
    xbc, dt = xbc_dt[:, :conv_dim], xbc_dt[:, conv_dim:]
    nb = cu_seqlens.numel() - 1
    if ancestors is None and T and nb:
        ancestors = ancestor_bits(parents, cu_seqlens, max_nodes)
    if not fuses(max_nodes):
        conv_out = tree_conv1d(xbc, conv_weight, conv_bias, conv_state, parents, cu_seqlens, slot_idx, max_nodes)
        x, B, C = conv_out.split([H * P, G * N, G * N], dim=-1)
        y = tree_ssd_scan(x.reshape(T, H, P), dt, A, B.reshape(T, G, N), C.reshape(T, G, N), D, dt_bias, ssm_state,
                          parents, cu_seqlens, slot_idx, max_nodes, dt_limit, ancestors=ancestors)
        copy_rows_pair(stash_raw, xbc_dt, stash_xB, conv_out[:, : H * P + G * N])
        return y
    y = ssm_common.new_output((T, H, P), xbc_dt.dtype, xbc_dt.device)
    if T == 0 or nb == 0:
        return y
    if ancestors.shape != (T, words_per_row(max_nodes)) or ancestors.dtype != torch.int32 or ancestors.stride(1) != 1:
        raise ValueError(f"ancestors must be ({T}, {words_per_row(max_nodes)}) int32 with contiguous rows")
    for name, t in (("stash_raw", stash_raw), ("stash_xB", stash_xB), ("conv_state", conv_state)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last axis")
    conv_weight = conv_weight.contiguous()
    bi = block_nodes(max_nodes)
    # headdim tiles as the scan takes them for one-tile trees: halves of a head when the grid
    # would otherwise leave most SMs idle
    bp = max(32, min(64, pow2(P)))
    if bp > 32 and nb * H * triton.cdiv(P, bp) < 2 * _sm_count(xbc_dt.device):
        bp = 32
    # d_state whole for small trees (one round of loads), in chunks of 64 for 64-node tiles,
    # whose raw and conv B and C tiles would not fit in registers otherwise
    block_n = block_n or max(32, pow2(N) if bi <= 32 else min(64, pow2(N)))
    lo, hi = limits(dt_limit)
    bias = dt_bias if dt_bias is not None else torch.zeros_like(A)
    _tree_conv_ssd_kernel[(nb, H, triton.cdiv(P, bp))](
        xbc, dt, conv_weight, conv_bias if conv_bias is not None else conv_weight, conv_state,
        A, D if D is not None else A, bias, ssm_state, y, stash_raw, stash_xB,
        ancestors, as_int32(cu_seqlens), as_int32(slot_idx),
        heads_per_group(H, G), lo, hi, conv_dim, H * P, G * N,
        xbc_dt.stride(0), xbc_dt.stride(0), conv_weight.stride(0), conv_state.stride(0), conv_state.stride(1),
        *ssm_state.stride(), y.stride(0), y.stride(1), stash_raw.stride(0), stash_xB.stride(0), ancestors.stride(0),
        P=P, N=N, W=W, BI=bi, BP=bp, BN=block_n,
        HAS_D=D is not None, HAS_CBIAS=conv_bias is not None, PREC=dot_precision(xbc_dt.dtype),
        **pdl.launch_options(xbc_dt.device),
        num_warps=num_warps or 8, num_stages=1,
    )
    return y
