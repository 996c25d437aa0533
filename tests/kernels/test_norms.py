"""Residual add + RMSNorm and gated RMSNorm: Triton (interpreted) vs the PyTorch twins vs float64.

The kernels round where the twins round, so they differ only by fp32 summation order: fp32 outputs
by ~1e-7, fp16 outputs by at most one ulp, on rare elements (the residual sum, which has no
reduction, is bit-identical). bf16 is left to tests/gpu: the interpreter does not round to bf16.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import norms
from tests.kernels.interpret_compat import install as _fix_interpreter

_fix_interpreter()

F32, F16 = torch.float32, torch.float16


def _rand(gen, *shape, dtype=F32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _oracle_norm(x, weight, eps):
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _assert_same(got, want, what: str):
    """Equal up to fp32 summation order: fp32 within 2e-6, fp16 within one ulp on under 1% of elements."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.dtype == F16:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6, msg=what)
        assert (got != want).float().mean().item() < 0.01, f"{what}: too many one-ulp differences"
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6, msg=what)


# (residual dtype, block output dtype, weight dtype, norm dtype): Mamba2's fp32 residual stream with
# fp16 blocks, an all-fp16 model, the final norm of an fp32 stream with fp16 weights, all fp32
DTYPES = [(F32, F16, F16, F16), (F16, F16, F16, None), (F32, F16, F16, None), (F32, F32, F32, None)]


@pytest.mark.parametrize("h_dt,o_dt,w_dt,norm_dt", DTYPES)
@pytest.mark.parametrize("T,d,mult", [(1, 16, 1.0), (5, 37, 0.5), (3, 300, 1.0), (2, 1000, 0.3)])
def test_add_rms_norm(h_dt, o_dt, w_dt, norm_dt, T, d, mult):
    gen = torch.Generator().manual_seed(T * d)
    h, out = _rand(gen, T, d, dtype=h_dt, scale=3.0), _rand(gen, T, d, dtype=o_dt)
    weight = _rand(gen, d, dtype=w_dt)
    got_h, got_x = norms.add_rms_norm(h, out, weight, 1e-5, mult, norm_dt)
    ref_h, ref_x = norms.add_rms_norm_ref(h, out, weight, 1e-5, mult, norm_dt)
    assert got_h.dtype == ref_h.dtype and torch.equal(got_h, ref_h), "residual sum"
    _assert_same(got_x, ref_x, "normalised")
    want = _oracle_norm(h.double() + mult * out.double(), weight, 1e-5)
    tol = 2e-6 if {h_dt, o_dt, w_dt} == {F32} else 4e-3
    torch.testing.assert_close(got_x.double(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("h_dt,o_dt,w_dt,norm_dt", DTYPES)
def test_add_rms_norm_with_row_scale(h_dt, o_dt, w_dt, norm_dt):
    """A deferred gated norm's rstd, from its partial sums of squares (37 per row, as many programs
    leave them), scales each row of out (in out's dtype) before the add."""
    gen = torch.Generator().manual_seed(11)
    T, d, count = 4, 96, 5000
    h, out = _rand(gen, T, d, dtype=h_dt, scale=3.0), _rand(gen, T, d, dtype=o_dt, scale=20.0)
    sums = norms.SumOfSquares(torch.rand(T, 37, generator=gen) * 1e4, count, 1e-5)
    weight = _rand(gen, d, dtype=w_dt)
    got_h, got_x = norms.add_rms_norm(h, out, weight, 1e-5, 0.5, norm_dt, out_scale=sums)
    ref_h, ref_x = norms.add_rms_norm_ref(h, out, weight, 1e-5, 0.5, norm_dt, out_scale=sums)
    rstd = torch.rsqrt(sums.parts.double().sum(1) / count + 1e-5)
    want_h = h.double() + 0.5 * out.double() * rstd[:, None]
    tol = 2e-6 if {h_dt, o_dt} == {F32} else 2e-3
    for got, name in ((got_h, "kernel"), (ref_h, "twin")):
        torch.testing.assert_close(got.double(), want_h, rtol=tol, atol=tol * want_h.abs().max().item(), msg=name)
    # the kernel adds the parts in another order than the twin: at most a last-bit difference in rstd
    torch.testing.assert_close(got_h.float(), ref_h.float(), rtol=tol, atol=tol * ref_h.abs().max().item())
    torch.testing.assert_close(got_x.float(), ref_x.float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="out_scale"):
        norms.add_rms_norm(h, out, weight, 1e-5, out_scale=norms.SumOfSquares(sums.parts[:2], count, 1e-5))
    with pytest.raises(ValueError, match="out_scale"):
        norms.add_rms_norm(h, out, weight, 1e-5, out_scale=norms.SumOfSquares(sums.parts.double(), count, 1e-5))


def test_deferred_gated_norm_twin_is_the_norm():
    """rstd * (u @ W.T) == gated_rms_norm(...) @ W.T: what the deferred decode step relies on."""
    gen = torch.Generator().manual_seed(12)
    T, d = 3, 64
    y, z, weight = _rand(gen, T, d), _rand(gen, T, d), _rand(gen, d)
    W = _rand(gen, 16, d)
    u, sums = norms.gated_rms_norm_deferred_ref(y, z, weight, 1e-5, F32)
    want = norms.gated_rms_norm_ref(y, z, weight, d, 1e-5, F32) @ W.T
    torch.testing.assert_close(sums.rstd()[:, None] * (u @ W.T), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [F32, F16])
def test_rms_norm_without_add(dtype):
    gen = torch.Generator().manual_seed(3)
    wide = _rand(gen, 4, 80, dtype=dtype)
    x = wide[:, 10:50]  # strided rows
    weight = _rand(gen, 40, dtype=dtype)
    _assert_same(norms.rms_norm(x, weight, 1e-6), norms.rms_norm_ref(x, weight, 1e-6), "rms_norm")
    h, y = norms.add_rms_norm(x, None, weight, 1e-6)
    assert torch.equal(h, x)
    _assert_same(y, norms.rms_norm_ref(x, weight, 1e-6), "add_rms_norm without out")


def test_fused_block_boundaries_equal_the_unfused_loop():
    """A stack of blocks: fused add + next norm equals `h = h + out; x = rms_norm(h.to(dt))` step by step."""
    gen = torch.Generator().manual_seed(4)
    T, d, n = 3, 48, 4
    weights = [_rand(gen, d, dtype=F16) for _ in range(n + 1)]
    outs = [_rand(gen, T, d, dtype=F16) for _ in range(n)]
    h0 = _rand(gen, T, d, scale=2.0)
    h, xs = h0, []
    for i in range(n):  # the unfused composition, as the runtime ran it before
        xs.append(norms.rms_norm_ref(h.to(F16), weights[i], 1e-5))
        h = h + outs[i] * 0.3
    final = norms.rms_norm_ref(h, weights[n], 1e-6)
    h = h0
    x = norms.rms_norm(h, weights[0], 1e-5, F16)
    for i in range(n):
        _assert_same(x, xs[i], f"block {i} input")
        last = i == n - 1
        h, x = norms.add_rms_norm(h, outs[i], weights[i + 1], 1e-6 if last else 1e-5, 0.3, None if last else F16)
    assert x.dtype == final.dtype == F32
    _assert_same(x, final, "final norm")


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("T,d,group", [(1, 64, 64), (4, 96, 32), (3, 200, 40), (2, 1024, 128)])
def test_gated_rms_norm(dtype, T, d, group):
    gen = torch.Generator().manual_seed(T + d)
    zxbcdt = _rand(gen, T, 3 * d + 7, dtype=dtype)
    z = zxbcdt[:, :d]  # a strided view, as the in_proj split gives it
    y = _rand(gen, T, d, dtype=dtype)
    weight = _rand(gen, d, dtype=dtype)
    got = norms.gated_rms_norm(y, z, weight, group, 1e-5, dtype)
    ref = norms.gated_rms_norm_ref(y, z, weight, group, 1e-5, dtype)
    _assert_same(got, ref, "gated norm")
    g = (y.double() * F.silu(z.double())).view(T, d // group, group)
    want = _oracle_norm(g, torch.ones(group), 1e-5).view(T, d) * weight.double()
    tol = 2e-6 if dtype == F32 else 4e-3
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_empty_and_refused_shapes():
    w = torch.ones(8)
    h, x = norms.add_rms_norm(torch.zeros(0, 8), torch.zeros(0, 8), w, 1e-5)
    assert h.shape == x.shape == (0, 8)
    with pytest.raises(ValueError):
        norms.gated_rms_norm(torch.zeros(2, 10), torch.zeros(2, 10), torch.ones(10), 4, 1e-5, F32)


def test_compiles_for_sm90():
    """At the model shapes (d_model 2560 / 4096, d_inner 5120 ungrouped, bf16), for an H100 without spills."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from tests.kernels.ssm_oracle import assert_compiles_for_sm90

    bf = torch.bfloat16

    def run():
        for d in (2560, 4096):
            w = torch.ones(d, dtype=bf)
            norms.add_rms_norm(torch.randn(2, d), torch.randn(2, d).to(bf), w, 1e-5, 1.0, bf)  # fp32 stream
            norms.add_rms_norm(torch.randn(2, d).to(bf), torch.randn(2, d).to(bf), w, 1e-5, 0.5)
            norms.rms_norm(torch.randn(2, d).to(bf), w, 1e-5)
        y = torch.randn(2, 5120).to(bf)
        norms.gated_rms_norm(y, y, torch.ones(5120, dtype=bf), 5120, 1e-5, bf)
        norms.gated_rms_norm(y[:, :4096], y[:, :4096], torch.ones(4096, dtype=bf), 512, 1e-5, bf)

    assert_compiles_for_sm90([norms._add_rms_norm_kernel, norms._gated_rms_norm_kernel], run)
