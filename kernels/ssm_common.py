"""Shared pieces of the Mamba2 (SSD) kernels: the dt activation, head-to-group mapping, launch sizes,
the SiLU every kernel applies.

Both the PyTorch twins and the Triton kernels apply `dt = clamp(softplus(dt_raw + dt_bias), lo, hi)`;
the softplus is the overflow-safe form (`v` itself once `v > 20`).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

SOFTPLUS_THRESHOLD = 20.0


def dt_activation(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_limit) -> torch.Tensor:
    """fp32 `clamp(softplus(dt + dt_bias), *dt_limit)`; `dt (..., H)`, `dt_bias (H,)` or None."""
    v = dt.float()
    if dt_bias is not None:
        v = v + dt_bias.float()
    # in float64, rounded once: the fp32 softplus of a vectorised CPU loop and of its scalar tail
    # can differ in the last bit, so the same dt would depend on its place in the tensor (and a
    # batch padded for a graph would not match the eager one bit for bit)
    v = torch.nn.functional.softplus(v.double(), threshold=SOFTPLUS_THRESHOLD).float()
    lo, hi = limits(dt_limit)
    return v.clamp(min=lo, max=hi)


def limits(dt_limit) -> tuple[float, float]:
    """`(lo, hi)` as floats; None means unclamped."""
    if dt_limit is None:
        return 0.0, math.inf
    lo, hi = dt_limit
    return float(lo), float(hi)


def heads_per_group(nheads: int, ngroups: int) -> int:
    if nheads % ngroups:
        raise ValueError(f"{nheads} heads do not split into {ngroups} groups")
    return nheads // ngroups


def expand_groups(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """`(..., G, N)` -> `(..., H, N)`: head h reads group h // (H // G)."""
    return t.repeat_interleave(heads_per_group(nheads, t.shape[-2]), dim=-2)


def silu_gate(y: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
    return y if z is None else y * torch.nn.functional.silu(z.float())


def pow2(n: int, least: int = 16) -> int:
    """Next power of two >= max(n, least) (tl.arange and tl.dot want powers of two, dot dims >= 16)."""
    return max(least, 1 << max(0, int(n) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """Triton dot precision for operands converted to fp32. With bf16/fp16 activations one tf32 pass:
    C.B^T of raw inputs is exact (their mantissas fit in tf32), computed operands (decays, dt * x,
    the fp32 state) are rounded to 10 mantissa bits, below the activations' own rounding. fp32
    activations get three tf32 passes, about fp32 accuracy (the ieee FMA path spills registers
    badly at these tile sizes)."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Uninitialised output buffer of the Triton wrappers (one place, so tests can poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def as_int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def last_axis_contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when its last axis is contiguous (other axes may be strided, e.g. rows of a wider
    buffer), else a contiguous copy: what kernels that index rows by stride and columns by 1 need."""
    return t if t.stride(-1) == 1 else t.contiguous()


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def fast_exp(x):
    """e**x of fp32 x as exp2(x log2 e), which is how `tl.exp` computes it too, less the fix-ups it
    adds for subnormal results: those flush to 0 here (below 1.2e-38, under every tolerance), every
    other result is the same bits. Two instructions on sm_90 instead of five. The tree scan uses it:
    its time at batch 1 is one long dependent chain, and it ran in 0.97-0.98x the time with it
    (64- and 128-node trees, batches of 16 trees; H100, BENCHMARKS.md nineteenth round). The state
    commit, memory-bound with one exponential per head and step, measured 1.005-1.027x with it and
    keeps `tl.exp`; so do the decode updates and the prefill, which were not timed with it."""
    return tl.exp2(x * LOG2E)


@triton.jit
def softplus_clamped(v, lo, hi):
    """Overflow-safe softplus then clamp; log1p done the accurate way (Goldberg) for tiny exp(v)."""
    u = tl.exp(tl.minimum(v, 20.0))
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
    sp = tl.where(v > 20.0, v, log1p)
    return tl.minimum(tl.maximum(sp, lo), hi)


@triton.jit
def silu(z):
    """z * sigmoid(z) of fp32 z, in five instructions on sm_90 where `z / (1 + tl.exp(-z))` takes
    twelve: `fast_exp`'s exponential, with the sign folded into its scale, and the approximate
    division (`approx_divide`). In the tree conv, whose threads issue an instruction most cycles,
    that was 0.95-0.97x the time at serving batches, with the same bf16 outputs (H100, BENCHMARKS.md
    nineteenth round)."""
    return approx_divide(z, 1.0 + tl.exp2(z * -LOG2E))


# Kernels defined now run in Triton's interpreter (the CPU tests), as `triton.jit` itself decides.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Whether tl.dot may take bf16/fp16 operands as they are. The interpreter's bf16 dot is wrong, so
# interpreted kernels convert them to fp32 first (the same values).
NATIVE_HALF_DOT = tl.constexpr(not INTERPRETED)

# x / y of fp32 tensors to within 2 ulp (PTX div.approx: a reciprocal and a product) instead of
# div.full's range fix-ups; 0 once |y| > 2**126, where x / y is below every tolerance anyway. The
# interpreter has no libdevice, so interpreted kernels (CPU tests) divide exactly; the GPU tests
# cover the approximate path.
if INTERPRETED:
    @triton.jit
    def approx_divide(x, y):
        return x / y
else:
    @triton.jit
    def approx_divide(x, y):
        return libdevice.fast_dividef(x, y)
