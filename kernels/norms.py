"""RMSNorms of the hybrid runtime, one launch each: the block boundary (residual add + RMSNorm) and the
Mamba2 gated RMSNorm. Numerics follow transformers: statistics in fp32, the normalised value rounded
to the input's dtype before the weight multiplies it.

    add_rms_norm:   h' = h + m * out;   x = weight * rms_norm(h'.to(norm_dtype))
                    (out first scaled per row by the rstd of `out_scale`, a deferred gated norm's
                    SumOfSquares)
    gated_rms_norm: g = y * silu(z);    out = weight * (g / rms(g) over groups).to(out_dtype)

Every rounding step of the PyTorch twins (`m * out` in out's dtype, `h'` in the promoted dtype of
h and out, the normalised value in `norm_dtype`, the product with the weight in the promoted dtype)
is reproduced by the kernels, so they differ from the twins only by fp32 summation order.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import release_next, wait_for_previous
from kernels.ssm_common import last_axis_contiguous, silu

# one program normalises a whole row (or group) from registers; wider rows than this are refused
MAX_WIDTH = 32768
# constexpr code of the dtype a value is rounded to (dtypes themselves are not plain constexprs)
ROUND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}




class SumOfSquares(NamedTuple):
    """A row norm left for later, as its statistics: rstd = rsqrt(parts.sum(1) / count + eps).
    parts (T, n) fp32, partial sums of squares of each row's `count` values (n >= 1: the fused
    decode step leaves one per program, so no program has to wait for the others to add them up)."""

    parts: torch.Tensor
    count: int
    eps: float

    def rstd(self) -> torch.Tensor:
        """(T,) fp32."""
        return torch.rsqrt(self.parts.float().sum(1) / self.count + self.eps)


# --------------------------------------------------------------------------------------------
# PyTorch reference twins
# --------------------------------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, norm_dtype: torch.dtype | None = None):
    """x (..., d) -> weight * normalised x.to(norm_dtype) (default x's dtype); the normalised value is
    rounded to `norm_dtype` first; result in the promoted dtype of weight and `norm_dtype`."""
    x = x if norm_dtype is None else x.to(norm_dtype)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_ref(h, out, weight, eps: float, multiplier: float = 1.0, norm_dtype=None, out_scale=None):
    """Block boundary of the residual stream: h (T, d), out (T, d) or None ->
    (h' = h + multiplier * out, rms_norm_ref(h', weight, eps, norm_dtype)). With `out` None, h' is h.
    `out_scale` a SumOfSquares of T rows, or None: out is first replaced by (out * rstd[:, None]) in
    out's dtype."""
    if out is not None and out_scale is not None:
        out = (out.float() * out_scale.rstd()[:, None]).to(out.dtype)
    if out is not None:
        h = h + (out * multiplier if multiplier != 1.0 else out)
    return h, rms_norm_ref(h, weight, eps, norm_dtype)


def gated_rms_norm_ref(y, z, weight, group_size: int, eps: float, out_dtype: torch.dtype):
    """rmsnorm(y * silu(z)) over groups of `group_size` channels; y, z (T, d) -> (T, d) in the promoted
    dtype of weight and `out_dtype` (the normalised value is rounded to `out_dtype` first)."""
    g = y.float() * F.silu(z.float())
    T, d = g.shape
    g = g.view(T, d // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view(T, d).to(out_dtype)


def gated_rms_norm_deferred_ref(y, z, weight, eps: float, out_dtype: torch.dtype):
    """One-group `gated_rms_norm_ref` with the scale left out: y, z (T, d) ->
    (u = weight * (y * silu(z)).to(out_dtype) (T, d), SumOfSquares of the rows of y * silu(z)), so
    that for a linear map W, rstd[:, None] * (u @ W.T) equals gated_rms_norm_ref(...) @ W.T up to
    rounding."""
    g = y.float() * F.silu(z.float())
    return weight * g.to(out_dtype), SumOfSquares(g.pow(2).sum(-1, keepdim=True), g.shape[1], float(eps))


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def round_to(v, KIND: tl.constexpr):
    """fp32 `v` rounded to the dtype coded `KIND` (see ROUND) and back to fp32."""
    if KIND == 1:
        v = v.to(tl.float16).to(tl.float32)
    elif KIND == 2:
        v = v.to(tl.bfloat16).to(tl.float32)
    return v


@triton.jit
def _add_rms_norm_kernel(
    h_ptr, out_ptr, parts_ptr, w_ptr, hn_ptr, x_ptr,
    d, mult, eps, n_parts, scale_count, scale_eps,
    s_h, s_o, s_p, s_hn, s_x,
    HAS_OUT: tl.constexpr, HAS_SCALE: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr,
    PARTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row: the residual add and the norm of the sum, without a round trip through memory."""
    release_next(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < d
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)  # a weight: loads before the wait (PDL)
    wait_for_previous(PDL)
    h = tl.load(h_ptr + row * s_h + c, mask=ok, other=0.0)
    if HAS_OUT:
        o = tl.load(out_ptr + row * s_o + c, mask=ok, other=0.0)
        if HAS_SCALE:  # a deferred norm's per-row factor from its partial sums, applied in out's dtype first
            q = tl.arange(0, PARTS)
            ss = tl.sum(tl.load(parts_ptr + row * s_p + q, mask=q < n_parts, other=0.0), axis=0)
            o = (o.to(tl.float32) * tl.rsqrt(ss / scale_count + scale_eps)).to(o.dtype)
        scaled = (o.to(tl.float32) * mult).to(o.dtype)  # `out * m` is a tensor of out's dtype first
        h = (h.to(tl.float32) + scaled.to(tl.float32)).to(hn_ptr.dtype.element_ty)
        tl.store(hn_ptr + row * s_hn + c, h, mask=ok)
    v = round_to(h.to(tl.float32), NORM)
    rstd = tl.rsqrt(tl.sum(v * v, axis=0) / d + eps)
    v = round_to(v * rstd, NORM)
    tl.store(x_ptr + row * s_x + c, (w * v).to(x_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_rms_norm_kernel(
    y_ptr, z_ptr, w_ptr, o_ptr,
    group_size, eps,
    s_y, s_z, s_o,
    NORM: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (row, norm group)."""
    release_next(PDL)
    wait_for_previous(PDL)  # every input below may come from the kernel before
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    ok = tl.arange(0, BLOCK) < group_size
    y = tl.load(y_ptr + row * s_y + c, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * s_z + c, mask=ok, other=0.0).to(tl.float32)
    g = y * silu(z)
    rstd = tl.rsqrt(tl.sum(g * g, axis=0) / group_size + eps)
    v = round_to(g * rstd, NORM)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * s_o + c, (w * v).to(o_ptr.dtype.element_ty), mask=ok)


def _block(width: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for one row of `width` elements held in registers (about 16 per thread)."""
    if width > MAX_WIDTH:
        raise ValueError(f"norm width {width} exceeds {MAX_WIDTH}")
    block = triton.next_power_of_2(max(width, 16))
    return block, max(1, min(16, block // 512))


def add_rms_norm(h, out, weight, eps: float, multiplier: float = 1.0, norm_dtype=None, out_scale=None):
    """Triton twin of `add_rms_norm_ref`: h, out (T, d), out_scale a SumOfSquares or None ->
    (h' (T, d), x (T, d)); one program per row, which also adds up its row's partial sums."""
    if out_scale is not None:
        parts = out_scale.parts
        if out is None or parts.dim() != 2 or parts.shape[0] != h.shape[0] or parts.dtype != torch.float32:
            raise ValueError(f"out_scale must hold ({h.shape[0]}, n) fp32 partial sums beside an out, got "
                             f"{tuple(parts.shape)} {parts.dtype}")
    T, d = h.shape
    norm_dtype = norm_dtype or (h.dtype if out is None else torch.promote_types(h.dtype, out.dtype))
    h = last_axis_contiguous(h)
    hn = h if out is None else torch.empty(T, d, dtype=torch.promote_types(h.dtype, out.dtype), device=h.device)
    if out is not None:
        out = last_axis_contiguous(out)
    x = torch.empty(T, d, dtype=torch.promote_types(weight.dtype, norm_dtype), device=h.device)
    if T == 0:
        return hn, x
    block, warps = _block(d)
    o = out if out is not None else h
    parts = last_axis_contiguous(out_scale.parts) if out_scale is not None else o
    _add_rms_norm_kernel[(T,)](
        h, o, parts, weight.contiguous(), hn, x,
        d, float(multiplier), float(eps),
        parts.shape[1] if out_scale is not None else 0,
        float(out_scale.count) if out_scale is not None else 1.0,
        float(out_scale.eps) if out_scale is not None else 0.0,
        h.stride(0), o.stride(0), parts.stride(0), hn.stride(0), x.stride(0),
        HAS_OUT=out is not None, HAS_SCALE=out_scale is not None, NORM=ROUND[norm_dtype], BLOCK=block,
        PARTS=triton.next_power_of_2(parts.shape[1]) if out_scale is not None else 1,
        **pdl.launch_options(h.device), num_warps=warps,
    )
    return hn, x


def rms_norm(x, weight, eps: float, norm_dtype=None):
    """Triton twin of `rms_norm_ref` for x (T, d)."""
    return add_rms_norm(x, None, weight, eps, norm_dtype=norm_dtype)[1]


def gated_rms_norm(y, z, weight, group_size: int, eps: float, out_dtype: torch.dtype):
    """Triton twin of `gated_rms_norm_ref`: y, z (T, d) (rows may be strided) -> (T, d)."""
    T, d = y.shape
    if d % group_size:
        raise ValueError(f"{d} channels do not split into groups of {group_size}")
    y, z = last_axis_contiguous(y), last_axis_contiguous(z)
    o = torch.empty(T, d, dtype=torch.promote_types(weight.dtype, out_dtype), device=y.device)
    if T == 0:
        return o
    block, warps = _block(group_size)
    _gated_rms_norm_kernel[(T, d // group_size)](
        y, z, weight.contiguous(), o,
        group_size, float(eps),
        y.stride(0), z.stride(0), o.stride(0),
        NORM=ROUND[out_dtype], BLOCK=block, **pdl.launch_options(y.device),
        num_warps=warps,
    )
    return o
