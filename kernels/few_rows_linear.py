"""A linear layer for a few rows (decode batches, small trees): y = x W^T (+ bias), read as a weight
stream.

At a few tokens a projection's cost is reading W once. cuBLAS answers these shapes with split-K GEMM
kernels plus a reduction launch, and at the Mamba2-2.7B and 8B-hybrid projection shapes they read W
at 1.2-2.6x the copy floor on an H200 (BENCHMARKS.md). Here each program owns BN output columns and
streams its BN rows of W (contiguous along K) in BK-wide tiles, once:
- one row: no tensor cores, one fp32 partial sum per output column and lane, reduced at the end;
- 2..MAX_ROWS rows: the rows padded to a 16-row tile and a tensor-core dot per W tile.

    x (M, K) rows may be strided, weight (N, K), bias (N,) or None -> y (M, N) in x's dtype,
    fp32 accumulation, one rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import release_next, wait_for_previous
from kernels.ssm_common import dot_precision, last_axis_contiguous

MAX_ROWS = 16  # rows of x one launch handles (one 16-row dot tile)
# One row: (least N, BN output columns, BK reduction width) per program, by the layer's output
# width N, and warps per program. From an H200 sweep timed the way decode runs them (a CUDA graph of
# back-to-back launches under PDL: `python -m bench.few_rows_linear --in-graph`): within 1.05x of the
# best of 31 configurations on every projection shape of the 2.7B and 8B benchmark models.
# Narrower programs for narrow layers keep enough of them loading at once; each thread keeps 16-32
# fp32 partial sums.
ROW_TILES = ((4096, 4, 1024), (2048, 2, 1024), (0, 1, 2048))
ROW_WARPS = 4
# the same for the dot path (2..MAX_ROWS rows), and its pipeline depth
DOT_BLOCK_N, DOT_BLOCK_K, DOT_WARPS, DOT_STAGES = 32, 256, 4, 4


def few_rows_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch twin of `few_rows_linear`: fp32 products and sums, rounded once to x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@triton.jit
def _one_row_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, s_wn, BN: tl.constexpr, BK: tl.constexpr,
                    HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    release_next(PDL)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = n < N
    k = tl.arange(0, BK)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * s_wn
    # the first weight tile does not depend on the kernel before: under PDL it loads while that
    # kernel finishes. Each weight element is read once, by one program: do not keep it in L2 at
    # x's expense.
    w0 = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0, eviction_policy="evict_first")
    wait_for_previous(PDL)
    acc = w0.to(tl.float32) * tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
    for k0 in range(BK, K, BK):
        kk = k0 + k
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        acc += w * tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _rows_dot_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, s_xm, s_wn, s_ym, BN: tl.constexpr,
                     BK: tl.constexpr, STAGES: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
                     PDL: tl.constexpr):
    release_next(PDL)
    BM: tl.constexpr = 16  # the smallest dot tile; rows past M are masked to zero
    m = tl.arange(0, BM)
    m_ok = m < M
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = n < N
    k = tl.arange(0, BK)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * s_wn
    # as in the one-row kernel: the first weight tile does not depend on the kernel before, so under
    # PDL it loads while that kernel finishes; x may come from it
    w0 = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0, eviction_policy="evict_first")
    wait_for_previous(PDL)
    x0 = tl.load(x_ptr + m[:, None] * s_xm + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
    acc = tl.dot(x0, tl.trans(w0), tl.zeros((BM, BN), dtype=tl.float32), input_precision=PREC)
    for k0 in tl.range(BK, K, BK, num_stages=STAGES):
        kk = k0 + k
        k_ok = kk < K
        x = tl.load(x_ptr + m[:, None] * s_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * s_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def one_row_tile(N: int) -> tuple[int, int]:
    """(BN, BK) of the one-row kernel for a layer of N outputs (see ROW_TILES)."""
    return next((bn, bk) for least, bn, bk in ROW_TILES if N >= least)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None):
    """Triton `few_rows_linear`: same contract as the twin, for up to MAX_ROWS rows; x and weight of
    one dtype. Keyword-only tuning knobs are for the benchmark sweep."""
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"x has {K} columns, weight {tuple(weight.shape)} expects {weight.shape[1]}")
    if M > MAX_ROWS:
        raise ValueError(f"{M} rows: few_rows_linear takes at most {MAX_ROWS} (use F.linear)")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    x = last_axis_contiguous(x)
    weight = last_axis_contiguous(weight)
    b = bias if bias is not None else weight
    if M == 1:
        bn, bk = one_row_tile(N)
        bn, bk = block_n or bn, block_k or bk
        _one_row_kernel[(triton.cdiv(N, bn),)](
            x, weight, b, y, N, K, weight.stride(0), BN=bn, BK=bk,
            HAS_BIAS=bias is not None, **pdl.launch_options(x.device), num_warps=num_warps or ROW_WARPS,
        )
        return y
    bn = block_n or DOT_BLOCK_N
    # fp32 operands take three tf32 passes (near-fp32 sums) and twice the bytes per tile: narrower
    # tiles keep the pipelined loop out of local memory
    bk = block_k or (DOT_BLOCK_K if x.element_size() == 2 else 64)
    _rows_dot_kernel[(triton.cdiv(N, bn),)](
        x, weight, b, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0), BN=bn, BK=bk,
        STAGES=num_stages or DOT_STAGES, HAS_BIAS=bias is not None,
        PREC=dot_precision(x.dtype), **pdl.launch_options(x.device),
        num_warps=num_warps or DOT_WARPS,
    )
    return y
