"""Commit an accepted tree path into the SSM state pool, in place, in closed form (design §4):

    h_new = exp(sum_k dA_k) h0 + sum_k exp(sum_{m>k} dA_m) dt_k x_k (x) B_k     over k < path_len

One pass per (sequence, layer, head, headdim tile): the state tile is read once and written once.
The per-node inputs are read where a verify left them (its stash rows), through a (sequence, step)
row table, so no gather runs before the commit. Several layers commit in one launch when every
tensor carries a layer axis.
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


def _layered(ssm_state, x, dt, B, A, dt_bias):
    """Single-layer arguments (state (S, H, P, N)) with a layer axis of 1 added; layered ones as they are."""
    if ssm_state.dim() == 5:
        return ssm_state, x, dt, B, A, dt_bias
    return (ssm_state.unsqueeze(1), x.unsqueeze(1), dt.unsqueeze(1), B.unsqueeze(1), A.unsqueeze(0),
            None if dt_bias is None else dt_bias.unsqueeze(0))


def ssm_state_commit_ref(ssm_state, slot_idx, x, dt, B, rows, path_len, A, dt_bias, dt_limit):
    """PyTorch twin of `ssm_state_commit`.

    One layer: ssm_state (S, H, P, N) fp32 (updated in place), x (R, H, P), dt (R, H) raw, B (R, G, N),
    A (H,), dt_bias (H,) or None. Several layers at once: a layer axis L after the first one of
    each, ssm_state (S, L, H, P, N), x (R, L, H, P), dt (R, L, H), B (R, L, G, N), A and dt_bias (L, H).
    slot_idx (nb,); rows (nb, K) int: the row of x, dt and B that is step k of sequence b's accepted
    path, every entry a valid row (those at k >= path_len[b] are not used); path_len (nb,) with
    1 <= path_len <= K, or 0 for a sequence that commits nothing.
    """
    state, x, dt, B, A, dt_bias = _layered(ssm_state, x, dt, B, A, dt_bias)
    S, L, H, P, N = state.shape
    nb, K = rows.shape
    r = rows.long()
    step = torch.arange(K, device=x.device)
    live = step[None, :] < path_len.long()[:, None]  # (nb, K)
    # padding steps become "no decay, no input"; selects, since padding may hold anything (even NaN)
    dtv = torch.where(live[..., None, None], dt_activation(dt[r], dt_bias, dt_limit), 0.0)  # (nb, K, L, H)
    xs = torch.where(live[..., None, None, None], x[r].float(), 0.0)  # (nb, K, L, H, P)
    Bh = torch.where(live[..., None, None, None], expand_groups(B[r].float(), H), 0.0)  # (nb, K, L, H, N)
    dA = dtv * A.float()
    # suffix sums after each step, summed directly (not as total - prefix) so they stay exact
    after = torch.flip(torch.cumsum(torch.flip(dA, [1]), 1), [1]) - dA
    w = torch.exp(after.clamp(max=0.0)) * dtv  # (nb, K, L, H)
    slots = slot_idx.long()
    # steps summed one at a time, in path order: padding steps then add exact zeros, so a path padded
    # to a longer bucket gives the same bits (a reduction over K would group the terms by K)
    total = torch.zeros_like(dA[:, 0])
    inputs = torch.zeros_like(state[slots])
    for k in range(K):
        total = total + dA[:, k]
        inputs = inputs + w[:, k, ..., None, None] * xs[:, k, ..., None] * Bh[:, k, ..., None, :]
    state[slots] = torch.exp(total)[..., None, None] * state[slots] + inputs


# Paths up to this many steps run an unrolled loop; longer ones a loop over the path's own length.
# The unrolled program's compile time grows steeply with its steps: on an H100 about 1.3 s at 16,
# 6 s at 32 and 33 s at 64 (BENCHMARKS.md, twenty-ninth round), stalling a replica at the first
# commit of a long path.
UNROLLED_STEPS = 16


@triton.jit
def _commit_step(acc, after, k, plen, row_ptr, x_at, sx_r, dt_at, sdt_r, B_at, sb_r, p_ok, n_ok, A, bias, dt_lo, dt_hi):
    """Step k of the path (nothing when k >= plen) folded into (acc (BP, BN), after): acc gains
    exp(after) dt_k x_k (x) B_k, after gains dA_k. x_at, dt_at, B_at: this program's x tile, dt
    and B row in node row 0 (a row is `s*_r` on)."""
    live = k < plen
    row = tl.load(row_ptr).to(tl.int64)
    dt = tl.load(dt_at + row * sdt_r).to(tl.float32)
    dt = tl.where(live, softplus_clamped(dt + bias, dt_lo, dt_hi), 0.0)
    x = tl.load(x_at + row * sx_r, mask=p_ok & live, other=0.0)
    Bv = tl.load(B_at + row * sb_r, mask=n_ok & live, other=0.0)
    x = x.to(tl.float32)
    Bv = Bv.to(tl.float32)
    acc += (tl.exp(after) * dt * x)[:, None] * Bv[None, :]
    after += dt * A
    return acc, after


@triton.jit
def _commit_kernel(
    state_ptr, slot_ptr, x_ptr, dt_ptr, B_ptr, rows_ptr, len_ptr, A_ptr, bias_ptr,
    H, heads_per_group, dt_lo, dt_hi,
    ss_s, ss_l, ss_h, ss_p, ss_n, sx_r, sx_l, sx_h, sx_p, sdt_r, sdt_l, sdt_h, sb_r, sb_l, sb_g, sb_n,
    srow_b, srow_k,
    K: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    UNROLL: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (sequence, layer x head, headdim tile). Steps are walked from the last to the
    first so the decay after each step is a running sum of the steps already seen (exact, no
    differences). UNROLL: all K steps unrolled (the steps past path_len add exact zeros); else a
    loop over the path's own steps."""
    release_next(PDL)
    wait_for_previous(PDL)  # every input below may come from the kernel before
    b = tl.program_id(0)
    lh = tl.program_id(1)  # layer * H + head: A and dt_bias are (L, H) contiguous
    pt = tl.program_id(2)
    layer = lh // H
    h = lh % H
    g = h // heads_per_group
    slot = tl.load(slot_ptr + b).to(tl.int64)
    plen = tl.load(len_ptr + b)
    offs_p = pt * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    p_ok = offs_p < P
    n_ok = offs_n < N
    st_ptrs = (state_ptr + slot * ss_s + layer.to(tl.int64) * ss_l + h * ss_h + offs_p[:, None] * ss_p
               + offs_n[None, :] * ss_n)
    st_mask = p_ok[:, None] & n_ok[None, :]
    h0 = tl.load(st_ptrs, mask=st_mask, other=0.0)
    A = tl.load(A_ptr + lh).to(tl.float32)
    bias = tl.load(bias_ptr + lh).to(tl.float32)
    after = A * 0.0  # dA summed over the accepted steps after the current one
    acc = tl.zeros([BP, BN], dtype=tl.float32)
    row_ptrs = rows_ptr + b * srow_b
    x_at = x_ptr + layer * sx_l + h * sx_h + offs_p * sx_p
    dt_at = dt_ptr + layer * sdt_l + h * sdt_h
    B_at = B_ptr + layer * sb_l + g * sb_g + offs_n * sb_n
    if UNROLL:
        for t in tl.static_range(K):
            k = K - 1 - t
            acc, after = _commit_step(acc, after, k, plen, row_ptrs + k * srow_k, x_at, sx_r, dt_at, sdt_r, B_at,
                                      sb_r, p_ok, n_ok, A, bias, dt_lo, dt_hi)
    else:
        for t in range(0, plen):
            k = plen - 1 - t
            acc, after = _commit_step(acc, after, k, plen, row_ptrs + k * srow_k, x_at, sx_r, dt_at, sdt_r, B_at,
                                      sb_r, p_ok, n_ok, A, bias, dt_lo, dt_hi)
    tl.store(st_ptrs, tl.exp(after) * h0 + acc, mask=st_mask)


def ssm_state_commit(ssm_state, slot_idx, x, dt, B, rows, path_len, A, dt_bias, dt_limit, *,
                     block_p: int | None = None, num_warps: int | None = None, unrolled_steps: int = UNROLLED_STEPS):
    """Triton `ssm_state_commit`: same contract as `ssm_state_commit_ref` (in place on `ssm_state`).
    Keyword-only tuning knobs (benchmarks, tests): `block_p` headdim rows per program, `num_warps`,
    `unrolled_steps` the longest path axis K that runs unrolled."""
    state, x, dt, B, A, dt_bias = _layered(ssm_state, x, dt, B, A, dt_bias)
    S, L, H, P, N = state.shape
    nb, K = rows.shape
    G = B.shape[2]
    if nb == 0 or K == 0:
        return
    hpg = heads_per_group(H, G)
    lo, hi = limits(dt_limit)
    bn = pow2(N, 1)
    # 4096-element state tiles, 4 warps: 0.76-0.84x the time of 1024-element tiles at 1, 16 and 64
    # sequences, both layer shapes, and 1.10-1.19x the floor from 16 sequences on (H200,
    # bench.batch_kernels --sweep, BENCHMARKS.md ninth round)
    bp = block_p or max(1, min(pow2(P, 1), 4096 // bn))
    unroll = K <= unrolled_steps
    grid = (nb, L * H, triton.cdiv(P, bp))
    _commit_kernel[grid](
        state, as_int32(slot_idx), x, dt, B, rows, as_int32(path_len), A.contiguous(),
        dt_bias.contiguous() if dt_bias is not None else torch.zeros_like(A),
        H, hpg, lo, hi,
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *rows.stride(),
        # the loop reads no K: one program serves every longer path
        K=K if unroll else 0, P=P, N=N, BP=bp, BN=bn, UNROLL=unroll,
        **pdl.launch_options(state.device),
        num_warps=num_warps or 4,
    )
