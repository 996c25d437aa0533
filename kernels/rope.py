"""Rotary position embeddings in the Hugging Face "rotate_half" convention (Llama, Bamba, NemotronH...).

The rotated dimensions are split into two halves (not interleaved pairs): dimension d < R/2 pairs
with d + R/2, where R is the rotary dimension. With partial rotary (R < head_dim) only the first R
dimensions are rotated and the rest pass through, as in transformers' `apply_rotary_pos_emb`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import release_next, wait_for_previous
from kernels.ssm_common import pow2


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


# --------------------------------------------------------------------------------------------
# Fused q/k rotation: one launch instead of the ~18 small ones of the composition above
# --------------------------------------------------------------------------------------------


def rope_qk_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch twin of `rope_qk`: q (T, Hq, Dh), k (T, Hk, Dh), positions (T,) int, inv_freq (R/2,)
    fp32 with R <= Dh -> rotated (q, k) in their dtype, as `apply_rope(·, *rope_cos_sin(...))`."""
    cos, sin = rope_cos_sin(positions, 2 * inv_freq.shape[0], 0.0, q.dtype, inv_freq=inv_freq,
                            attention_scaling=attention_scaling)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, f_ptr, Hq, scaling,
                 sq_t, sq_h, sk_t, sk_h, sqo_t, sqo_h, sko_t, sko_h,
                 DH: tl.constexpr, HALF: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
    """One program per (token, head): q heads first, then k heads. Rounds where the composition
    does: cos and sin to the activation dtype, each product, then the sum."""
    release_next(PDL)
    wait_for_previous(PDL)  # every input below may come from the kernel before
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    is_q = h < Hq
    if is_q:
        src = q_ptr + t * sq_t + h * sq_h
        dst = qo_ptr + t * sqo_t + h * sqo_h
    else:
        src = k_ptr + t * sk_t + (h - Hq) * sk_h
        dst = ko_ptr + t * sko_t + (h - Hq) * sko_h
    dt = qo_ptr.dtype.element_ty
    j = tl.arange(0, BH)
    j_ok = j < HALF
    ang = tl.load(pos_ptr + t).to(tl.float32) * tl.load(f_ptr + j, mask=j_ok, other=0.0)
    # The angle is formed in fp32 as transformers forms it; then it is reduced to [-pi, pi] before
    # cos/sin, whose fast GPU versions are accurate only near zero (unreduced, at positions in the
    # thousands, a quarter of the bf16 outputs rounded differently from transformers on an H200).
    # Two-part 2*pi (Cody-Waite): turns * 6.28125 is exact below 2**16 turns (angles up to ~400k
    # rad); the reduced angle's cosine is then within 5e-6 of float64 cos of the fp32 angle.
    turns = tl.floor(ang * 0.15915494309189535 + 0.5)
    red = (ang - turns * 6.28125) - turns * 0.0019353071795864769
    c = (tl.cos(red) * scaling).to(dt).to(tl.float32)
    s = (tl.sin(red) * scaling).to(dt).to(tl.float32)
    x1 = tl.load(src + j, mask=j_ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
    lo = (x1 * c).to(dt).to(tl.float32) + (-x2 * s).to(dt).to(tl.float32)
    hi = (x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)
    tl.store(dst + j, lo.to(dt), mask=j_ok)
    tl.store(dst + HALF + j, hi.to(dt), mask=j_ok)
    if DH > 2 * HALF:  # partial rotary: the rest passes through
        d = 2 * HALF + tl.arange(0, BD)
        d_ok = d < DH
        tl.store(dst + d, tl.load(src + d, mask=d_ok, other=0.0), mask=d_ok)


def rope_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
            attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `rope_qk`: same contract as the twin; q and k may be strided views (last axis
    contiguous), the outputs are new contiguous tensors."""
    T, Hq, Dh = q.shape
    Hk = k.shape[1]
    half = inv_freq.shape[0]
    if k.shape[0] != T or k.shape[2] != Dh or 2 * half > Dh or positions.shape != (T,):
        raise ValueError(f"rope_qk: q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}, "
                         f"rotary dim {2 * half}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rope_qk: q and k need a contiguous last axis")
    qo, ko = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if T == 0:
        return qo, ko
    _rope_kernel[(T, Hq + Hk)](
        q, k, qo, ko, positions, inv_freq.float().contiguous(), Hq, float(attention_scaling),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
        DH=Dh, HALF=half, BD=pow2(Dh - 2 * half, 1), BH=triton.next_power_of_2(half),
        **pdl.launch_options(q.device), num_warps=1,
        # without this the compiler folds "round the product, add, round" into one bf16 FMA that
        # skips the product's rounding: a quarter of the outputs then differed from the twin by an ulp
        enable_fp_fusion=False,
    )
    return qo, ko
