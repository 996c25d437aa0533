"""The gated MLP activation (kernels/silu_mul.py) on CUDA at the 8B hybrid's MLP width, bf16: against
torch's `F.silu(gate) * up` on the same device, which rounds at the same two places.

    TRITON_INTERPRET=0 python -m pytest -q tests/gpu/test_mlp_gpu.py
"""
import pytest
import torch

from kernels.silu_mul import silu_mul, silu_mul_ref
from tests.gpu.marks import compiled_triton, gpu  # noqa: F401 (fixture)

DEV, BF16 = "cuda", torch.bfloat16


@gpu
@pytest.mark.parametrize("T", [1, 16, 64, 129])
def test_matches_torch_on_the_gpu(T):
    gen = torch.Generator(device=DEV).manual_seed(T)
    I = 14336
    gate_up = (torch.randn(T, 2 * I + 8, device=DEV, generator=gen) * 3).to(BF16)[:, 8:]  # strided rows
    got, want = silu_mul(gate_up), silu_mul_ref(gate_up)
    # exp may differ in its last fp32 bit, which can move silu(gate) by one bf16 ulp, rarely
    torch.testing.assert_close(got, want, rtol=2 * 2.0 ** -7, atol=1e-3)
    assert (got != want).float().mean().item() < 0.01


@gpu
def test_the_kernels_silu_over_the_whole_fp32_range():
    """The SiLU every kernel applies (kernels.ssm_common.silu: exp2 and an approximate division on
    the GPU), through silu_mul in fp32 with up = 1, against float64. Its error is that of the
    exponential's fp32 argument, about |z| * 6e-8 relative (as `tl.exp`'s, which also scales by
    log2 e), plus a few ulp; past |1 + e| > 2**126 (z < -87.3) the division gives 0 where the exact
    value is below 1e-36."""
    special = torch.tensor([-1e30, -1e4, -200.0, -100.0, -88.8, -88.0, -87.5, -87.0, -50.0, -20.0, -1.0, -1e-30,
                            0.0, 1e-30, 1e-3, 1.0, 20.0, 88.0, 100.0, 1e4, 1e30])
    gen = torch.Generator().manual_seed(0)
    z = torch.cat([special, torch.randn(4096, generator=gen) * 30, torch.randn(4096, generator=gen)])
    got = silu_mul(torch.cat([z, torch.ones_like(z)])[None].to(DEV))[0].cpu().double()
    want = torch.nn.functional.silu(z.double())
    bound = (8 * 2.0 ** -24 + z.double().abs() * 1e-7) * want.abs() + 1e-35
    worst = ((got - want).abs() / bound).max().item()
    assert worst <= 1.0, f"SiLU off by {worst:.2f}x its bound"
    assert torch.equal(got[z > 1e3], z.double()[z > 1e3]) and (got[z < -1e3] == 0).all()
