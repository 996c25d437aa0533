"""Commit an accepted tree path into the SSM state pool, in place, in closed form (design §4):

    h_new = exp(sum_k dA_k) h0 + sum_k exp(sum_{m>k} dA_m) dt_k x_k (x) B_k     over k < path_len

One pass per (sequence, head, headdim tile): the state tile is read once and written once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import release_next, wait_for_previous
from kernels.ssm_common import (
    as_int32,
    dt_activation,
    expand_groups,
    heads_per_group,
    limits,
    pow2,
    softplus_clamped,
)


def ssm_state_commit_ref(ssm_state, slot_idx, x_path, dt_path, B_path, path_len, A, dt_bias, dt_limit):
    """PyTorch twin of `ssm_state_commit`.

    ssm_state (S, H, P, N) fp32 (updated in place), slot_idx (B,), x_path (B, K, H, P), dt_path (B, K, H) raw,
    B_path (B, K, G, N), path_len (B,) with 1 <= path_len <= K, A (H,), dt_bias (H,) or None.
    """
    nb, K, H, P = x_path.shape
    step = torch.arange(K, device=x_path.device)
    live = step[None, :] < path_len.long()[:, None]  # (B, K)
    # padding steps become "no decay, no input"; selects, since padding may hold anything (even NaN)
    dtv = torch.where(live[..., None], dt_activation(dt_path, dt_bias, dt_limit), 0.0)  # (B, K, H)
    xs = torch.where(live[..., None, None], x_path.float(), 0.0)
    Bh = torch.where(live[..., None, None], expand_groups(B_path.float(), H), 0.0)  # (B, K, H, N)
    dA = dtv * A.float()
    # suffix sums after each step, summed directly (not as total - prefix) so they stay exact
    after = torch.flip(torch.cumsum(torch.flip(dA, [1]), 1), [1]) - dA
    w = torch.exp(after.clamp(max=0.0)) * dtv  # (B, K, H)
    slots = slot_idx.long()
    h0 = ssm_state[slots]
    h_new = torch.exp(dA.sum(1))[..., None, None] * h0 + torch.einsum("bkh,bkhp,bkhn->bhpn", w, xs, Bh)
    ssm_state[slots] = h_new


@triton.jit
def _commit_kernel(
    state_ptr, slot_ptr, x_ptr, dt_ptr, B_ptr, len_ptr, A_ptr, bias_ptr,
    heads_per_group, dt_lo, dt_hi,
    ss_s, ss_h, ss_p, ss_n, sx_b, sx_k, sx_h, sx_p, sdt_b, sdt_k, sdt_h, sb_b, sb_k, sb_g, sb_n,
    K: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (sequence, head, headdim tile). Steps are walked from the last to the first so
    the decay after each step is a running sum of the steps already seen (exact, no differences)."""
    release_next(PDL)
    wait_for_previous(PDL)  # every input below may come from the kernel before
    b = tl.program_id(0)
    h = tl.program_id(1)
    pt = tl.program_id(2)
    g = h // heads_per_group
    slot = tl.load(slot_ptr + b).to(tl.int64)
    plen = tl.load(len_ptr + b)
    offs_p = pt * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    p_ok = offs_p < P
    n_ok = offs_n < N
    st_ptrs = state_ptr + slot * ss_s + h * ss_h + offs_p[:, None] * ss_p + offs_n[None, :] * ss_n
    st_mask = p_ok[:, None] & n_ok[None, :]
    h0 = tl.load(st_ptrs, mask=st_mask, other=0.0)
    A = tl.load(A_ptr + h).to(tl.float32)
    bias = tl.load(bias_ptr + h).to(tl.float32)
    b64 = b.to(tl.int64)
    after = A * 0.0  # dA summed over the accepted steps after the current one
    acc = tl.zeros([BP, BN], dtype=tl.float32)
    for t in tl.static_range(K):
        k = K - 1 - t
        live = k < plen
        dt = tl.load(dt_ptr + b64 * sdt_b + k * sdt_k + h * sdt_h).to(tl.float32)
        dt = tl.where(live, softplus_clamped(dt + bias, dt_lo, dt_hi), 0.0)
        x = tl.load(x_ptr + b64 * sx_b + k * sx_k + h * sx_h + offs_p * sx_p, mask=p_ok & live, other=0.0)
        Bv = tl.load(B_ptr + b64 * sb_b + k * sb_k + g * sb_g + offs_n * sb_n, mask=n_ok & live, other=0.0)
        x = x.to(tl.float32)
        Bv = Bv.to(tl.float32)
        acc += (tl.exp(after) * dt * x)[:, None] * Bv[None, :]
        after += dt * A
    tl.store(st_ptrs, tl.exp(after) * h0 + acc, mask=st_mask)


def ssm_state_commit(ssm_state, slot_idx, x_path, dt_path, B_path, path_len, A, dt_bias, dt_limit):
    """Triton `ssm_state_commit`: same contract as `ssm_state_commit_ref` (in place on `ssm_state`)."""
    nb, K, H, P = x_path.shape
    G, N = B_path.shape[2], B_path.shape[3]
    if nb == 0 or K == 0:
        return
    hpg = heads_per_group(H, G)
    lo, hi = limits(dt_limit)
    bn = pow2(N, 1)
    bp = max(1, min(pow2(P, 1), 1024 // bn))
    grid = (nb, H, triton.cdiv(P, bp))
    _commit_kernel[grid](
        ssm_state, as_int32(slot_idx), x_path, dt_path, B_path, as_int32(path_len), A,
        dt_bias if dt_bias is not None else torch.zeros_like(A),
        hpg, lo, hi,
        *ssm_state.stride(), *x_path.stride(), *dt_path.stride(), *B_path.stride(),
        K=K, P=P, N=N, BP=bp, BN=bn,
        **pdl.launch_options(ssm_state.device),
        num_warps=4,
    )

