"""Tree-masked SSD: every node of a packed batch of token trees through one Mamba2 layer's scan.

For node i with root-to-i path anc*(i), starting from the committed state h0 (design §4):

    y_i = sum_{j in anc*(i)} exp(sum of dA over the path after j) (C_i . B_j) dt_j x_j
          + exp(dAcs_i) C_i . h0 + D x_i                            (times silu(z_i) if z is given)

Per-node states are never formed. The state pool is only read.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import ssm_common
from kernels.ssm_common import (
    as_int32,
    dot_precision,
    dt_activation,
    expand_groups,
    heads_per_group,
    limits,
    pow2,
    silu,
    silu_gate,
    softplus_clamped,
)
from kernels.tree_index import ancestor_mask, block_nodes, tree_sizes


def tree_ssd_scan_ref(x, dt, A, B, C, D, dt_bias, ssm_state, parents, cu_seqlens, slot_idx, max_nodes, dt_limit,
                      z=None):
    """PyTorch twin of `tree_ssd_scan`.

    x (T, H, P), dt (T, H) raw, A (H,) fp32 negative, B/C (T, G, N), D (H,) or None, dt_bias (H,) or None,
    ssm_state (S, H, P, N) fp32, parents (T,) local, cu_seqlens (B+1,), slot_idx (B,), z (T, H, P) or None
    -> y (T, H, P) in x.dtype.
    """
    H = x.shape[1]
    n = int(max_nodes)
    sizes = tree_sizes(cu_seqlens)
    local = torch.arange(n, device=x.device)
    valid = local[None, :] < sizes[:, None]  # (Bt, n)
    rows = torch.where(valid, cu_seqlens[:-1].long()[:, None] + local[None, :], torch.zeros_like(local[None, :]))

    M = ancestor_mask(parents, cu_seqlens, n)  # (Bt, n, n)
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


# Node tiles are at most this tall: bigger trees are cut into row tiles x column blocks so the
# (rows x cols) decay/score tiles stay in registers.
MAX_TILE = 64
# d_state is swept in chunks of this many columns
N_CHUNK = 64


@triton.jit
def _walk_block(cur, s, j0, BI: tl.constexpr, start, parents_ptr, dt_ptr, sdt_t, sdt_h, h, bias, A, dt_lo, dt_hi):
    """Advance every row's ancestor walk through the column block [j0, j0 + BI).

    Returns the block's decay tile (exp of the path sum after column j for each ancestor j of row i,
    0 elsewhere) and the updated walk state; rows whose walk is already below j0 wait."""
    offs_j = j0 + tl.arange(0, BI)
    decay = tl.zeros([BI, BI], dtype=tl.float32)
    while tl.max(cur, axis=0) >= j0:
        hit = offs_j[None, :] == cur[:, None]
        decay = tl.where(hit, tl.exp(tl.minimum(s, 0.0))[:, None], decay)
        live = cur >= j0
        tok = start + tl.where(live, cur, 0)
        par = tl.load(parents_ptr + tok, mask=live, other=-1)
        dt = tl.load(dt_ptr + tok * sdt_t + h * sdt_h, mask=live, other=0.0).to(tl.float32)
        s += tl.where(live, softplus_clamped(dt + bias, dt_lo, dt_hi) * A, 0.0)
        cur = tl.where(live, par, cur)
    return decay, cur, s


@triton.jit
def _tree_ssd_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, state_ptr, z_ptr, y_ptr,
    parents_ptr, cu_ptr, slot_ptr,
    heads_per_group, dt_lo, dt_hi,
    sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n,
    ss_s, ss_h, ss_p, ss_n, sz_t, sz_h, sz_p, sy_t, sy_h, sy_p,
    P: tl.constexpr, N: tl.constexpr,
    ROW_TILES: tl.constexpr, BI: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (tree x row tile, head, headdim tile); rows are this tile's nodes."""
    pid0 = tl.program_id(0)
    tree = pid0 // ROW_TILES
    rt = pid0 % ROW_TILES
    h = tl.program_id(1)
    pt = tl.program_id(2)
    start = tl.load(cu_ptr + tree)
    n = tl.load(cu_ptr + tree + 1) - start
    row0 = rt * BI
    if row0 >= n:
        return
    g = h // heads_per_group
    slot = tl.load(slot_ptr + tree).to(tl.int64)
    A = tl.load(A_ptr + h).to(tl.float32)
    bias = tl.load(bias_ptr + h).to(tl.float32)

    offs_i = row0 + tl.arange(0, BI)
    row_ok = offs_i < n
    tok_i = start + offs_i  # int32 offsets: packed activations stay far below 2**31 elements
    offs_p = pt * BP + tl.arange(0, BP)
    p_ok = offs_p < P
    offs_n = tl.arange(0, BN)

    # C_i . B_j of the diagonal block (its columns are this tile's own nodes) and, for one-tile trees,
    # the committed-state term C_i . h0 in the same pass over d_state: it is the only sizeable memory
    # read, so it is issued first. Taller trees fetch it after the walk, to keep registers free.
    st = state_ptr + slot * ss_s + h * ss_h
    ch = tl.zeros([BI, BP], dtype=tl.float32)
    cb_diag = tl.zeros([BI, BI], dtype=tl.float32)
    for n0 in tl.static_range(0, N, BN):
        nn = n0 + offs_n
        n_ok = nn < N
        c = tl.load(C_ptr + tok_i[:, None] * sc_t + g * sc_g + nn[None, :] * sc_n,
                    mask=row_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        b = tl.load(B_ptr + tok_i[:, None] * sb_t + g * sb_g + nn[None, :] * sb_n,
                    mask=row_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        if ROW_TILES == 1:
            h0 = tl.load(st + offs_p[:, None] * ss_p + nn[None, :] * ss_n,
                         mask=p_ok[:, None] & n_ok[None, :], other=0.0)
            ch += tl.dot(c, tl.trans(h0), input_precision=PREC)
        cb_diag += tl.dot(c, tl.trans(b), input_precision=PREC)
    x_rows = tl.load(x_ptr + tok_i[:, None] * sx_t + h * sx_h + offs_p[None, :] * sx_p,
                     mask=row_ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)

    # Ancestor walk: `cur` is each row's current ancestor, `s` the dA summed over the path strictly
    # after it, so L[i, cur] = exp(s_i) exactly (a sum over a segment, never a difference of sums).
    # Column blocks go from the diagonal down to block 0: since parent(i) < i, a walk that has left
    # a block never returns to it. The diagonal block's columns are this tile's own rows.
    cur = tl.where(row_ok, offs_i, -1)
    s = tl.zeros([BI], dtype=tl.float32)
    decay, cur, s = _walk_block(cur, s, row0, BI, start, parents_ptr, dt_ptr, sdt_t, sdt_h, h, bias, A, dt_lo, dt_hi)
    dt_i = tl.load(dt_ptr + tok_i * sdt_t + h * sdt_h, mask=row_ok, other=0.0).to(tl.float32)
    dt_i = tl.where(row_ok, softplus_clamped(dt_i + bias, dt_lo, dt_hi), 0.0)
    acc = tl.dot(decay * cb_diag, x_rows * dt_i[:, None], input_precision=PREC)
    if HAS_D:  # added now so x_rows need not stay live
        acc += tl.load(D_ptr + h).to(tl.float32) * x_rows

    for k in range(1, rt + 1):  # blocks below the diagonal (trees taller than one tile)
        j0 = (rt - k) * BI
        decay, cur, s = _walk_block(cur, s, j0, BI, start, parents_ptr, dt_ptr, sdt_t, sdt_h, h, bias, A, dt_lo, dt_hi)
        tok_j = start + j0 + tl.arange(0, BI)  # always inside the tree: j0 + BI <= row0 < n
        cb = tl.zeros([BI, BI], dtype=tl.float32)
        for n0 in tl.static_range(0, N, BN):
            nn = n0 + offs_n
            n_ok = nn < N
            c = tl.load(C_ptr + tok_i[:, None] * sc_t + g * sc_g + nn[None, :] * sc_n,
                        mask=row_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
            b = tl.load(B_ptr + tok_j[:, None] * sb_t + g * sb_g + nn[None, :] * sb_n,
                        mask=n_ok[None, :], other=0.0).to(tl.float32)
            cb += tl.dot(c, tl.trans(b), input_precision=PREC)
        xj = tl.load(x_ptr + tok_j[:, None] * sx_t + h * sx_h + offs_p[None, :] * sx_p,
                     mask=p_ok[None, :], other=0.0).to(tl.float32)
        dt_j = softplus_clamped(tl.load(dt_ptr + tok_j * sdt_t + h * sdt_h).to(tl.float32) + bias, dt_lo, dt_hi)
        acc += tl.dot(decay * cb, xj * dt_j[:, None], input_precision=PREC)

    if ROW_TILES > 1:
        for n0 in tl.static_range(0, N, BN):
            nn = n0 + offs_n
            n_ok = nn < N
            c = tl.load(C_ptr + tok_i[:, None] * sc_t + g * sc_g + nn[None, :] * sc_n,
                        mask=row_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
            h0 = tl.load(st + offs_p[:, None] * ss_p + nn[None, :] * ss_n,
                         mask=p_ok[:, None] & n_ok[None, :], other=0.0)
            ch += tl.dot(c, tl.trans(h0), input_precision=PREC)
    y = acc + tl.exp(tl.minimum(s, 0.0))[:, None] * ch
    io_mask = row_ok[:, None] & p_ok[None, :]
    if HAS_Z:
        zi = tl.load(z_ptr + tok_i[:, None] * sz_t + h * sz_h + offs_p[None, :] * sz_p,
                     mask=io_mask, other=0.0).to(tl.float32)
        y *= silu(zi)
    tl.store(y_ptr + tok_i[:, None] * sy_t + h * sy_h + offs_p[None, :] * sy_p,
             y.to(y_ptr.dtype.element_ty), mask=io_mask)


def tree_ssd_scan(x, dt, A, B, C, D, dt_bias, ssm_state, parents, cu_seqlens, slot_idx, max_nodes, dt_limit, z=None):
    """Triton `tree_ssd_scan`: same contract as `tree_ssd_scan_ref`; `ssm_state` is only read."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    hpg = heads_per_group(H, G)
    y = ssm_common.new_output((T, H, P), x.dtype, x.device)
    nb = cu_seqlens.numel() - 1
    if T == 0 or nb == 0:
        return y
    lo, hi = limits(dt_limit)
    bn = block_nodes(max_nodes)
    bi = min(bn, MAX_TILE)
    bp = min(64, pow2(P))
    n_prog = nb * (bn // bi) * H
    if bp > 32 and n_prog * triton.cdiv(P, bp) < 2 * _sm_count(x.device):
        bp = 32  # small batches: split headdim so more SMs share the state read
    grid = (nb * (bn // bi), H, triton.cdiv(P, bp))
    D_arg = D if D is not None else A
    bias = dt_bias if dt_bias is not None else torch.zeros_like(A)
    zt = z if z is not None else x
    _tree_ssd_kernel[grid](
        x, dt, A, B, C, D_arg, bias, ssm_state, zt, y,
        as_int32(parents), as_int32(cu_seqlens), as_int32(slot_idx),
        hpg, lo, hi,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(),
        *ssm_state.stride(), *zt.stride(), *y.stride(),
        P=P, N=N, ROW_TILES=bn // bi, BI=bi, BP=bp, BN=min(N_CHUNK, pow2(N)),
        HAS_D=D is not None, HAS_Z=z is not None, PREC=dot_precision(x.dtype),
        num_warps=8,  # fewer registers per thread for the (nodes x nodes) and (nodes x headdim) tiles
        num_stages=1,
    )
    return y


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
