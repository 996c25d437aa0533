"""Rotary position embeddings in the Hugging Face "rotate_half" convention (Llama, Bamba, NemotronH...).

The rotated dimensions are split into two halves (not interleaved pairs): dimension d < R/2 pairs
with d + R/2, where R is the rotary dimension. With partial rotary (R < head_dim) only the first R
dimensions are rotated and the rest pass through, as in transformers' `apply_rotary_pos_emb`.
"""
from __future__ import annotations

import torch


def rope_inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """(rotary_dim // 2,) fp32 inverse frequencies of the default RoPE."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    inv_freq: torch.Tensor | None = None,
    attention_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (*positions.shape, head_dim) in `dtype`, computed in fp32.

    `head_dim` is the rotary dimension (head_dim × partial_rotary_factor for partial rotary).
    `inv_freq` (head_dim // 2,) overrides the default frequencies (scaled RoPE variants compute
    theirs elsewhere); `attention_scaling` multiplies cos and sin as transformers does.
    """
    if inv_freq is None:
        inv_freq = rope_inv_freq(head_dim, theta, positions.device)
    freqs = positions.float()[..., None] * inv_freq.float().to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, Dh) with cos, sin (T, R), R <= Dh -> rotated x (T, H, Dh), same dtype.

    Any leading shape works as long as cos/sin have x's shape without the head axis (-2).
    """
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)
