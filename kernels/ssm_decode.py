"""Decode (K = 1) and multi-token chain update of the SSM state, in place on the pool:

    h_k = exp(dt_k A) h_{k-1} + dt_k x_k (x) B_k,     y_k = C_k . h_k + D x_k   (times silu(z_k))

The Triton kernel keeps each state tile in registers across all K steps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import ssm_common
from kernels.ssm_common import (
    as_int32,
    dt_activation,
    expand_groups,
    heads_per_group,
    limits,
    pow2,
    silu,
    silu_gate,
    softplus_clamped,
)


def ssm_chain_update_ref(ssm_state, slot_idx, x, dt, A, B, C, D, dt_bias, dt_limit, z=None):
    """PyTorch twin of `ssm_chain_update`.

    ssm_state (S, H, P, N) fp32 (advanced in place by all K tokens), slot_idx (B,), x (B, K, H, P),
    dt (B, K, H) raw, B/C (B, K, G, N), D (H,) or None, z (B, K, H, P) or None -> y (B, K, H, P) in x.dtype.
    """
    nb, K, H, P = x.shape
    dtv = dt_activation(dt, dt_bias, dt_limit)  # (B, K, H)
    decay = torch.exp(dtv * A.float())
    Bh = expand_groups(B.float(), H)
    Ch = expand_groups(C.float(), H)
    xs = x.float()
    slots = slot_idx.long()
    h = ssm_state[slots].clone()
    ys = []
    for k in range(K):
        h = decay[:, k, :, None, None] * h + (dtv[:, k, :, None] * xs[:, k])[..., None] * Bh[:, k, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, k]))
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + D.float()[:, None] * xs
    ssm_state[slots] = h
    return silu_gate(y, z).to(x.dtype)


@triton.jit
def _chain_update_kernel(
    state_ptr, slot_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, z_ptr, y_ptr,
    heads_per_group, dt_lo, dt_hi,
    ss_s, ss_h, ss_p, ss_n, sx_b, sx_k, sx_h, sx_p, sdt_b, sdt_k, sdt_h,
    sb_b, sb_k, sb_g, sb_n, sc_b, sc_k, sc_g, sc_n, sz_b, sz_k, sz_h, sz_p, sy_b, sy_k, sy_h, sy_p,
    K: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
):
    """One program per (sequence, head, headdim tile); the (BP, N) state tile stays in registers
    for all K steps and is written back once."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    pt = tl.program_id(2)
    g = h // heads_per_group
    slot = tl.load(slot_ptr + b).to(tl.int64)
    offs_p = pt * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    p_ok = offs_p < P
    n_ok = offs_n < N
    st_ptrs = state_ptr + slot * ss_s + h * ss_h + offs_p[:, None] * ss_p + offs_n[None, :] * ss_n
    st_mask = p_ok[:, None] & n_ok[None, :]
    state = tl.load(st_ptrs, mask=st_mask, other=0.0)
    A = tl.load(A_ptr + h).to(tl.float32)
    bias = tl.load(bias_ptr + h).to(tl.float32)
    b64 = b.to(tl.int64)
    for k in tl.static_range(K):
        dt = tl.load(dt_ptr + b64 * sdt_b + k * sdt_k + h * sdt_h).to(tl.float32)
        dt = softplus_clamped(dt + bias, dt_lo, dt_hi)
        x = tl.load(x_ptr + b64 * sx_b + k * sx_k + h * sx_h + offs_p * sx_p, mask=p_ok, other=0.0).to(tl.float32)
        Bv = tl.load(B_ptr + b64 * sb_b + k * sb_k + g * sb_g + offs_n * sb_n, mask=n_ok, other=0.0).to(tl.float32)
        Cv = tl.load(C_ptr + b64 * sc_b + k * sc_k + g * sc_g + offs_n * sc_n, mask=n_ok, other=0.0).to(tl.float32)
        state = state * tl.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
        y = tl.sum(state * Cv[None, :], axis=1)
        if HAS_D:
            y += tl.load(D_ptr + h).to(tl.float32) * x
        if HAS_Z:
            zk = tl.load(z_ptr + b64 * sz_b + k * sz_k + h * sz_h + offs_p * sz_p, mask=p_ok, other=0.0).to(tl.float32)
            y *= silu(zk)
        tl.store(y_ptr + b64 * sy_b + k * sy_k + h * sy_h + offs_p * sy_p, y.to(y_ptr.dtype.element_ty), mask=p_ok)
    tl.store(st_ptrs, state, mask=st_mask)


def ssm_chain_update(ssm_state, slot_idx, x, dt, A, B, C, D, dt_bias, dt_limit, z=None):
    """Triton `ssm_chain_update`: same contract as `ssm_chain_update_ref`."""
    nb, K, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    hpg = heads_per_group(H, G)
    y = ssm_common.new_output((nb, K, H, P), x.dtype, x.device)
    if nb == 0 or K == 0:
        return y
    lo, hi = limits(dt_limit)
    bn = pow2(N, 1)
    # small state tiles: many programs in flight is what saturates memory for this read-modify-write
    bp = max(1, min(pow2(P, 1), 1024 // bn))
    zt = z if z is not None else x
    grid = (nb, H, triton.cdiv(P, bp))
    _chain_update_kernel[grid](
        ssm_state, as_int32(slot_idx), x, dt, A, B, C, D if D is not None else A,
        dt_bias if dt_bias is not None else torch.zeros_like(A), zt, y,
        hpg, lo, hi,
        *ssm_state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *zt.stride(), *y.stride(),
        K=K, P=P, N=N, BP=bp, BN=bn, HAS_D=D is not None, HAS_Z=z is not None,
        num_warps=4,
    )
    return y

