"""RMSNorm, the block-boundary residual add + RMSNorm, and the Mamba2 gated RMSNorm, computed in fp32
as transformers does. One kernel each on CUDA (`kernels.norms`), their PyTorch twins elsewhere."""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import ops
from kernels.norms import SumOfSquares
from kernels.ssm_common import silu_gate


class RowScaled(NamedTuple):
    """A block output whose rows still need a factor: value (T, d) * scale.rstd()[:, None]. A Mamba2
    decode step returns this when it leaves its gated norm's scale to the next residual add."""

    value: torch.Tensor
    scale: SumOfSquares


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, norm_dtype: torch.dtype | None = None):
    """x (T, d) -> weight * normalised x.to(norm_dtype) (default x's dtype); the normalised value is
    rounded to that dtype first."""
    return ops.rms_norm(x, weight, eps, norm_dtype)


def add_rms_norm(h, out, weight, eps: float, multiplier: float = 1.0, norm_dtype=None):
    """The residual stream at a block boundary: h (T, d), the block's output out (T, d) or RowScaled ->
    (h + multiplier * out, rms_norm(that, weight, eps, norm_dtype))."""
    out, scale = out if isinstance(out, RowScaled) else (out, None)
    return ops.add_rms_norm(h, out, weight, eps, multiplier, norm_dtype, out_scale=scale)


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """rmsnorm(y * silu(z)) over groups of `group_size` channels; y, z (T, d_inner) -> (T, d_inner)."""
    return ops.gated_rms_norm(y, z, weight, group_size, eps, out_dtype)


def silu_gated(y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """y * silu(z) in fp32, rounded once to out_dtype (a Mamba2 gate without a norm: FalconH1)."""
    return silu_gate(y.float(), z).to(out_dtype)


def norm_before_gate(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """weight * rmsnorm(y) * silu(z) over groups of `group_size` channels, in fp32 (FalconH1's
    `mamba_norm_before_gate`); y, z (T, d_inner) -> (T, d_inner). PyTorch ops, no kernel of its own."""
    T, d = y.shape
    yg = y.float().view(T, d // group_size, group_size)
    yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + eps)
    out = weight.float() * yg.view(T, d) * torch.nn.functional.silu(z.float())
    return out.to(out_dtype)
