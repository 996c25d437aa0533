"""A Mamba2 layer's in_proj and its tree conv in one launch, for a verify of a few nodes.

In a verify of up to MAX_CONV_ROWS nodes, the few-row dot path (kernels/few_rows_linear.py) gives each
program BN output columns of in_proj for every node of the batch. For the conv's input channels
that is everything the tree conv needs from in_proj: each node's window is the node and its W-1
nearest ancestors along its path, all rows of the same tile, topped up from the committed conv ring
past the root. So the conv runs in the projection's epilogue, from registers:
- tap s of node i is row anc_s(i) of the tile (an in-register gather along the rows), or, past the
  root, ring column (n - beyond) mod W of the tree's slot (kernels/conv_tree.py's convention);
- the gathered values are the projection's outputs rounded to its dtype, so every tap is the value
  the separate conv would have read from memory;
- the stash (raw xBC | dt, what a commit needs) and the conv's output are written by the same
  program.
That removes the separate conv launch and its wait on in_proj from every Mamba2 layer of a verify.

    h (T, K) rows, weight (N, K) in_proj, bias (N,) or None; its columns [conv_lo, conv_lo + D) are
    the conv's D input channels and [conv_lo, N) the stashed ones (xBC | dt). conv_weight (D, W),
    conv_bias (D,) or None, conv_state (S, D, W) rings, parents / cu_seqlens / slot_idx / cache_lens
    as kernels/conv_tree.py -> (y (T, N), conv_out (T, D)); stash (T, N - conv_lo) <- y[:, conv_lo:].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.conv_tree import check_ring, tree_conv1d_ref, walk_up
from kernels.few_rows_linear import add_up_splits, dot_grid, dot_rows, few_rows_linear_ref, store_y
from kernels.pdl import release_next
from kernels.ssm_common import as_int32, dot_precision, last_axis_contiguous, silu


def project_tree_conv_ref(h, weight, bias, conv_lo, conv_weight, conv_bias, conv_state, parents, cu_seqlens,
                          slot_idx, cache_lens, max_nodes, *, stash, conv_out=None):
    """PyTorch twin of `project_tree_conv`: the projection (fp32 sums, one rounding), then the tree
    conv of its columns [conv_lo, N) with the stash."""
    y = few_rows_linear_ref(h, weight, bias)
    out = tree_conv1d_ref(y[:, conv_lo:], conv_weight, conv_bias, conv_state, parents, cu_seqlens, slot_idx,
                          cache_lens, max_nodes, out=conv_out, stash=stash)
    return y, out


@triton.jit
def _project_tree_conv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, arrive_ptr,
    cw_ptr, cb_ptr, state_ptr, parents_ptr, cu_ptr, slot_ptr, lens_ptr, conv_ptr, raw_ptr,
    M, N, K, k_tiles_per_program, conv_lo, D, n_trees,
    s_xm, s_wn, s_ym, s_cwd, s_ss, s_sd, s_cm, s_rm,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, W: tl.constexpr, TREES: tl.constexpr,
    PREC: tl.constexpr, PDL: tl.constexpr,
):
    """The dot path's programs (kernels/few_rows_linear._rows_dot_kernel); whichever program holds a
    column tile's whole sums (the only one, or the split's last arriver) writes y and, for columns
    at or past conv_lo, the stash and the conv.

    What the conv needs besides the projection (each tap's row in the tile, the ring values past
    the root, the conv weights) is fetched before the main loop, so its chain of dependent loads
    (tree, parent, grandparent...) runs under the weight stream instead of after it. Under PDL that
    is also before the wait: the tree tables and the committed rings are inputs of the step, which
    no kernel of a verify writes."""
    release_next(PDL)
    c = tl.program_id(0) * BN + tl.arange(0, BN) - conv_lo  # stash column; the conv's channel where c < D
    c_ok = (c >= 0) & (c < D)
    m = tl.arange(0, BM)
    taps = _conv_taps(c, c_ok, m, m < M, cw_ptr, cb_ptr, state_ptr, parents_ptr, cu_ptr, slot_ptr, lens_ptr, n_trees,
                      s_cwd, s_ss, s_sd, HAS_CONV_BIAS, W, TREES)
    m, m_ok, n, n_ok, acc = dot_rows(x_ptr, w_ptr, M, N, K, k_tiles_per_program, s_xm, s_wn, BM, BN, BK, STAGES,
                                     PREC, PDL)
    y_ok = n_ok[:, None] & m_ok[None, :]
    whole = True
    if SPLIT_K:
        acc, whole = add_up_splits(acc, part_ptr, arrive_ptr, m, n, y_ok, N)
    if whole:
        y = store_y(acc, y_ptr + m[None, :] * s_ym + n[:, None], y_ok, b_ptr, n, n_ok, HAS_BIAS)
        first = tl.program_id(0) * BN
        if first + BN > conv_lo:  # this tile holds stashed columns
            tl.store(raw_ptr + m[None, :] * s_rm + c[:, None], y, mask=y_ok & (c >= 0)[:, None])
            if first < conv_lo + D:  # and conv channels
                out = _conv(y.to(tl.float32), taps, W)
                tl.store(conv_ptr + m[None, :] * s_cm + c[:, None], out.to(conv_ptr.dtype.element_ty),
                         mask=c_ok[:, None] & m_ok[None, :])


@triton.jit
def _conv_taps(c, c_ok, m, m_ok, cw_ptr, cb_ptr, state_ptr, parents_ptr, cu_ptr, slot_ptr, lens_ptr, n_trees,
               s_cwd, s_ss, s_sd, HAS_CONV_BIAS: tl.constexpr, W: tl.constexpr, TREES: tl.constexpr):
    """What the conv of the tile's channels c (BN,) at packed rows m (BM,) needs besides the projection:
    (rows, values, weights, bias). For taps s = 1..W-1: rows[s-1] (BM,) the row of the tile it reads,
    -1 past the root, and values[s-1] (BN, BM) fp32 the ring values it reads there (0 elsewhere).
    weights[s] (BN,) fp32 multiplies tap s (conv_weight column W-1-s); bias (BN,) fp32."""
    BM: tl.constexpr = m.shape[0]
    # each row's tree: the number of trees that end at or before it (cu_seqlens[1:] <= row)
    t = tl.arange(0, TREES)
    ends = tl.load(cu_ptr + 1 + t, mask=t < n_trees, other=2147483647)
    tree = tl.minimum(tl.sum((ends[None, :] <= m[:, None]).to(tl.int32), axis=1), n_trees - 1)
    start = tl.load(cu_ptr + tree)
    n_committed = tl.load(lens_ptr + tree)
    ring = state_ptr + tl.load(slot_ptr + tree).to(tl.int64)[None, :] * s_ss + c.to(tl.int64)[:, None] * s_sd

    cur = tl.where(m_ok, m - start, -1)  # local node on the walk, -1 once past the root
    beyond = tl.zeros((BM,), dtype=tl.int32)  # steps taken past the root
    rows = ()
    values = ()
    for s in tl.static_range(1, 4):  # the s-th ancestor
        if s < W:
            cur, beyond = walk_up(parents_ptr, start, cur, beyond)
            on_path = cur >= 0
            col = (n_committed - beyond) % W
            col = tl.where(col < 0, col + W, col)  # position n - beyond, before the first token too
            rows = rows + (tl.where(on_path, start + cur, -1),)
            values = values + (tl.load(ring + col[None, :], mask=c_ok[:, None] & (m_ok & ~on_path)[None, :],
                                       other=0.0).to(tl.float32),)
    weights = ()
    for s in tl.static_range(W):
        weights = weights + (tl.load(cw_ptr + c * s_cwd + (W - 1 - s), mask=c_ok, other=0.0).to(tl.float32),)
    bias = tl.zeros_like(weights[0])
    if HAS_CONV_BIAS:
        bias = tl.load(cb_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    return rows, values, weights, bias


@triton.jit
def _conv(v, taps, W: tl.constexpr):
    """silu(sum_s weights[s] * tap_s + bias) -> (BN, BM) fp32; v (BN, BM) the projection's rounded
    outputs (tap 0, and where the other taps' rows come from), taps from `_conv_taps`."""
    BN: tl.constexpr = v.shape[0]
    BM: tl.constexpr = v.shape[1]
    rows, values, weights, bias = taps
    acc = v * weights[0][:, None]
    for s in tl.static_range(1, W):
        row = rows[s - 1]
        from_tile = tl.gather(v, tl.broadcast_to(tl.maximum(row, 0)[None, :], (BN, BM)), axis=1)
        acc += tl.where((row >= 0)[None, :], from_tile, values[s - 1]) * weights[s][:, None]
    acc += bias[:, None]
    return silu(acc)


# Rows one launch takes: a 16- or 32-row tile of the dot path. A 64-row tile's epilogue outgrows the
# registers of 4 warps (ptxas: 124 bytes of spills on sm_90); with 8 it fits, but a 2.7B verify of
# 48-64 nodes then took 4.15-4.27 ms, against 3.80-4.03 with cuBLAS and the separate conv (H100,
# BENCHMARKS.md thirteenth round).
MAX_CONV_ROWS = 32


def fits(rows: int) -> bool:
    """Whether `project_tree_conv` takes a verify of `rows` packed nodes."""
    return 2 <= rows <= MAX_CONV_ROWS


def project_tree_conv(h, weight, bias, conv_lo, conv_weight, conv_bias, conv_state, parents, cu_seqlens, slot_idx,
                      cache_lens, max_nodes, *, stash, conv_out=None):
    """Triton twin of `project_tree_conv_ref`, for 2..MAX_CONV_ROWS rows (`fits`); `conv_out` (T, D) with
    contiguous channels receives the conv when given."""
    T, K = h.shape
    N = weight.shape[0]
    D, W = conv_weight.shape
    if not fits(T):
        raise ValueError(f"{T} rows: project_tree_conv takes 2..{MAX_CONV_ROWS} (use few_rows_linear and tree_conv1d)")
    if weight.shape[1] != K or h.dtype != weight.dtype:
        raise ValueError(f"h {tuple(h.shape)} {h.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype}")
    if not 0 <= conv_lo <= N - D:
        raise ValueError(f"conv channels [{conv_lo}, {conv_lo + D}) are not columns of a {N}-column projection")
    if not 1 <= W <= 4:
        raise ValueError(f"conv width {W} is not in 1..4")
    if stash.shape != (T, N - conv_lo) or stash.stride(1) != 1:
        raise ValueError(f"stash must be ({T}, {N - conv_lo}) with contiguous columns, got {tuple(stash.shape)}")
    check_ring(conv_state, W)
    if conv_out is None:
        conv_out = torch.empty(T, D, dtype=h.dtype, device=h.device)
    elif conv_out.shape != (T, D) or conv_out.stride(1) != 1:
        raise ValueError("conv_out must be (T, D) with contiguous channels")
    y = torch.empty(T, N, dtype=h.dtype, device=h.device)
    h = last_axis_contiguous(h)
    weight = last_axis_contiguous(weight)
    conv_weight = last_axis_contiguous(conv_weight)
    plan, grid, scratch = dot_grid(T, N, K, y)
    n_trees = cu_seqlens.numel() - 1
    _project_tree_conv_kernel[grid](
        h, weight, bias if bias is not None else weight, y, scratch[0], scratch[1],
        conv_weight, conv_bias if conv_bias is not None else conv_weight, conv_state, as_int32(parents),
        as_int32(cu_seqlens), as_int32(slot_idx), as_int32(cache_lens), conv_out, stash,
        T, N, K, plan["k_tiles_per_program"], conv_lo, D, n_trees,
        h.stride(0), weight.stride(0), y.stride(0), conv_weight.stride(0), conv_state.stride(0), conv_state.stride(1),
        conv_out.stride(0), stash.stride(0),
        BM=plan["BM"], BN=plan["BN"], BK=plan["BK"], STAGES=plan["num_stages"], SPLIT_K=grid[1] > 1,
        HAS_BIAS=bias is not None, HAS_CONV_BIAS=conv_bias is not None, W=W,
        TREES=triton.next_power_of_2(max(n_trees, 1)), PREC=dot_precision(h.dtype),
        **pdl.launch_options(h.device), num_warps=plan["num_warps"],
    )
    return y, conv_out
