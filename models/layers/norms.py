"""RMSNorm and the Mamba2 gated RMSNorm, computed in fp32 as transformers does."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., d) -> weight * normalised x; the normalised value is rounded to x's dtype first."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """rmsnorm(y * silu(z)) over groups of `group_size` channels; y, z (T, d_inner) -> (T, d_inner)."""
    g = y.float() * F.silu(z.float())
    T, d = g.shape
    g = g.view(T, d // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view(T, d).to(out_dtype)
