"""The few-row linear kernel (Triton, interpreted) vs its PyTorch twin vs float64, for every row
count it handles, odd sizes that are not block multiples, bias or none, strided rows, the reduction
unsplit and split across programs (split-K with the last arriver's sum)."""
from __future__ import annotations

import pytest
import torch

from kernels import few_rows_linear as frl
from kernels.few_rows_linear import few_rows_linear, few_rows_linear_ref

F32, F16 = torch.float32, torch.float16
TOL = {F32: 1e-5, F16: 2e-3}  # relative L2 against float64; fp16 rounds the output once


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def small_tiles(programs: int) -> dict:
    """Several column and K tiles at test sizes."""
    return {bm: frl.DotTile(16, 32, 4, 2, programs) for bm in (16, 32, 64)}


# (rows, programs the reduction may be split over: 1 whole, 1000 as finely as it goes); one row has
# no split
ROW_CASES = [(1, 1)] + [(M, programs) for M in (2, 5, 33, 64) for programs in (1, 1000)]


@pytest.mark.parametrize("M,programs", ROW_CASES)
@pytest.mark.parametrize("K,N", [(16, 8), (100, 37), (300, 70)])
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_twin_and_float64(monkeypatch, M, K, N, dtype, with_bias, programs):
    monkeypatch.setattr(frl, "ROW_TILES", ((0, 4, 64),))  # several K tiles, the last one partial
    monkeypatch.setattr(frl, "DOT_TILES", small_tiles(programs))
    monkeypatch.setattr(frl.SplitWorkspace, "_by_device", {})
    gen = torch.Generator().manual_seed(M * 1000 + K + N)
    wide = torch.randn(M, K + 5, generator=gen).to(dtype)
    x = wide[:, 3:3 + K]  # rows with a stride, as a split of a wider activation gives them
    W = (torch.randn(N, K, generator=gen) * K ** -0.5).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if with_bias else None
    poisoned = torch.full((M, N), float("nan"), dtype=dtype)  # unwritten elements stay NaN
    got = few_rows_linear(x, W, b, out=poisoned)
    assert got is poisoned
    ref = few_rows_linear_ref(x, W, b)
    want = x.double() @ W.double().t() + (b.double() if b is not None else 0)
    assert got.dtype == dtype and got.shape == (M, N) and not got.isnan().any()
    assert rel(got, want) < TOL[dtype] and rel(ref, want) < TOL[dtype]
    assert rel(got, ref) < TOL[dtype]


def test_one_row_tiles_by_output_width():
    assert [frl.one_row_tile(n) for n in (10576, 4096, 2560, 2048, 1024, 1)] == [
        (4, 1024), (4, 1024), (2, 1024), (2, 1024), (1, 2048), (1, 2048)]


def test_refused_shapes_and_no_rows():
    W = torch.randn(8, 16)
    with pytest.raises(ValueError, match="at most"):
        few_rows_linear(torch.zeros(frl.MAX_ROWS + 1, 16), W)
    assert few_rows_linear(torch.zeros(0, 16), W).shape == (0, 8)
    with pytest.raises(ValueError, match="columns"):
        few_rows_linear(torch.zeros(1, 15), W)
    with pytest.raises(ValueError, match="dtype|float16"):
        few_rows_linear(torch.zeros(1, 16, dtype=F16), W)


def test_compiles_for_sm90():
    """The default launches at bf16 (both paths, 16- and 64-row dot tiles, split) and fp32 (the dot
    path's tf32x3), without register spills on an H100."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from tests.kernels.ssm_oracle import assert_compiles_for_sm90

    def run_all():
        for dtype in (torch.bfloat16, F32):
            W = torch.randn(64, 2560).to(dtype)
            for M in (1, 16, 64):
                few_rows_linear(torch.randn(M, 2560).to(dtype), W)

    assert_compiles_for_sm90([frl._one_row_kernel, frl._rows_dot_kernel], run_all)


@pytest.mark.parametrize("M,N,K", [(16, 10576, 2560), (16, 2560, 5120), (64, 4096, 14336), (2, 8, 16),
                                   (33, 50288, 2560)])
def test_dot_launch_covers_the_reduction(M, N, K):
    """Every split is non-empty, the splits cover K, and their width is whole BK tiles."""
    plan = frl.dot_launch(M, N, K, 2)
    width = plan["k_tiles_per_program"] * plan["BK"]
    assert plan["BM"] >= M and (plan["splits"] - 1) * width < K <= plan["splits"] * width


def test_split_reduction_is_repeatable_and_leaves_counters_at_zero(monkeypatch):
    """The last arriver sums the partials in split order, so two launches agree bit for bit, and
    every arrival counter is back at zero for the next launch."""
    monkeypatch.setattr(frl, "DOT_TILES", small_tiles(1000))
    monkeypatch.setattr(frl.SplitWorkspace, "_by_device", {})
    gen = torch.Generator().manual_seed(5)
    x, W = torch.randn(5, 300, generator=gen).to(F16), torch.randn(70, 300, generator=gen).to(F16)
    a, b = few_rows_linear(x, W), few_rows_linear(x, W)
    assert torch.equal(a, b)
    parts, arrivals = frl.SplitWorkspace._by_device[x.device]
    assert frl.dot_launch(5, 70, 300, 2)["splits"] > 1 and not arrivals.any()


def test_workspace_grows_and_keeps_what_it_outgrew(monkeypatch):
    """A grown workspace keeps the old buffers alive: CUDA graphs captured before still use them."""
    W = frl.SplitWorkspace
    monkeypatch.setattr(W, "_by_device", {})
    monkeypatch.setattr(W, "_retired", [])
    monkeypatch.setattr(W, "MIN_PARTS", 8)
    monkeypatch.setattr(W, "MIN_TILES", 2)
    dev = torch.device("cpu")
    first = W.get(dev, 4, 1)
    assert W.get(dev, 8, 2) is first
    grown = W.get(dev, 100, 3)
    assert grown[0].numel() >= 100 and grown[1].numel() >= 3 and not grown[1].any()
    assert W._retired == [first]
