"""Chunked SSD over one long prompt: intra-chunk quadratic form, states passed between chunks.

    y = ssd(x, dt, A, B, C) + D x   (times silu(z)),   final_state (H, P, N) fp32
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import ssm_common
from kernels.ssm_common import (
    dot_precision,
    dt_activation,
    expand_groups,
    heads_per_group,
    limits,
    pow2,
    silu,
    silu_gate,
    softplus_clamped,
)


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a (..., Q) -> (..., Q, Q): out[..., i, j] = sum_{j < k <= i} a_k for j <= i, -inf above the diagonal.

    Summed directly over each segment (not as cumsum_i - cumsum_j) so large |dA| loses no precision.
    """
    Q = a.shape[-1]
    rep = a[..., None, :].expand(*a.shape, Q).transpose(-1, -2)  # rep[..., k, j] = a_k
    strict = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=a.device), -1)
    seg = torch.cumsum(rep.masked_fill(~strict, 0.0), dim=-2)
    keep = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=a.device))
    return seg.masked_fill(~keep, -torch.inf)


def ssd_prefill_ref(x, dt, A, B, C, D, dt_bias, dt_limit, initial_state=None, z=None, chunk_size=64):
    """PyTorch twin of `ssd_prefill` (chunked einsums, in the manner of mamba_ssm's ssd_minimal).

    x (L, H, P), dt (L, H) raw, A (H,), B/C (L, G, N), D (H,) or None, dt_bias (H,) or None,
    initial_state (H, P, N) or None, z (L, H, P) or None -> (y (L, H, P) in x.dtype, final_state (H, P, N) fp32).
    """
    Lx, H, P = x.shape
    N = B.shape[-1]
    Q = int(chunk_size)
    nc = -(-Lx // Q)
    pad = nc * Q - Lx
    dtv = dt_activation(dt, dt_bias, dt_limit)  # (L, H)
    # zero-padding the tail is exact: dt = 0 there means no decay and no input
    def chunks(t):
        t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(nc, Q, *t.shape[1:])

    xs = chunks(x.float())  # (c, Q, H, P)
    dtc = chunks(dtv)  # (c, Q, H)
    Bh = chunks(expand_groups(B.float(), H))  # (c, Q, H, N)
    Ch = chunks(expand_groups(C.float(), H))
    dA = (dtc * A.float()).permute(0, 2, 1)  # (c, H, Q)
    cs = torch.cumsum(dA, -1)

    # 1. within each chunk
    Lmat = torch.exp(_segsum(dA))  # (c, H, Q, Q)
    y_diag = torch.einsum("clhn,cshn,chls,csh,cshp->clhp", Ch, Bh, Lmat, dtc, xs)
    # 2. each chunk's own contribution to the state at its end
    to_end = torch.exp(_segsum(dA)[..., -1, :])  # (c, H, Q): decay from after step s to the chunk's end
    states = torch.einsum("cshn,chs,csh,cshp->chpn", Bh, to_end, dtc, xs)
    # 3. pass states between chunks
    h = torch.zeros(H, P, N, device=x.device) if initial_state is None else initial_state.float()
    entering = []
    for c in range(nc):
        entering.append(h)
        h = torch.exp(cs[c, :, -1])[:, None, None] * h + states[c]
    entering = torch.stack(entering)  # (c, H, P, N)
    # 4. entering state seen from each position
    y_off = torch.einsum("clhn,chpn,chl->clhp", Ch, entering, torch.exp(cs))
    y = (y_diag + y_off).reshape(nc * Q, H, P)[:Lx]
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    return silu_gate(y, z).to(x.dtype), h


@triton.jit
def _chunk_dA(dt_ptr, bias, A, offs_q, Lx, h, sdt_t, sdt_h, dt_lo, dt_hi):
    """Activated dt and dA = dt * A of a chunk's positions (zero past the sequence end)."""
    q_ok = offs_q < Lx
    dt = tl.load(dt_ptr + offs_q.to(tl.int64) * sdt_t + h * sdt_h, mask=q_ok, other=0.0).to(tl.float32)
    dt = tl.where(q_ok, softplus_clamped(dt + bias, dt_lo, dt_hi), 0.0)
    return dt, dt * A


@triton.jit(do_not_specialize=["Lx"])  # sizes that change per call: one compile serves them all
def _chunk_state_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, bias_ptr, states_ptr, chunk_dA_ptr,
    Lx, heads_per_group, dt_lo, dt_hi,
    sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n,
    P: tl.constexpr, N: tl.constexpr, Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    PREC: tl.constexpr,
):
    """Per (chunk, head, headdim x d_state tile): the chunk's own contribution to the state at its end,
    sum_j exp(dA summed after j) dt_j x_j (x) B_j, and the chunk's total dA."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    pid2 = tl.program_id(2)
    n_tiles: tl.constexpr = (N + BN - 1) // BN
    pt = pid2 // n_tiles
    nt = pid2 % n_tiles
    g = h // heads_per_group
    A = tl.load(A_ptr + h).to(tl.float32)
    bias = tl.load(bias_ptr + h).to(tl.float32)
    offs_q = c * Q + tl.arange(0, Q)
    q_ok = offs_q < Lx
    dt, dA = _chunk_dA(dt_ptr, bias, A, offs_q, Lx, h, sdt_t, sdt_h, dt_lo, dt_hi)
    # float64 running sums: total - prefix stays exact however negative the chunk's dA gets
    cs = tl.cumsum(dA.to(tl.float64), axis=0)
    total = tl.sum(dA.to(tl.float64), axis=0)
    w = tl.exp(tl.minimum((total - cs).to(tl.float32), 0.0)) * dt

    offs_p = pt * BP + tl.arange(0, BP)
    offs_n = nt * BN + tl.arange(0, BN)
    p_ok = offs_p < P
    n_ok = offs_n < N
    tok = offs_q.to(tl.int64)
    xq = tl.load(x_ptr + tok[:, None] * sx_t + h * sx_h + offs_p[None, :] * sx_p,
                 mask=q_ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
    bq = tl.load(B_ptr + tok[:, None] * sb_t + g * sb_g + offs_n[None, :] * sb_n,
                 mask=q_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    s = tl.dot(tl.trans(xq * w[:, None]), bq, input_precision=PREC)  # (BP, BN)
    H = tl.num_programs(1)
    base = states_ptr + (c.to(tl.int64) * H + h) * P * N
    tl.store(base + offs_p[:, None] * N + offs_n[None, :], s, mask=p_ok[:, None] & n_ok[None, :])
    if pid2 == 0:
        tl.store(chunk_dA_ptr + c * H + h, total.to(tl.float32))


@triton.jit(do_not_specialize=["n_chunks"])  # sizes that change per call: one compile serves them all
def _state_passing_kernel(
    states_ptr, chunk_dA_ptr, init_ptr, final_ptr, n_chunks,
    si_h, si_p, si_n,
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_INIT: tl.constexpr,
):
    """Per (head, state tile): walk the chunks in order, replacing each chunk's own contribution in
    `states` by the state entering that chunk, and write the final state."""
    h = tl.program_id(0)
    pt = tl.program_id(1)
    nt = tl.program_id(2)
    offs_p = pt * BP + tl.arange(0, BP)
    offs_n = nt * BN + tl.arange(0, BN)
    mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    tile = offs_p[:, None] * N + offs_n[None, :]
    if HAS_INIT:
        state = tl.load(init_ptr + h * si_h + offs_p[:, None] * si_p + offs_n[None, :] * si_n, mask=mask, other=0.0)
    else:
        state = tl.zeros([BP, BN], dtype=tl.float32)
    for c in range(n_chunks):
        ptrs = states_ptr + (c * H + h).to(tl.int64) * P * N + tile
        own = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, state, mask=mask)
        state = tl.exp(tl.load(chunk_dA_ptr + c * H + h)) * state + own
    tl.store(final_ptr + h * P * N + tile, state, mask=mask)


@triton.jit(do_not_specialize=["Lx"])  # sizes that change per call: one compile serves them all
def _chunk_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, states_ptr, z_ptr, y_ptr,
    Lx, heads_per_group, dt_lo, dt_hi,
    sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n,
    sz_t, sz_h, sz_p, sy_t, sy_h, sy_p,
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, PREC: tl.constexpr,
):
    """Per (chunk, head, headdim tile): y = (L o C B^T)(dt x) + exp(cumsum dA) C h_entering + D x."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    pt = tl.program_id(2)
    g = h // heads_per_group
    A = tl.load(A_ptr + h).to(tl.float32)
    bias = tl.load(bias_ptr + h).to(tl.float32)
    offs_q = c * Q + tl.arange(0, Q)
    q_ok = offs_q < Lx
    tok = offs_q.to(tl.int64)
    offs_p = pt * BP + tl.arange(0, BP)
    p_ok = offs_p < P
    offs_n = tl.arange(0, BN)

    h_base = states_ptr + (c.to(tl.int64) * H + h) * P * N
    ch = tl.zeros([Q, BP], dtype=tl.float32)
    cb = tl.zeros([Q, Q], dtype=tl.float32)
    for n0 in tl.static_range(0, N, BN):
        nn = n0 + offs_n
        n_ok = nn < N
        cq = tl.load(C_ptr + tok[:, None] * sc_t + g * sc_g + nn[None, :] * sc_n,
                     mask=q_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        bq = tl.load(B_ptr + tok[:, None] * sb_t + g * sb_g + nn[None, :] * sb_n,
                     mask=q_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        hin = tl.load(h_base + offs_p[:, None] * N + nn[None, :], mask=p_ok[:, None] & n_ok[None, :], other=0.0)
        ch += tl.dot(cq, tl.trans(hin), input_precision=PREC)
        cb += tl.dot(cq, tl.trans(bq), input_precision=PREC)

    dt, dA = _chunk_dA(dt_ptr, bias, A, offs_q, Lx, h, sdt_t, sdt_h, dt_lo, dt_hi)
    cs = tl.cumsum(dA.to(tl.float64), axis=0)
    seg = (cs[:, None] - cs[None, :]).to(tl.float32)  # float64 difference: exact for any |dA|
    causal = tl.arange(0, Q)[None, :] <= tl.arange(0, Q)[:, None]
    decay = tl.where(causal, tl.exp(tl.minimum(seg, 0.0)), 0.0)
    xq = tl.load(x_ptr + tok[:, None] * sx_t + h * sx_h + offs_p[None, :] * sx_p,
                 mask=q_ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
    y = tl.dot(decay * cb, xq * dt[:, None], input_precision=PREC)
    y += tl.exp(tl.minimum(cs.to(tl.float32), 0.0))[:, None] * ch
    if HAS_D:
        y += tl.load(D_ptr + h).to(tl.float32) * xq
    io_mask = q_ok[:, None] & p_ok[None, :]
    if HAS_Z:
        zq = tl.load(z_ptr + tok[:, None] * sz_t + h * sz_h + offs_p[None, :] * sz_p, mask=io_mask, other=0.0)
        y *= silu(zq.to(tl.float32))
    tl.store(y_ptr + tok[:, None] * sy_t + h * sy_h + offs_p[None, :] * sy_p, y.to(y_ptr.dtype.element_ty),
             mask=io_mask)


def ssd_prefill(x, dt, A, B, C, D, dt_bias, dt_limit, initial_state=None, z=None, chunk_size=64):
    """Triton `ssd_prefill`: same contract as `ssd_prefill_ref`. Three launches: each chunk's own
    state, the sequential pass over chunks (per state tile), then every chunk's outputs."""
    Lx, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    Q = int(chunk_size)
    if Q < 16 or Q & (Q - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {Q}")
    hpg = heads_per_group(H, G)
    dev = x.device
    y = ssm_common.new_output((Lx, H, P), x.dtype, dev)
    final = torch.empty((H, P, N), device=dev, dtype=torch.float32)
    if Lx == 0:
        final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return y, final
    nc = triton.cdiv(Lx, Q)
    states = torch.empty((nc, H, P, N), device=dev, dtype=torch.float32)
    chunk_dA = torch.empty((nc, H), device=dev, dtype=torch.float32)
    lo, hi = limits(dt_limit)
    bias = dt_bias if dt_bias is not None else torch.zeros_like(A)
    prec = dot_precision(x.dtype)
    bp = min(64, pow2(P))
    bn = min(64, pow2(N))

    _chunk_state_kernel[(nc, H, triton.cdiv(P, bp) * triton.cdiv(N, bn))](
        x, dt, A, B, bias, states, chunk_dA, Lx, hpg, lo, hi,
        *x.stride(), *dt.stride(), *B.stride(),
        P=P, N=N, Q=Q, BP=bp, BN=bn, PREC=prec, num_warps=4,
    )
    init = initial_state if initial_state is not None else final
    _state_passing_kernel[(H, triton.cdiv(P, bp), triton.cdiv(N, bn))](
        states, chunk_dA, init, final, nc, *init.stride(),
        H=H, P=P, N=N, BP=bp, BN=bn, HAS_INIT=initial_state is not None, num_warps=4,
    )
    zt = z if z is not None else x
    _chunk_scan_kernel[(nc, H, triton.cdiv(P, bp))](
        x, dt, A, B, C, D if D is not None else A, bias, states, zt, y, Lx, hpg, lo, hi,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *zt.stride(), *y.stride(),
        H=H, P=P, N=N, Q=Q, BP=bp, BN=bn, HAS_D=D is not None, HAS_Z=z is not None, PREC=prec, num_warps=4,
    )
    return y, final
