"""Fused q/k RoPE (Triton, interpreted) vs its twin (transformers' rotate-half composition) vs float64,
full and partial rotary, strided q/k views as the qkv split gives them, positions far from zero."""
from __future__ import annotations

import pytest
import torch

from kernels.rope import rope_inv_freq, rope_qk, rope_qk_ref

F32, F16 = torch.float32, torch.float16


def oracle(x, positions, inv_freq):
    half = inv_freq.shape[0]
    # the angle as transformers forms it, in fp32 (at position 4095 its rounding alone moves the
    # output by ~1e-4); everything after it in float64
    ang = (positions.float()[:, None] * inv_freq.float()[None, :]).double()  # (T, half)
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x = x.double()
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("Dh,rotary", [(16, 16), (32, 16), (24, 8)])
def test_matches_twin_and_float64(dtype, Dh, rotary):
    gen = torch.Generator().manual_seed(Dh + rotary)
    T, Hq, Hk = 5, 4, 2
    qkv = torch.randn(T, (Hq + 2 * Hk) * Dh, generator=gen).to(dtype)
    q = qkv[:, : Hq * Dh].view(T, Hq, Dh)  # strided views, as Attention._qkv makes them
    k = qkv[:, Hq * Dh: (Hq + Hk) * Dh].view(T, Hk, Dh)
    positions = torch.tensor([0, 1, 7, 4095, 100_000])  # the kernel reduces large angles itself
    inv_freq = rope_inv_freq(rotary, 10000.0)
    got_q, got_k = rope_qk(q, k, positions, inv_freq)
    ref_q, ref_k = rope_qk_ref(q, k, positions, inv_freq)
    tol = 2e-6 if dtype == F32 else 2e-3  # fp16: the twin rounds cos, sin and each product
    for got, ref, x in ((got_q, ref_q, q), (got_k, ref_k, k)):
        assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
        torch.testing.assert_close(got.double(), ref.double(), rtol=tol, atol=tol)
        torch.testing.assert_close(got.double(), oracle(x, positions, inv_freq), rtol=4 * tol, atol=4 * tol)
    assert torch.equal(got_q[..., rotary:], q[..., rotary:])  # partial rotary passes the rest through


def test_no_tokens_and_refused_shapes():
    inv = rope_inv_freq(16, 10000.0)
    q, k = rope_qk(torch.zeros(0, 2, 16), torch.zeros(0, 1, 16), torch.zeros(0, dtype=torch.long), inv)
    assert q.shape == (0, 2, 16) and k.shape == (0, 1, 16)
    with pytest.raises(ValueError):
        rope_qk(torch.zeros(2, 2, 8), torch.zeros(2, 1, 8), torch.zeros(2, dtype=torch.long), inv)  # R > Dh


def test_compiles_for_sm90():
    """At the 8B hybrid's attention shape (32 + 8 heads of 128, full rotary, bf16), without spills."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from kernels import rope
    from tests.kernels.ssm_oracle import assert_compiles_for_sm90

    def run_all():
        x = torch.randn(2, 40, 128).to(torch.bfloat16)
        rope.rope_qk(x[:, :32], x[:, 32:], torch.tensor([3, 9]), rope_inv_freq(128, 10000.0))

    assert_compiles_for_sm90([rope._rope_kernel], run_all)
