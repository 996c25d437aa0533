"""RMSNorm, the block-boundary residual add + RMSNorm, and the Mamba2 gated RMSNorm, computed in fp32
as transformers does. One kernel each on CUDA (`kernels.norms`), their PyTorch twins elsewhere."""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import ops


class RowScaled(NamedTuple):
    """A block output whose rows still need a factor: value (T, d) * scale (T,) fp32[:, None]. A Mamba2
    decode step returns this when it leaves its gated norm's scale to the next residual add."""

    value: torch.Tensor
    scale: torch.Tensor


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
