"""Causal depthwise convolution (width W <= 4) + bias + SiLU over token trees, and its state commit.

Node i's window is the last W raw inputs along its root-to-i path; when the path is shorter than W
the window is topped up from the committed conv state. For a chain this is the ordinary causal conv
continued from the state.

The conv state of a slot is a ring of its last W raw inputs, `conv_state[slot] (D, W)`: the input at
position p (0-based, in the sequence) sits in column p mod W, and positions before the first token
read as zeros. A slot with committed length n thus holds positions n-W .. n-1, and the next token's
column (n mod W) holds the one input no conv reads again. Every kernel that reads or moves the state
takes n (`cache_lens`). Moving the state on is then a write of the new inputs into their own
columns: nothing shifts, so no program has to wait until every other one has read the old window
(which the fused decode step, kernels/mamba_decode.py, would otherwise need).

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
from kernels.ssm_common import silu
from kernels.tree_index import tree_sizes


# --------------------------------------------------------------------------------------------
# PyTorch reference twins
# --------------------------------------------------------------------------------------------


def _packed_tree_ids(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T,) tree index and (T,) first packed row of that tree, for every packed node."""
    sizes = tree_sizes(cu_seqlens)
    tree = torch.repeat_interleave(torch.arange(sizes.numel(), device=cu_seqlens.device), sizes, output_size=total)
    return tree, cu_seqlens[:-1].long()[tree]


def conv_window(ring: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The committed window in time order: ring (B, ..., D, W) of slots with committed lengths lens
    (B,) -> (B, ..., D, W-1), column j holding position n-(W-1)+j (the newest last)."""
    W = ring.shape[-1]
    cols = (lens.long()[:, None] + 1 + torch.arange(W - 1, device=ring.device)[None, :]) % W  # (B, W-1)
    cols = cols.view(cols.shape[0], *([1] * (ring.dim() - 2)), W - 1).expand(*ring.shape[:-1], W - 1)
    return torch.gather(ring, ring.dim() - 1, cols)


def tree_conv1d_ref(xbc, weight, bias, conv_state, parents, cu_seqlens, slot_idx, cache_lens, max_nodes, *,
                    out=None, stash=None):
    """Tree causal conv + SiLU.

    xbc (T, D), weight (D, W), bias (D,) or None, conv_state (S, D, W) rings, parents (T,) int32 local,
    cu_seqlens (B+1,) int32, slot_idx (B,) int32, cache_lens (B,) int32 committed lengths -> (T, D)
    in xbc's dtype (fp32 accumulation).
    `out (T, D)` (channels contiguous, rows may be strided) receives the result when given.

    `stash (T, D + E)` keeps the raw input as a side output (what a commit of the conv state
    needs): stash <- xbc. xbc may then carry E more columns after its D conv channels (a verify's
    dt), which are copied and not convolved. A verify also points `out` into its stash, so the
    result is written once and serves both the scan and the commit.
    """
    if stash is not None:
        _check_stash(xbc, weight, stash)
        y = tree_conv1d_ref(xbc[:, : weight.shape[0]], weight, bias, conv_state, parents, cu_seqlens, slot_idx,
                            cache_lens, max_nodes, out=out)
        stash.copy_(xbc)
        return y
    T, D = xbc.shape
    W = weight.shape[1]
    tree, start = _packed_tree_ids(cu_seqlens, T)
    slot = slot_idx.long()[tree]
    n = cache_lens.long()[tree]
    x32 = xbc.float()
    acc = torch.zeros(T, D, dtype=torch.float32, device=xbc.device)
    cur = torch.arange(T, device=xbc.device) - start  # local node index on the walk, -1 past the root
    beyond = torch.zeros(T, dtype=torch.long, device=xbc.device)  # steps taken past the root
    parents_l = parents.long()
    for s in range(W):  # s = 0 is the node itself, s = k its k-th ancestor
        on_path = cur >= 0
        beyond = beyond + (~on_path).long()
        row = torch.where(on_path, start + cur, torch.zeros_like(cur))
        from_state = conv_state[slot, :, (n - beyond) % W].float()  # position n - beyond
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
    """Single-layer commit arguments (state (S, D, W)) with a layer axis of 1 added; layered ones as they are."""
    return (conv_state, xbc) if conv_state.dim() == 4 else (conv_state.unsqueeze(1), xbc.unsqueeze(1))


def conv_state_commit_ref(conv_state, slot_idx, xbc, rows, path_len, cache_lens):
    """In place: slot b's ring takes the raw inputs of its accepted path, step i at position
    cache_lens[b] + i, for the last min(path_len[b], W) steps (earlier ones fall out of the ring).

    One layer: conv_state (S, D, W), xbc (R, D). Several layers at once: conv_state (S, L, D, W),
    xbc (R, L, D). rows (nb, K) int: the row of xbc that is step k of sequence b's accepted path,
    every entry a valid row; path_len (nb,) int32 with 1 <= path_len <= K, or 0 to commit nothing;
    cache_lens (nb,) int32 the committed lengths before the commit.
    """
    state, xbc = _layered(conv_state, xbc)
    nb, K = rows.shape
    W = state.shape[3]
    if nb == 0 or K == 0:
        return
    slots = slot_idx.long()
    k = path_len.long()
    for c in range(W):  # the c-th of the last W steps: distinct columns, so the order does not matter
        i = k - W + c
        taken = (i >= 0)[:, None, None]
        col = (cache_lens.long() + i.clamp(min=0)) % W
        new = xbc[rows.long().gather(1, i.clamp(min=0, max=K - 1)[:, None])[:, 0]].to(state.dtype)  # (nb, L, D)
        state[slots, :, :, col] = torch.where(taken, new, state[slots, :, :, col])


def conv1d_prefill_ref(xbc, weight, bias, conv_state=None, start=0):
    """One sequence: xbc (L, D) at positions start .. start+L-1 -> (SiLU(causal conv) (L, D),
    the new ring (D, W)).

    `conv_state (D, W)` is the ring of a slot that has consumed `start` tokens (None: a fresh slot,
    all zeros, with start 0); the new ring has its dtype (xbc's dtype when None). `start` is an int
    or a one-element integer tensor on the device (what a CUDA graph's prefill reads at replay).
    """
    L, D = xbc.shape
    W = weight.shape[1]
    state_dtype = conv_state.dtype if conv_state is not None else xbc.dtype
    if conv_state is None:
        conv_state = torch.zeros(D, W, dtype=xbc.dtype, device=xbc.device)
    if L == 0:
        return xbc.clone(), conv_state.to(state_dtype).clone()
    lens = torch.as_tensor(start, device=xbc.device).reshape(1).long()
    window = conv_window(conv_state[None], lens)[0]
    seq = torch.cat([window.float(), xbc.float().t()], dim=1)  # (D, W-1+L)
    out = F.conv1d(seq[None], weight.float()[:, None, :], bias.float() if bias is not None else None, groups=D)
    # ring column r holds the newest position that is r mod W: a prompt position when there is one
    first = lens + L - W
    pos = first + (torch.arange(W, device=xbc.device) - first) % W  # (W,)
    from_x = pos >= lens
    taken = xbc[(pos - lens).clamp(0, L - 1)].t().to(state_dtype)
    ring = torch.where(from_x[None, :], taken, conv_state.to(state_dtype))
    return F.silu(out[0].t()).to(xbc.dtype), ring


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def walk_up(parents_ptr, start, cur, beyond):
    """One step of a tree conv's walk towards the root: local nodes `cur` (BLOCK,) of the trees whose
    packed rows begin at `start` (scalar or (BLOCK,)) -> (their parents, -1 once past the root, where
    a node already past it stays; `beyond` (BLOCK,) int32, the steps taken past the root, counting
    this one). The tree conv and the conv in in_proj's epilogue (kernels/proj_conv.py) both walk so."""
    cur = tl.load(parents_ptr + start + tl.maximum(cur, 0), mask=cur >= 0, other=-1)
    return cur, beyond + tl.where(cur >= 0, 0, 1)


@triton.jit
def _weight_column(w_ptr, stride_wd, d, d_ok, k: tl.constexpr):
    """(BLOCK_D,) fp32 column k of the (D, W) conv weight at channels d."""
    return tl.load(w_ptr + d * stride_wd + k, mask=d_ok, other=0.0).to(tl.float32)


@triton.jit
def _word_part(words, k, dtype: tl.constexpr):
    """(BLOCK_D,) fp32: 16-bit value k (0 the lowest; a scalar 0..3) of each 64-bit word, as `dtype`."""
    return ((words >> (16 * k)) & 0xFFFF).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)


@triton.jit
def _tree_conv1d_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, parents_ptr, cu_ptr, slot_ptr, lens_ptr, out_ptr, raw_ptr,
    D, DX,
    stride_xt, stride_wd, stride_ss, stride_sd, stride_ot, stride_rt,
    W: tl.constexpr, PACKED: tl.constexpr, HAS_BIAS: tl.constexpr, STASH: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
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
    n_committed = tl.load(lens_ptr + b)

    local = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = local < n
    d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    rows = (start + local).to(tl.int64)

    # Loads that do not wait on the walk go first: the node's own row, then the committed window and
    # the weights, and the stash store (which waits for the row) after them. Each channel vector
    # reaches the tile's layout through shared memory behind a barrier, and no load after a barrier
    # issues before it clears: with the row read last, a program paid each round trip in turn
    # (0.93x the time at 64 sequences in this order: BENCHMARKS.md fifteenth round).
    # Tap 0, the node itself, reads every input column (DX > D only with a stash); columns past D
    # meet zero weights.
    own = tl.load(x_ptr + rows[:, None] * stride_xt + d[None, :], mask=row_ok[:, None] & (d < DX)[None, :],
                  other=0.0)
    # The committed window's W-1 columns (col0 oldest: position n-(W-1) + j is ring column
    # (n + 1 + j) mod W), each a channel vector; a node whose window reaches past the root picks its
    # column per tap by select. (Per-element gathers of the column-strided state cost a load per
    # element and tap, even for the nodes that need none.) Tap s (s = 0 the node, s = k its k-th
    # ancestor) multiplies weight column W-1-s.
    if PACKED:
        # W = 4 and 2-byte values, the served case: a channel's ring, and its four weights, are one
        # 64-bit word each, so two loads (and two layout conversions) replace seven
        ring = tl.load((state_ptr + slot * stride_ss).to(tl.pointer_type(tl.int64)) + d, mask=d_ok, other=0)
        taps = tl.load(w_ptr.to(tl.pointer_type(tl.int64)) + d, mask=d_ok, other=0)
        col0 = _word_part(ring, (n_committed + 1) % W, state_ptr.dtype.element_ty)
        col1 = _word_part(ring, (n_committed + 2) % W, state_ptr.dtype.element_ty)
        col2 = _word_part(ring, (n_committed + 3) % W, state_ptr.dtype.element_ty)
        tap0 = _word_part(taps, 3, w_ptr.dtype.element_ty)
        tap1 = _word_part(taps, 2, w_ptr.dtype.element_ty)
        tap2 = _word_part(taps, 1, w_ptr.dtype.element_ty)
        tap3 = _word_part(taps, 0, w_ptr.dtype.element_ty)
    else:
        st = state_ptr + slot * stride_ss + d * stride_sd
        col0 = tl.zeros((BLOCK_D,), dtype=tl.float32)
        col1 = col0
        col2 = col0
        if W > 1:
            col0 = tl.load(st + (n_committed + 1) % W, mask=d_ok, other=0.0).to(tl.float32)
        if W > 2:
            col1 = tl.load(st + (n_committed + 2) % W, mask=d_ok, other=0.0).to(tl.float32)
        if W > 3:
            col2 = tl.load(st + (n_committed + 3) % W, mask=d_ok, other=0.0).to(tl.float32)
        tap0 = _weight_column(w_ptr, stride_wd, d, d_ok, W - 1)
        tap1 = tap0
        tap2 = tap0
        tap3 = tap0
        if W > 1:
            tap1 = _weight_column(w_ptr, stride_wd, d, d_ok, W - 2)
        if W > 2:
            tap2 = _weight_column(w_ptr, stride_wd, d, d_ok, W - 3)
        if W > 3:
            tap3 = _weight_column(w_ptr, stride_wd, d, d_ok, W - 4)
    if STASH:
        tl.store(raw_ptr + rows[:, None] * stride_rt + d[None, :], own.to(raw_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (d < DX)[None, :])
    acc = own.to(tl.float32) * tap0[None, :]
    cur = tl.where(row_ok, local, -1)  # walk position: local node, -1 once past the root
    beyond = tl.zeros((BLOCK_T,), dtype=tl.int32)  # steps taken past the root
    for s in tl.static_range(1, W):  # the s-th ancestor
        cur, beyond = walk_up(parents_ptr, start, cur, beyond)
        on_path = cur >= 0
        src = (start + tl.maximum(cur, 0)).to(tl.int64)
        val = tl.load(x_ptr + src[:, None] * stride_xt + d[None, :], mask=on_path[:, None] & d_ok[None, :],
                      other=0.0).to(tl.float32)
        col = W - 1 - beyond  # window column, oldest first; in [0, W-2] whenever it is read
        from_state = (row_ok & (cur < 0))[:, None]
        state_val = tl.where((col == 0)[:, None], col0[None, :],
                             tl.where((col == 1)[:, None], col1[None, :], col2[None, :]))
        val = tl.where(from_state, state_val, val)
        acc += val * (tap1 if s == 1 else (tap2 if s == 2 else tap3))[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    y = silu(acc)
    tl.store(out_ptr + rows[:, None] * stride_ot + d[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


# The conv's launch: at most 8 nodes per program, about 1024 elements, 2 warps. In an H100 sweep
# (`python -m bench.batch_kernels --kernels conv --sweep`, 16-node trees, BENCHMARKS.md fourteenth
# round), 8 x 128 with 2 warps took 0.74x the time of the former 16 x 128 with 4 at 16 and 64
# sequences, at both layer shapes, and 0.95-0.96x for one tree: more, smaller programs keep more of
# the taps' row gathers in flight.
CONV_NODE_TILE = 8
CONV_TILE_ELEMENTS = 1024
CONV_WARPS = 2


def _conv_blocks(D: int, rows: int) -> int:
    """Channels per program for `rows` rows: CONV_TILE_ELEMENTS in all, at least 128 and at most 1024
    channels, so small trees get wide channel blocks instead of idle rows."""
    return min(triton.next_power_of_2(max(D, 16)), max(128, min(1024, CONV_TILE_ELEMENTS // rows)))


def tree_conv1d(xbc, weight, bias, conv_state, parents, cu_seqlens, slot_idx, cache_lens, max_nodes, *,
                out=None, stash=None, block_t: int | None = None, block_d: int | None = None,
                num_warps: int | None = None):
    """Triton twin of `tree_conv1d_ref`: one program per (node tile, tree, channel block).

    Each node walks up at most W-1 ancestors through `parents` (one gather per step); no mask is built.
    A width-4 conv in 2-byte values reads each channel's weights and committed ring as one 64-bit
    word apiece (`packs_channels`), other shapes one column at a time; the results are the same.
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
    check_ring(conv_state, W)
    if out is None:
        out = torch.empty(T, D, dtype=xbc.dtype, device=xbc.device)
    elif out.shape != (T, D) or out.stride(1) != 1:
        raise ValueError("out must be (T, D) with contiguous channels")
    B = cu_seqlens.numel() - 1
    if T == 0 or B == 0:
        return out
    BLOCK_T = block_t or min(CONV_NODE_TILE, triton.next_power_of_2(max(int(max_nodes), 1)))
    BLOCK_D = block_d or _conv_blocks(D, BLOCK_T)
    raw = stash if stash is not None else out
    grid = (triton.cdiv(int(max_nodes), BLOCK_T), B, triton.cdiv(DX, BLOCK_D))
    _tree_conv1d_kernel[grid](
        xbc, weight, bias if bias is not None else weight, conv_state, parents, cu_seqlens, slot_idx, cache_lens,
        out, raw,
        D, DX,
        xbc.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0), raw.stride(0),
        W=W, PACKED=packs_channels(weight, conv_state), HAS_BIAS=bias is not None, STASH=stash is not None,
        BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
        **pdl.launch_options(xbc.device), num_warps=num_warps or CONV_WARPS,
    )
    return out


@triton.jit
def _conv_commit_kernel(
    state_ptr, slot_ptr, x_ptr, rows_ptr, len_ptr, lens_ptr,
    D,
    stride_ss, stride_sl, stride_sd, stride_xr, stride_xl, stride_rb, stride_rk,
    W: tl.constexpr, WP: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Programs (sequence, layer, channel block); path inputs read in place through the row table.
    Each of the last min(path_len, W) steps goes to its own ring column: no column is read, so no
    ordering between the stores is needed."""
    release_next(PDL)
    wait_for_previous(PDL)  # every input below may come from the kernel before
    b = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    dblk = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    plen = tl.load(len_ptr + b)
    n_committed = tl.load(lens_ptr + b)
    d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    c = tl.arange(0, WP)
    step = plen - W + c  # path step that lands in this lane
    taken = (c < W) & (step >= 0)
    step = tl.maximum(step, 0)
    row = tl.load(rows_ptr + b * stride_rb + step * stride_rk, mask=taken, other=0)
    new = tl.load(
        x_ptr + row.to(tl.int64)[None, :] * stride_xr + layer * stride_xl + d[:, None],
        mask=d_ok[:, None] & taken[None, :],
        other=0.0,
    )
    col = (n_committed + step) % W
    base = state_ptr + slot * stride_ss + layer * stride_sl + d[:, None] * stride_sd
    tl.store(base + col[None, :], new.to(state_ptr.dtype.element_ty), mask=d_ok[:, None] & taken[None, :])


def packs_channels(weight, conv_state) -> bool:
    """Whether `tree_conv1d` reads each channel's four weights and four ring values as one 64-bit word:
    a width-4 conv with 2-byte values, (D, 4) rows packed and 8-byte aligned in both tensors."""
    return (weight.shape[1] == 4 and weight.element_size() == 2 and conv_state.element_size() == 2
            and weight.stride(0) == 4 and conv_state.stride(-2) == 4 and conv_state.stride(0) % 4 == 0
            and weight.data_ptr() % 8 == 0 and conv_state.data_ptr() % 8 == 0)


def check_ring(conv_state, W: int) -> None:
    """conv_state (..., D, W): rings of a width-W conv, contiguous along the last axis."""
    if conv_state.shape[-1] != W:
        raise ValueError(f"conv_state has {conv_state.shape[-1]} columns; a width-{W} conv keeps rings of {W}")
    if conv_state.stride(-1) != 1:
        raise ValueError("conv_state must be contiguous along its last axis")


def conv_state_commit(conv_state, slot_idx, xbc, rows, path_len, cache_lens):
    """Triton twin of `conv_state_commit_ref` (in place; slots in `slot_idx` must be distinct, except
    for items that commit nothing)."""
    state, xbc = _layered(conv_state, xbc)
    nb, K = rows.shape
    S, L, D, W = state.shape
    if nb == 0 or K == 0:
        return
    check_ring(state, W)
    xbc = xbc if xbc.stride(2) == 1 else xbc.contiguous()
    BLOCK_D = min(256, triton.next_power_of_2(max(D, 16)))
    grid = (nb, L, triton.cdiv(D, BLOCK_D))
    _conv_commit_kernel[grid](
        state, slot_idx, xbc, rows, path_len, cache_lens,
        D,
        state.stride(0), state.stride(1), state.stride(2), xbc.stride(0), xbc.stride(1), *rows.stride(),
        W=W, WP=triton.next_power_of_2(W), BLOCK_D=BLOCK_D,
        **pdl.launch_options(state.device),
    )


@triton.jit(do_not_specialize=["L", "start_ptr"])  # sizes and positions that change per call: one compile serves them all
def _conv_prefill_kernel(
    x_ptr, w_ptr, bias_ptr, init_ptr, out_ptr, new_state_ptr, start_ptr,
    L, D,
    stride_xl, stride_wd, stride_id, stride_ol, stride_nd,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, WP: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    dblk = tl.program_id(1)
    start = tl.load(start_ptr).to(tl.int32)  # committed length, read on the device (graph replays)
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
                col = (start + src + W) % W  # ring column of position start + src (>= start - W + 1)
                val += tl.load(init_ptr + d[None, :] * stride_id + col[:, None],
                               mask=(t_ok & (src < 0))[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + d * stride_wd + (W - 1 - s), mask=d_ok, other=0.0).to(tl.float32)
        acc += val * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    y = silu(acc)
    tl.store(out_ptr + t[:, None].to(tl.int64) * stride_ol + d[None, :], y.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & d_ok[None, :])
    if tile == 0:  # the new ring: column r holds the one of the last W positions that is r mod W
        r = tl.arange(0, WP)
        r_ok = r < W
        first = start + L - W
        pos = first + ((r - first) % W + W) % W
        from_x = r_ok & (pos >= start)
        v = tl.load(x_ptr + tl.maximum(pos - start, 0)[None, :].to(tl.int64) * stride_xl + d[:, None],
                    mask=d_ok[:, None] & from_x[None, :], other=0.0).to(tl.float32)
        if HAS_INIT:  # older positions keep their column
            v += tl.load(init_ptr + d[:, None] * stride_id + r[None, :],
                         mask=d_ok[:, None] & (r_ok & (pos < start))[None, :], other=0.0).to(tl.float32)
        tl.store(new_state_ptr + d[:, None] * stride_nd + r[None, :], v.to(new_state_ptr.dtype.element_ty),
                 mask=d_ok[:, None] & r_ok[None, :])


def conv1d_prefill(xbc, weight, bias, conv_state=None, start=0):
    """Triton twin of `conv1d_prefill_ref`: xbc (L, D) -> (out (L, D), new ring (D, W)); `start` an
    int or a one-element integer tensor on xbc's device."""
    L, D = xbc.shape
    W = weight.shape[1]
    if not 1 <= W <= 4:
        raise ValueError(f"conv width {W} is not in 1..4")
    xbc = xbc if xbc.stride(1) == 1 else xbc.contiguous()
    weight = weight.contiguous()
    state_dtype = conv_state.dtype if conv_state is not None else xbc.dtype
    if conv_state is not None:
        conv_state = conv_state.contiguous()
        check_ring(conv_state, W)
    out = torch.empty_like(xbc)
    if L == 0:
        return out, (conv_state.clone() if conv_state is not None else torch.zeros(D, W, dtype=state_dtype,
                                                                                    device=xbc.device))
    if not isinstance(start, torch.Tensor):
        start = torch.full((1,), int(start), dtype=torch.int32, device=xbc.device)
    elif start.numel() != 1 or start.device != xbc.device:
        raise ValueError(f"start must be one integer on {xbc.device}, got {tuple(start.shape)} on {start.device}")
    new_state = torch.empty(D, W, dtype=state_dtype, device=xbc.device)
    BLOCK_L = 16
    BLOCK_D = _conv_blocks(D, BLOCK_L)
    grid = (triton.cdiv(L, BLOCK_L), triton.cdiv(D, BLOCK_D))
    _conv_prefill_kernel[grid](
        xbc, weight, bias if bias is not None else weight, conv_state if conv_state is not None else weight,
        out, new_state, start,
        L, D,
        xbc.stride(0), weight.stride(0), conv_state.stride(0) if conv_state is not None else 0, out.stride(0),
        new_state.stride(0),
        W=W, HAS_BIAS=bias is not None, HAS_INIT=conv_state is not None, WP=triton.next_power_of_2(W),
        BLOCK_L=BLOCK_L, BLOCK_D=BLOCK_D,
    )
    return out, new_state
