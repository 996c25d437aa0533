"""Causal depthwise convolution (width W <= 4) + bias + SiLU over token trees, and its state commit.

Node i's window is the last W raw inputs along its root-to-i path; when the path is shorter than W
the window is topped up from the committed conv state `conv_state[slot] (D, W-1)`, oldest column
first. For a chain this is the ordinary causal conv continued from the state.

Weight layout is the Mamba2 one with the singleton axis dropped: `weight (D, W)`, `weight[:, W-1]`
multiplies the newest input (the node itself).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import release_next, wait_for_previous
from kernels.tree_index import tree_sizes


# --------------------------------------------------------------------------------------------
# PyTorch reference twins
# --------------------------------------------------------------------------------------------


def _packed_tree_ids(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T,) tree index and (T,) first packed row of that tree, for every packed node."""
    sizes = tree_sizes(cu_seqlens)
    tree = torch.repeat_interleave(torch.arange(sizes.numel(), device=cu_seqlens.device), sizes, output_size=total)
    return tree, cu_seqlens[:-1].long()[tree]


def tree_conv1d_ref(xbc, weight, bias, conv_state, parents, cu_seqlens, slot_idx, max_nodes, *, out=None,
                    stash=None):
    """Tree causal conv + SiLU.

    xbc (T, D), weight (D, W), bias (D,) or None, conv_state (S, D, W-1), parents (T,) int32 local,
    cu_seqlens (B+1,) int32, slot_idx (B,) int32 -> (T, D) in xbc's dtype (fp32 accumulation).
    `out (T, D)` (channels contiguous, rows may be strided) receives the result when given.

    `stash (T, D + E)` keeps the raw input as a side output (what a commit of the conv state
    needs): stash <- xbc. xbc may then carry E more columns after its D conv channels (a verify's
    dt), which are copied and not convolved. A verify also points `out` into its stash, so the
    result is written once and serves both the scan and the commit.
    """
    if stash is not None:
        _check_stash(xbc, weight, stash)
        y = tree_conv1d_ref(xbc[:, : weight.shape[0]], weight, bias, conv_state, parents, cu_seqlens, slot_idx,
                            max_nodes, out=out)
        stash.copy_(xbc)
        return y
    T, D = xbc.shape
    W = weight.shape[1]
    tree, start = _packed_tree_ids(cu_seqlens, T)
    slot = slot_idx.long()[tree]
    x32 = xbc.float()
    acc = torch.zeros(T, D, dtype=torch.float32, device=xbc.device)
    cur = torch.arange(T, device=xbc.device) - start  # local node index on the walk, -1 past the root
    beyond = torch.zeros(T, dtype=torch.long, device=xbc.device)  # steps taken past the root
    parents_l = parents.long()
    for s in range(W):  # s = 0 is the node itself, s = k its k-th ancestor
        on_path = cur >= 0
        beyond = beyond + (~on_path).long()
        row = torch.where(on_path, start + cur, torch.zeros_like(cur))
        col = (W - 1 - beyond).clamp(min=0)
        from_state = conv_state[slot, :, col.clamp(max=max(W - 2, 0))].float() if W > 1 else x32[row]
        val = torch.where(on_path[:, None], x32[row], from_state)
        acc += val * weight[:, W - 1 - s].float()[None, :]
        cur = torch.where(on_path, parents_l[row], cur)
    if bias is not None:
        acc += bias.float()[None, :]
    y = F.silu(acc).to(xbc.dtype)
    return y if out is None else out.copy_(y)


def _check_stash(xbc, weight, stash) -> None:
    D = weight.shape[0]
    if not isinstance(stash, torch.Tensor) or xbc.shape[1] < D or stash.shape != xbc.shape:
        shape = tuple(stash.shape) if isinstance(stash, torch.Tensor) else type(stash).__name__
        raise ValueError(f"stash {shape} does not fit input {tuple(xbc.shape)} of a {D}-channel conv")
    if stash.stride(1) != 1:
        raise ValueError("the stash's last axis must be contiguous")


def _layered(conv_state, xbc):
    """Single-layer commit arguments (state (S, D, W-1)) with a layer axis of 1 added; layered ones as they are."""
    return (conv_state, xbc) if conv_state.dim() == 4 else (conv_state.unsqueeze(1), xbc.unsqueeze(1))


def conv_state_commit_ref(conv_state, slot_idx, xbc, rows, path_len):
    """In place: conv_state[slot_idx[b]] = last W-1 columns of [conv_state[slot] | xbc[rows[b, :path_len[b]]]^T].

    One layer: conv_state (S, D, W-1), xbc (R, D). Several layers at once: conv_state (S, L, D, W-1),
    xbc (R, L, D). rows (nb, K) int: the row of xbc that is step k of sequence b's accepted path,
    every entry a valid row; path_len (nb,) int32 with 1 <= path_len <= K, or 0 to commit nothing.
    """
    state, xbc = _layered(conv_state, xbc)
    nb, K = rows.shape
    S, L, D, Wm1 = state.shape
    if Wm1 == 0 or nb == 0:
        return
    slots = slot_idx.long()
    path = xbc[rows.long()].to(state.dtype).permute(0, 2, 3, 1)  # (nb, L, D, K)
    seq = torch.cat([state[slots], path], dim=3)  # (nb, L, D, W-1+K)
    cols = path_len.long()[:, None] + torch.arange(Wm1, device=seq.device)[None, :]  # (nb, W-1)
    state[slots] = torch.gather(seq, 3, cols[:, None, None, :].expand(nb, L, D, Wm1))


def conv1d_prefill_ref(xbc, weight, bias, conv_state=None):
    """One sequence: xbc (L, D) -> SiLU(causal conv) (L, D), new conv state (D, W-1).

    `conv_state (D, W-1)` is the initial state (zeros when None); the new state has its dtype
    (xbc's dtype when None).
    """
    L, D = xbc.shape
    W = weight.shape[1]
    state_dtype = conv_state.dtype if conv_state is not None else xbc.dtype
    if conv_state is None:
        conv_state = torch.zeros(D, W - 1, dtype=xbc.dtype, device=xbc.device)
    seq = torch.cat([conv_state.float(), xbc.float().t()], dim=1)  # (D, W-1+L)
    out = F.conv1d(seq[None], weight.float()[:, None, :], bias.float() if bias is not None else None, groups=D)
    new_state = seq[:, seq.shape[1] - (W - 1):].to(state_dtype)
    return F.silu(out[0].t()).to(xbc.dtype), new_state


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _tree_conv1d_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, parents_ptr, cu_ptr, slot_ptr, out_ptr, raw_ptr,
    D, DX,
    stride_xt, stride_wd, stride_ss, stride_sd, stride_ot, stride_rt,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, STASH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Programs (node tile, tree, channel block). With STASH, the channel blocks span all DX input
    columns and the node's own row (tap 0) goes to raw."""
    release_next(PDL)
    wait_for_previous(PDL)  # every input below may come from the kernel before
    tile = tl.program_id(0)
    b = tl.program_id(1)
    dblk = tl.program_id(2)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    slot = tl.load(slot_ptr + b).to(tl.int64)

    local = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = local < n
    d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    rows = (start + local).to(tl.int64)

    # The committed state's W-1 columns, each read once as a channel vector; a node whose window
    # reaches past the root picks its column per tap by select. (Per-element gathers of the
    # column-strided state cost a load per element and tap, even for the nodes that need none.)
    st = state_ptr + slot * stride_ss + d * stride_sd
    col0 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    col1 = col0
    col2 = col0
    if W > 1:
        col0 = tl.load(st, mask=d_ok, other=0.0).to(tl.float32)
    if W > 2:
        col1 = tl.load(st + 1, mask=d_ok, other=0.0).to(tl.float32)
    if W > 3:
        col2 = tl.load(st + 2, mask=d_ok, other=0.0).to(tl.float32)

    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    cur = tl.where(row_ok, local, -1)  # walk position: local node, -1 once past the root
    beyond = tl.zeros((BLOCK_T,), dtype=tl.int32)  # steps taken past the root
    for s in tl.static_range(W):  # s-th ancestor multiplies weight column W-1-s
        on_path = cur >= 0
        beyond += tl.where(on_path, 0, 1)
        src = (start + tl.maximum(cur, 0)).to(tl.int64)
        # tap 0 reads every input column (DX > D only with a stash); columns past D meet zero weights
        cols_ok = (d < DX) if s == 0 else d_ok
        val = tl.load(
            x_ptr + src[:, None] * stride_xt + d[None, :], mask=on_path[:, None] & cols_ok[None, :], other=0.0
        ).to(tl.float32)
        if STASH and s == 0:
            tl.store(raw_ptr + rows[:, None] * stride_rt + d[None, :], val.to(raw_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & cols_ok[None, :])
        if s > 0:  # the node itself is always on its path
            col = W - 1 - beyond  # state column, oldest first; in [0, W-2] whenever it is read
            from_state = (row_ok & (cur < 0))[:, None]
            state_val = tl.where((col == 0)[:, None], col0[None, :],
                                 tl.where((col == 1)[:, None], col1[None, :], col2[None, :]))
            val = tl.where(from_state, state_val, val)
        w = tl.load(w_ptr + d * stride_wd + (W - 1 - s), mask=d_ok, other=0.0).to(tl.float32)
        acc += val * w[None, :]
        if s < W - 1:
            parent = tl.load(parents_ptr + start + tl.maximum(cur, 0), mask=on_path, other=-1)
            cur = tl.where(on_path, parent, cur)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + rows[:, None] * stride_ot + d[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _conv_blocks(D: int, rows: int = 16) -> int:
    """Channels per program for `rows` rows: about 2048 elements (16 x 128 keeps the per-element
    gathers near 140 registers on sm_90), so small trees get wide channel blocks instead of idle rows."""
    return min(triton.next_power_of_2(max(D, 16)), max(128, min(1024, 2048 // rows)))


def tree_conv1d(xbc, weight, bias, conv_state, parents, cu_seqlens, slot_idx, max_nodes, *, out=None,
                stash=None, block_t: int | None = None, block_d: int | None = None,
                num_warps: int | None = None):
    """Triton twin of `tree_conv1d_ref`: one program per (node tile, tree, channel block).

    Each node walks up at most W-1 ancestors through `parents` (one gather per step); no mask is built.
    The stash, when given, is written by the same programs: a verify needs no separate copy launch.
    `block_t` (nodes per program), `block_d` (channels per program) and `num_warps` are tuning knobs
    for benchmarks.
    """
    if stash is not None:
        _check_stash(xbc, weight, stash)
    T, DX = xbc.shape
    D = weight.shape[0]
    W = weight.shape[1]
    if stash is None and DX != D:
        raise ValueError(f"input has {DX} columns for a {D}-channel conv")
    if not 1 <= W <= 4:
        raise ValueError(f"conv width {W} is not in 1..4")
    xbc = xbc.contiguous() if xbc.stride(1) != 1 else xbc
    weight = weight.contiguous()
    if W > 1 and conv_state.stride(2) != 1:
        raise ValueError("conv_state must be contiguous along its last axis")
    if out is None:
        out = torch.empty(T, D, dtype=xbc.dtype, device=xbc.device)
    elif out.shape != (T, D) or out.stride(1) != 1:
        raise ValueError("out must be (T, D) with contiguous channels")
    B = cu_seqlens.numel() - 1
    if T == 0 or B == 0:
        return out
    BLOCK_T = block_t or min(16, triton.next_power_of_2(max(int(max_nodes), 1)))
    BLOCK_D = block_d or _conv_blocks(D, BLOCK_T)
    raw = stash if stash is not None else out
    grid = (triton.cdiv(int(max_nodes), BLOCK_T), B, triton.cdiv(DX, BLOCK_D))
    _tree_conv1d_kernel[grid](
        xbc, weight, bias if bias is not None else weight, conv_state, parents, cu_seqlens, slot_idx, out, raw,
        D, DX,
        xbc.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0), raw.stride(0),
        W=W, HAS_BIAS=bias is not None, STASH=stash is not None, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
        **pdl.launch_options(xbc.device), num_warps=num_warps or 4,
    )
    return out


@triton.jit
def _conv_commit_kernel(
    state_ptr, slot_ptr, x_ptr, rows_ptr, len_ptr,
    D,
    stride_ss, stride_sl, stride_sd, stride_xr, stride_xl, stride_rb, stride_rk,
    WM1: tl.constexpr, WP: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Programs (sequence, layer, channel block); path inputs read in place through the row table."""
    release_next(PDL)
    wait_for_previous(PDL)  # every input below may come from the kernel before
    b = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    dblk = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    plen = tl.load(len_ptr + b)
    d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    c = tl.arange(0, WP)
    c_ok = c < WM1
    src = plen + c  # column of [old state | path inputs] that becomes new column c
    from_old = c_ok & (src < WM1)
    from_path = c_ok & (src >= WM1)
    base = state_ptr + slot * stride_ss + layer * stride_sl + d[:, None] * stride_sd
    old = tl.load(base + tl.minimum(src, WM1 - 1)[None, :], mask=d_ok[:, None] & from_old[None, :], other=0.0)
    row = tl.load(rows_ptr + b * stride_rb + tl.maximum(src - WM1, 0) * stride_rk, mask=from_path, other=0)
    new = tl.load(
        x_ptr + row.to(tl.int64)[None, :] * stride_xr + layer * stride_xl + d[:, None],
        mask=d_ok[:, None] & from_path[None, :],
        other=0.0,
    )
    val = tl.where(from_old[None, :], old, new.to(old.dtype))
    tl.debug_barrier()  # every old column is read before any is overwritten
    tl.store(base + c[None, :], val, mask=d_ok[:, None] & c_ok[None, :])


def conv_state_commit(conv_state, slot_idx, xbc, rows, path_len):
    """Triton twin of `conv_state_commit_ref` (in place; slots in `slot_idx` must be distinct)."""
    state, xbc = _layered(conv_state, xbc)
    nb, K = rows.shape
    S, L, D, WM1 = state.shape
    if WM1 == 0 or nb == 0:
        return
    if state.stride(3) != 1:
        raise ValueError("conv_state must be contiguous along its last axis")
    xbc = xbc if xbc.stride(2) == 1 else xbc.contiguous()
    BLOCK_D = min(256, triton.next_power_of_2(max(D, 16)))
    grid = (nb, L, triton.cdiv(D, BLOCK_D))
    _conv_commit_kernel[grid](
        state, slot_idx, xbc, rows, path_len,
        D,
        state.stride(0), state.stride(1), state.stride(2), xbc.stride(0), xbc.stride(1), *rows.stride(),
        WM1=WM1, WP=triton.next_power_of_2(WM1), BLOCK_D=BLOCK_D,
        **pdl.launch_options(state.device),
    )


@triton.jit
def _conv_prefill_kernel(
    x_ptr, w_ptr, bias_ptr, init_ptr, out_ptr, new_state_ptr,
    L, D,
    stride_xl, stride_wd, stride_id, stride_ol, stride_nd,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, WP: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    dblk = tl.program_id(1)
    t = tile * BLOCK_L + tl.arange(0, BLOCK_L)
    t_ok = t < L
    d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    acc = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
    for s in tl.static_range(W):
        src = t - s
        val = tl.load(x_ptr + tl.maximum(src, 0)[:, None].to(tl.int64) * stride_xl + d[None, :],
                      mask=(t_ok & (src >= 0))[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if HAS_INIT:
            if s > 0:
                col = W - 1 + src  # initial-state column for src < 0
                val += tl.load(init_ptr + d[None, :] * stride_id + tl.maximum(col, 0)[:, None],
                               mask=(t_ok & (src < 0))[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + d * stride_wd + (W - 1 - s), mask=d_ok, other=0.0).to(tl.float32)
        acc += val * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + t[:, None].to(tl.int64) * stride_ol + d[None, :], y.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & d_ok[None, :])
    if W > 1:
        if tile == 0:  # the new state: last W-1 columns of [initial state | x]
            c = tl.arange(0, WP)
            c_ok = c < W - 1
            src_c = L + c
            from_init = c_ok & (src_c < W - 1)
            from_x = c_ok & (src_c >= W - 1)
            v = tl.load(x_ptr + tl.maximum(src_c - (W - 1), 0)[None, :].to(tl.int64) * stride_xl + d[:, None],
                        mask=d_ok[:, None] & from_x[None, :], other=0.0).to(tl.float32)
            if HAS_INIT:
                v += tl.load(init_ptr + d[:, None] * stride_id + tl.minimum(src_c, W - 2)[None, :],
                             mask=d_ok[:, None] & from_init[None, :], other=0.0).to(tl.float32)
            tl.store(new_state_ptr + d[:, None] * stride_nd + c[None, :], v.to(new_state_ptr.dtype.element_ty),
                     mask=d_ok[:, None] & c_ok[None, :])


def conv1d_prefill(xbc, weight, bias, conv_state=None):
    """Triton twin of `conv1d_prefill_ref`: xbc (L, D) -> (out (L, D), new state (D, W-1))."""
    L, D = xbc.shape
    W = weight.shape[1]
    if not 1 <= W <= 4:
        raise ValueError(f"conv width {W} is not in 1..4")
    xbc = xbc if xbc.stride(1) == 1 else xbc.contiguous()
    weight = weight.contiguous()
    state_dtype = conv_state.dtype if conv_state is not None else xbc.dtype
    if conv_state is not None:
        conv_state = conv_state.contiguous()
    out = torch.empty_like(xbc)
    new_state = torch.zeros(D, W - 1, dtype=state_dtype, device=xbc.device)
    if L == 0:
        if conv_state is not None:
            new_state.copy_(conv_state)
        return out, new_state
    BLOCK_L = 16
    BLOCK_D = _conv_blocks(D)
    grid = (triton.cdiv(L, BLOCK_L), triton.cdiv(D, BLOCK_D))
    _conv_prefill_kernel[grid](
        xbc, weight, bias if bias is not None else weight, conv_state if conv_state is not None else weight,
        out, new_state,
        L, D,
        xbc.stride(0), weight.stride(0), conv_state.stride(0) if conv_state is not None else 0, out.stride(0),
        max(W - 1, 1),
        W=W, HAS_BIAS=bias is not None, HAS_INIT=conv_state is not None, WP=triton.next_power_of_2(max(W - 1, 1)),
        BLOCK_L=BLOCK_L, BLOCK_D=BLOCK_D,
    )
    return out, new_state
