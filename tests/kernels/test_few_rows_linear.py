"""The few-row linear kernel (Triton, interpreted) vs its PyTorch twin vs float64, for every row
count it handles, odd sizes that are not block multiples, bias or none, strided rows."""
from __future__ import annotations

import pytest
import torch

from kernels import few_rows_linear as frl
from kernels.few_rows_linear import few_rows_linear, few_rows_linear_ref

F32, F16 = torch.float32, torch.float16
TOL = {F32: 1e-5, F16: 2e-3}  # relative L2 against float64; fp16 rounds the output once


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("M", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("K,N", [(16, 8), (100, 37), (300, 70)])
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_twin_and_float64(monkeypatch, M, K, N, dtype, with_bias):
    monkeypatch.setattr(frl, "ROW_TILES", ((0, 4, 64),))  # several K tiles, the last one partial
    monkeypatch.setattr(frl, "DOT_BLOCK_K", 32)
    gen = torch.Generator().manual_seed(M * 1000 + K + N)
    wide = torch.randn(M, K + 5, generator=gen).to(dtype)
    x = wide[:, 3:3 + K]  # rows with a stride, as a split of a wider activation gives them
    W = (torch.randn(N, K, generator=gen) * K ** -0.5).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if with_bias else None
    got = few_rows_linear(x, W, b)
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
    """The default launches at bf16 (both paths) and fp32 (the dot path's tf32x3), without register
    spills on an H100."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from tests.kernels.ssm_oracle import assert_compiles_for_sm90

    def run_all():
        for dtype in (torch.bfloat16, F32):
            W = torch.randn(64, 2560).to(dtype)
            for M in (1, 16):
                few_rows_linear(torch.randn(M, 2560).to(dtype), W)

    assert_compiles_for_sm90([frl._one_row_kernel, frl._rows_dot_kernel], run_all)
