"""A linear layer for a few rows (decode batches, small trees): y = x W^T (+ bias), read as a weight
stream.

At a few tokens a projection's cost is reading W once. cuBLAS answers these shapes with split-K GEMM
kernels plus a reduction launch, and at the Mamba2-2.7B and 8B-hybrid projection shapes they read W
at 1.2-2.6x the copy floor on an H200 (BENCHMARKS.md). Here each weight element is read once, by
one program:
- one row: each program owns BN output columns and streams its BN rows of W (contiguous along K) in
  BK-wide tiles; no tensor cores, one fp32 partial sum per output column and lane, reduced at the end;
- 2..MAX_ROWS rows: the rows padded to a 16/32/64-row tile and a tensor-core dot per W tile, W the
  MMA's wide left operand. Every
  program re-reads x for its columns, so x's traffic is M/BN of W's: the column tiles are wide, and
  the reduction is split across programs (split-K) so that a narrow layer still has enough programs
  streaming. A column tile's last program to finish adds the partial sums (in split order, so the
  result does not depend on timing) and writes y: one launch, no separate reduction kernel.

    x (M, K) rows may be strided, weight (N, K), bias (N,) or None -> y (M, N) in x's dtype,
    fp32 accumulation, one rounding.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import release_next, wait_for_previous
from kernels.ssm_common import dot_precision, last_axis_contiguous

MAX_ROWS = 64  # rows of x one launch handles (one 64-row dot tile)
# One row: (least N, BN output columns, BK reduction width) per program, by the layer's output
# width N, and warps per program. From an H200 sweep timed the way decode runs them (a CUDA graph of
# back-to-back launches under PDL: `python -m bench.few_rows_linear --in-graph`): within 1.05x of the
# best of 31 configurations on every projection shape of the 2.7B and 8B benchmark models.
# Narrower programs for narrow layers keep enough of them loading at once; each thread keeps 16-32
# fp32 partial sums.
ROW_TILES = ((4096, 4, 1024), (2048, 2, 1024), (0, 1, 2048))
ROW_WARPS = 4


class DotTile(NamedTuple):
    """A dot-path launch: BN output columns and BK reduction width per program, warps, pipeline
    stages; the reduction is split into as many parts as keep the launch within `programs` programs
    (at least one part; never finer than one BK tile per program)."""
    block_n: int
    block_k: int
    warps: int
    stages: int
    programs: int


# The dot path (2..MAX_ROWS rows), by its row tile BM (16, 32, 64): the best geometric mean over the
# benchmark models' projection shapes at 16 rows of an H200 sweep of 18 tiles (`python -m
# bench.few_rows_linear --in-graph --rows 16`, CUDA graphs under PDL). At most 264 programs is two per
# SM; a launch that leaves some SMs a third program waits on them (the 2.7B out_proj at 16 rows: 13.9 µs
# in 280 programs, 10.0 in 240).
DOT_TILES = {bm: DotTile(64, 128, 4, 3, 264) for bm in (16, 32, 64)}


def few_rows_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch twin of `few_rows_linear`: fp32 products and sums, rounded once to x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class SplitWorkspace:
    """Per-device scratch of the split-K dot path: fp32 partial sums and per-column-tile arrival
    counters (zero between launches; each launch leaves them at zero). Kernels on one device's
    stream run one after another (under PDL a kernel writes only after the previous one completed),
    so one buffer serves every layer. A split launch needs about programs x BN x BM partial sums,
    whatever the layer, so the first buffer is sized for any default launch.
    - It grows outside CUDA graph capture only: a launch captured into a graph must not allocate,
      so a capture that finds it too small runs unsplit instead (the runtime's warm-up pass before
      capture sizes it).
    - A buffer it outgrows is kept, never freed: graphs captured earlier still write to it."""

    MIN_PARTS = 1 << 20  # fp32 partial sums (4 MiB)
    MIN_TILES = 1 << 14
    _by_device: dict = {}
    _retired: list = []

    @classmethod
    def get(cls, device: torch.device, part_numel: int, tiles: int):
        """(parts fp32, arrivals int32) of at least these sizes on `device`, or None during a capture
        that would need them to grow."""
        have = cls._by_device.get(device)
        if have is not None and have[0].numel() >= part_numel and have[1].numel() >= tiles:
            return have
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if have is not None:
            cls._retired.append(have)
        part_numel = max(part_numel, 2 * have[0].numel() if have else cls.MIN_PARTS)
        tiles = max(tiles, 2 * have[1].numel() if have else cls.MIN_TILES)
        cls._by_device[device] = (torch.empty(part_numel, dtype=torch.float32, device=device),
                                  torch.zeros(tiles, dtype=torch.int32, device=device))
        return cls._by_device[device]


def dot_launch(M: int, N: int, K: int, elem_bytes: int, **override) -> dict:
    """The dot path's launch for M (2..MAX_ROWS) rows of a (N, K) weight: BM, BN, BK, warps,
    stages, splits of K and the BK-wide reduction tiles per program (only the last
    split may reach past K). `override`: DotTile fields to replace (the benchmark's sweep)."""
    bm = max(16, triton.next_power_of_2(M))
    tile = DOT_TILES[bm]
    if elem_bytes > 2:
        # fp32 operands take three tf32 passes and twice the bytes per tile: narrower tiles keep
        # the pipelined loop out of local memory
        tile = tile._replace(block_n=32, block_k=64)
    tile = tile._replace(**{k: v for k, v in override.items() if v is not None})
    k_tiles = triton.cdiv(K, tile.block_k)
    want = max(1, tile.programs // triton.cdiv(N, tile.block_n))
    per = triton.cdiv(k_tiles, min(want, k_tiles))
    return dict(BM=bm, BN=tile.block_n, BK=tile.block_k, num_warps=tile.warps, num_stages=tile.stages,
                splits=triton.cdiv(k_tiles, per), k_tiles_per_program=per)


def dot_grid(M: int, N: int, K: int, y: torch.Tensor, **override) -> tuple[dict, tuple[int, int], tuple]:
    """A dot-path launch of M rows of a (N, K) weight into y (M, N): (`dot_launch`'s plan, grid
    (column tiles, splits), (partial sums, arrival counters)). A split launch takes them from the
    device's `SplitWorkspace`; a capture that finds it too small runs unsplit, one program per
    column tile over the whole reduction (the plan says so, and the scratch is y, never read)."""
    plan = dot_launch(M, N, K, y.element_size(), **override)
    tiles_n, splits = triton.cdiv(N, plan["BN"]), plan["splits"]
    scratch = SplitWorkspace.get(y.device, splits * plan["BM"] * N, tiles_n) if splits > 1 else None
    if scratch is None:
        splits, plan["k_tiles_per_program"] = 1, triton.cdiv(K, plan["BK"])
        scratch = (y, y)
    return plan, (tiles_n, splits), scratch


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


@triton.jit(do_not_specialize=["M"])  # sizes that change per call: one compile serves them all
def _rows_dot_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, arrive_ptr, M, N, K, k_tiles_per_program,
                     s_xm, s_wn, s_ym, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     STAGES: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     PREC: tl.constexpr, PDL: tl.constexpr):
    """Program (n, s) owns output columns n*BN.. and the reduction's BK-wide tiles
    s*k_tiles_per_program.. (past K: masked to zero); with SPLIT_K the partial sums go to part
    (splits, BM, N) fp32 and the column tile's last program to arrive (arrive_ptr[n], left at zero)
    adds them up and writes y."""
    release_next(PDL)
    m, m_ok, n, n_ok, acc = dot_rows(x_ptr, w_ptr, M, N, K, k_tiles_per_program, s_xm, s_wn, BM, BN, BK, STAGES,
                                     PREC, PDL)
    y_ok = n_ok[:, None] & m_ok[None, :]
    whole = True
    if SPLIT_K:
        acc, whole = add_up_splits(acc, part_ptr, arrive_ptr, m, n, y_ok, N)
    if whole:
        store_y(acc, y_ptr + m[None, :] * s_ym + n[:, None], y_ok, b_ptr, n, n_ok, HAS_BIAS)


@triton.jit
def dot_rows(x_ptr, w_ptr, M, N, K, k_tiles_per_program, s_xm, s_wn, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, STAGES: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    """The dot path's main loop for program (n, s) -> (m (BM,), m_ok, n (BN,), n_ok, acc (BN, BM) fp32):
    this program's share of y^T for output columns n and rows m. It waits for the kernel before
    (PDL) after issuing its first weight tile.

    The weight tile is the MMA's left operand and the few rows its right one, so the accumulator
    and every (column, row) offset are laid out (BN, BM): Hopper's warpgroup MMA needs a left operand
    of 64 or more rows, which BM rows of x are not (rows first, Triton falls back to mma.sync)."""
    m = tl.arange(0, BM)  # rows past M are masked to zero
    m_ok = m < M
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = n < N
    k_lo = tl.program_id(1) * k_tiles_per_program * BK
    k = k_lo + tl.arange(0, BK)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * s_wn
    # as in the one-row kernel: the first weight tile does not depend on the kernel before, so under
    # PDL it loads while that kernel finishes; x may come from it
    w0 = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0,
                 eviction_policy="evict_first")
    wait_for_previous(PDL)
    x0 = tl.load(x_ptr + m[:, None] * s_xm + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
    acc = tl.dot(w0, tl.trans(x0), tl.zeros((BN, BM), dtype=tl.float32), input_precision=PREC)
    for t in tl.range(1, k_tiles_per_program, num_stages=STAGES):
        kk = k_lo + t * BK + tl.arange(0, BK)
        k_ok = kk < K
        x = tl.load(x_ptr + m[:, None] * s_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PREC)
    return m, m_ok, n, n_ok, acc


@triton.jit
def add_up_splits(acc, part_ptr, arrive_ptr, m, n, y_ok, N):
    """Split-K: leave this program's (BN, BM) partial sums in part (splits, BM, N) fp32 and count its
    arrival on its column tile (arrive_ptr[column tile], left at zero) -> (the column tile's whole
    sums, whether this program arrived last). Only the last program's sums are whole: it adds the
    partials in split order, so the result does not depend on timing."""
    BM: tl.constexpr = acc.shape[1]
    parts = part_ptr + m[None, :] * N + n[:, None]  # + split * BM * N
    tl.store(parts + tl.program_id(1) * BM * N, acc, mask=y_ok)
    # every store of this program is done (barrier) before its arrival is published (release);
    # the last arriver's acquire makes the other programs' partial sums visible to it
    tl.debug_barrier()
    arrived = tl.atomic_add(arrive_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
    last = arrived == tl.num_programs(1) - 1
    if last:
        acc = tl.zeros_like(acc)
        for s in range(tl.num_programs(1)):
            acc += tl.load(parts + s * BM * N, mask=y_ok, other=0.0, cache_modifier=".cg")
        tl.store(arrive_ptr + tl.program_id(0), 0)  # ready for the next launch
    return acc, last


@triton.jit
def store_y(acc, y_at, y_ok, b_ptr, n, n_ok, HAS_BIAS: tl.constexpr):
    """acc (BN, BM) (+ bias along the output columns n), rounded once, to y -> the stored (BN, BM)
    values in y's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y = acc.to(y_at.dtype.element_ty)
    tl.store(y_at, y, mask=y_ok)
    return y


def one_row_tile(N: int) -> tuple[int, int]:
    """(BN, BK) of the one-row kernel for a layer of N outputs (see ROW_TILES)."""
    return next((bn, bk) for least, bn, bk in ROW_TILES if N >= least)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    out: torch.Tensor | None = None, **tile):
    """Triton `few_rows_linear`: same contract as the twin, for up to MAX_ROWS rows; x and weight of
    one dtype; y written into `out` (M, N) contiguous when given. `tile`: the launch's tuning knobs
    (`DotTile` fields, or block_n / block_k / warps for one row), for the benchmark sweep."""
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"x has {K} columns, weight {tuple(weight.shape)} expects {weight.shape[1]}")
    if M > MAX_ROWS:
        raise ValueError(f"{M} rows: few_rows_linear takes at most {MAX_ROWS} (use F.linear)")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}")
    if out is not None and (out.shape != (M, N) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous ({M}, {N}) {x.dtype} tensor")
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    x = last_axis_contiguous(x)
    weight = last_axis_contiguous(weight)
    b = bias if bias is not None else weight
    if M == 1:
        bn, bk = one_row_tile(N)
        bn, bk = tile.get("block_n") or bn, tile.get("block_k") or bk
        _one_row_kernel[(triton.cdiv(N, bn),)](
            x, weight, b, y, N, K, weight.stride(0), BN=bn, BK=bk,
            HAS_BIAS=bias is not None, **pdl.launch_options(x.device), num_warps=tile.get("warps") or ROW_WARPS,
        )
        return y
    plan, grid, scratch = dot_grid(M, N, K, y, **tile)
    _rows_dot_kernel[grid](
        x, weight, b, y, scratch[0], scratch[1], M, N, K, plan["k_tiles_per_program"], x.stride(0),
        weight.stride(0), y.stride(0), BM=plan["BM"], BN=plan["BN"], BK=plan["BK"],
        STAGES=plan["num_stages"], SPLIT_K=grid[1] > 1, HAS_BIAS=bias is not None,
        PREC=dot_precision(x.dtype), **pdl.launch_options(x.device), num_warps=plan["num_warps"],
    )
    return y
