"""The gated MLP activation in one pass (Triton, interpreted) against torch's `F.silu(gate) * up`:
strided rows, widths that are not block multiples, every element written, fp32 and fp16 (bf16 runs
on the GPU: tests/gpu/test_mlp_gpu.py), and the MLP block using it."""
from __future__ import annotations

import pytest
import torch

from kernels import ssm_common
from kernels.silu_mul import BLOCK_I, silu_mul, silu_mul_ref
from tests.kernels.ssm_oracle import nan_output

ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10}


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("I", [5, BLOCK_I + 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_the_torch_composition(T, I, dtype, monkeypatch):
    monkeypatch.setattr(ssm_common, "new_output", nan_output)  # unwritten elements stay NaN
    gen = torch.Generator().manual_seed(T * 1000 + I)
    buf = (torch.randn(T, 2 * I + 6, generator=gen) * 3).to(dtype)
    gate_up = buf[:, 3:3 + 2 * I]  # strided rows
    got, want = silu_mul(gate_up), silu_mul_ref(gate_up)
    assert got.shape == (T, I) and got.dtype == dtype and torch.isfinite(got).all()
    # the same two roundings; exp may differ in its last fp32 bit, which a half-precision rounding
    # of silu(gate) mostly absorbs
    torch.testing.assert_close(got, want, rtol=4 * ULP[dtype], atol=1e-6)
    if dtype == torch.float16:
        assert (got != want).float().mean().item() < 0.05


def test_refuses_odd_widths_and_handles_empty():
    with pytest.raises(ValueError, match="gate\\|up"):
        silu_mul(torch.zeros(2, 7))
    assert silu_mul(torch.zeros(0, 8)).shape == (0, 4)


def test_the_mlp_block_takes_the_fused_path(monkeypatch):
    """A gated SiLU MLP goes through ops.silu_mul; with the Triton kernels forced on the CPU it
    matches the unfused composition."""
    from models.config import MLPSpec
    from models.layers import mlp as mlp_mod

    torch.manual_seed(0)
    block = mlp_mod.MLP(MLPSpec(40, "silu", gated=True, bias=False), 24, torch.float32)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(6, 24)
    calls = []
    real = mlp_mod.ops.silu_mul
    monkeypatch.setattr(mlp_mod.ops, "silu_mul", lambda gu: calls.append(gu.shape) or real(gu))
    monkeypatch.setenv("TREESERVE_KERNELS", "triton")
    got = block(x)
    gate, up = block.gate_up_proj(x).chunk(2, dim=-1)
    want = block.down_proj(torch.nn.functional.silu(gate) * up)
    assert calls == [(6, 80)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_compiles_for_sm90():
    """At the 8B hybrid's MLP width, bf16, 16 rows."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from kernels import silu_mul as module
    from tests.kernels.ssm_oracle import assert_compiles_for_sm90

    assert_compiles_for_sm90([module._silu_mul_kernel],
                             lambda: module.silu_mul(torch.randn(16, 2 * 14336).to(torch.bfloat16)))
