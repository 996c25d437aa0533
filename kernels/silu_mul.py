"""The gated MLP's activation in one pass: silu(gate) * up from the gate|up projection's output.

    gate_up (T, 2I) = gate | up columns (rows may be strided) -> (T, I) in gate_up's dtype

As torch composes it (`F.silu(gate) * up`, what transformers runs) it is two elementwise kernels per
MLP block on strided halves, and neither takes part in the chain of programmatically dependent
launches (kernels/pdl.py). Rounding follows that composition: silu(gate) is computed in fp32 and
rounded to the activation dtype, then multiplied by up in fp32 and rounded again.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import pdl, ssm_common
from kernels.pdl import release_next, wait_for_previous
from kernels.ssm_common import last_axis_contiguous, silu

BLOCK_T, BLOCK_I = 2, 1024  # rows x columns per program: 16 elements per thread at 4 warps


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """PyTorch twin of `silu_mul`: gate_up (T, 2I) -> F.silu(gate) * up (T, I)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, T, I, s_gu, s_out, BT: tl.constexpr, BI: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)  # gate_up is the kernel before's output
    rows = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    ok = (rows < T)[:, None] & (cols < I)[None, :]
    base = gu_ptr + rows[:, None] * s_gu + cols[None, :]
    gate = tl.load(base, mask=ok, other=0.0)
    up = tl.load(base + I, mask=ok, other=0.0)
    act = silu(gate.to(tl.float32)).to(gate.dtype)  # rounded where F.silu rounds
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * s_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)
    # Released at the end, not the start (kernels/pdl.py's usual place): released early, the down
    # projection's thousand programs launched while gate_up was still streaming its weights, and an
    # 8B-hybrid decode step took 4.54 ms instead of 4.29 (H200, same run; BENCHMARKS.md fifth round).
    release_next(PDL)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton `silu_mul`: same contract as the twin."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul takes (T, 2I) gate|up rows, got {tuple(gate_up.shape)}")
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = ssm_common.new_output((T, I), gate_up.dtype, gate_up.device)
    if T == 0 or I == 0:
        return out
    gate_up = last_axis_contiguous(gate_up)
    _silu_mul_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(I, BLOCK_I))](
        gate_up, out, T, I, gate_up.stride(0), out.stride(0),
        BT=BLOCK_T, BI=BLOCK_I, **pdl.launch_options(gate_up.device), num_warps=4,
    )
    return out
