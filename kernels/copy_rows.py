"""Two row copies in one launch: dst_a <- src_a and dst_b <- src_b.

A verify stashes two blocks per Mamba2 layer for the commit (models/verify.py, `VerifyStash`). As
torch copies they were two launches per layer, ~2.3 us each at 16 nodes on an H200 (128 per verify
of the 2.7B shape), and each one also broke the chain of programmatically dependent launches
(kernels/pdl.py) the layer's other kernels form. Here one launch copies both.

    dst_a (T, Wa) <- src_a (T, Wa), dst_b (T, Wb) <- src_b (T, Wb): rows may be strided, the
    destinations' last axis contiguous; values are converted to dst's dtype as `Tensor.copy_` converts them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import release_next, wait_for_previous
from kernels.ssm_common import last_axis_contiguous

BLOCK_T, BLOCK_W = 4, 512  # rows x columns per program: 16 elements per thread at 4 warps


def copy_rows_pair_ref(dst_a: torch.Tensor, src_a: torch.Tensor, dst_b: torch.Tensor, src_b: torch.Tensor) -> None:
    """PyTorch twin of `copy_rows_pair` (in place)."""
    dst_a.copy_(src_a)
    dst_b.copy_(src_b)


@triton.jit
def _copy_pair_kernel(da_ptr, sa_ptr, db_ptr, sb_ptr, T, Wa, Wb, s_da, s_sa, s_db, s_sb,
                      BT: tl.constexpr, BW: tl.constexpr, PDL: tl.constexpr):
    """Programs (row tile, column tile, which pair); a column tile past a pair's width does nothing."""
    release_next(PDL)
    wait_for_previous(PDL)  # the sources are the kernels before's outputs
    rows = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    cols = tl.program_id(1) * BW + tl.arange(0, BW)
    if tl.program_id(2) == 0:
        dst, src, W, s_d, s_s = da_ptr, sa_ptr, Wa, s_da, s_sa
    else:
        dst, src, W, s_d, s_s = db_ptr, sb_ptr, Wb, s_db, s_sb
    ok = (rows < T)[:, None] & (cols < W)[None, :]
    v = tl.load(src + rows[:, None] * s_s + cols[None, :], mask=ok)
    tl.store(dst + rows[:, None] * s_d + cols[None, :], v.to(dst.dtype.element_ty), mask=ok)


def copy_rows_pair(dst_a: torch.Tensor, src_a: torch.Tensor, dst_b: torch.Tensor, src_b: torch.Tensor) -> None:
    """Triton `copy_rows_pair`: same contract as the twin. Both pairs have T rows; each pair's
    destination and source have one shape; the destinations share a dtype, as do the sources."""
    T = dst_a.shape[0]
    src_a, src_b = last_axis_contiguous(src_a), last_axis_contiguous(src_b)
    for dst, src in ((dst_a, src_a), (dst_b, src_b)):
        if dst.dim() != 2 or dst.shape != src.shape or dst.shape[0] != T:
            raise ValueError(f"copy_rows_pair: shapes {tuple(dst.shape)} <- {tuple(src.shape)} (T = {T})")
        if dst.stride(1) != 1:
            raise ValueError("copy_rows_pair: the destinations' last axis must be contiguous")
    if dst_a.dtype != dst_b.dtype or src_a.dtype != src_b.dtype:
        raise ValueError("copy_rows_pair: the two pairs must have the same dtypes")
    Wa, Wb = dst_a.shape[1], dst_b.shape[1]
    if T == 0 or max(Wa, Wb) == 0:
        return
    _copy_pair_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(max(Wa, Wb), BLOCK_W), 2)](
        dst_a, src_a, dst_b, src_b, T, Wa, Wb,
        dst_a.stride(0), src_a.stride(0), dst_b.stride(0), src_b.stride(0),
        BT=BLOCK_T, BW=BLOCK_W, **pdl.launch_options(dst_a.device), num_warps=4,
    )
