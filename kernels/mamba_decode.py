"""One fused Mamba2 decode step: everything between the input and output projections, one launch.

For each sequence b (one new token) with its in_proj output `zxbcdt[b] = z | xBC | dt`:

    xBC'  = SiLU(conv1d([window | xBC]) + bias)     depthwise, width W <= 4, newest tap last;
            window = the last W-1 inputs in the ring conv_state[slot] (kernels/conv_tree.py)
    conv_state[slot][:, n mod W] <- xBC                  n = cache_lens[b], the committed length
    x, B, C = split(xBC');  dt' = clamp(softplus(dt + dt_bias), dt_limit)
    h = exp(dt' A) h + dt' x (x) B;    y = C . h + D x                     (ssm_state[slot], fp32)
    out = norm_weight * rmsnorm(y * silu(z)) over groups of `norm_group_size` channels

so a Mamba2 decode layer is: norm -> in_proj -> `mamba_decode_step` -> out_proj. The values are
rounded where the unfused composition (tree_conv1d, conv_state_commit, ssm_chain_update,
gated_rms_norm) rounds them: the conv output and y to the activation dtype, the normalised value to
the output dtype.

The Triton kernel runs one program per (sequence, head, headdim tile), like `ssm_chain_update`.
Every head of a group reads the group's B and C conv windows; since the conv state is a ring, the
new input goes into a column no program reads in this step (one program per group writes it), so
nothing has to wait until every head has read the window.

The gated RMSNorm reduces over a whole norm group. With several groups per row (`mamba_decode_step`:
NemotronH, Granite), each program stores its gated values (fp32) and their partial sum of squares,
and the row's last program to finish ("last arriver", counted with an atomic per row in
`arrivals`, which every launch leaves at zero) normalises the row. No program ever waits for
another, so the kernel cannot deadlock however its programs are scheduled.

`mamba_decode_step_deferred_norm` is the same step for a layer whose gated norm spans the whole row
(one group: Mamba2, Bamba) and whose out_proj has no bias. The norm's scale rstd is one number per
row, and out_proj is linear, so out_proj(w * g * rstd) = rstd * out_proj(w * g): each program writes
its own w * g and partial sum of squares, and the residual add after out_proj adds the sums up and
applies the rstd (`kernels.norms.add_rms_norm(out_scale=SumOfSquares)`). No program of this step
runs after the others: a step has no serial tail (about 1.5 us a layer at the Mamba2-2.7B shape).

`mamba_decode_step_gate_only` is the step of a layer with no norm after the gate (FalconH1's
published checkpoints): out = y * silu(z), rounded once as `ssm_chain_update(z=)` rounds it. Each
program writes its own channels, and no tail runs either.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl, ssm_common
from kernels.pdl import release_next, wait_for_previous
from kernels.conv_tree import check_ring, conv_state_commit_ref, tree_conv1d_ref
from kernels.norms import SumOfSquares, gated_rms_norm_deferred_ref, gated_rms_norm_ref
from kernels.ssm_common import as_int32, heads_per_group, last_axis_contiguous, limits, pow2, silu, softplus_clamped
from kernels.ssm_decode import ssm_chain_update_ref

# elements of SSM state per program (headdim tile x d_state): small tiles keep many programs in
# flight, which is what saturates memory for this read-modify-write of the state
STATE_TILE = 1024
# what the kernel makes of the gated value y * silu(z) (its GATE argument)
GATE_NORM = 0  # normalise it by groups in the last program (`mamba_decode_step`)
GATE_DEFER = 1  # write w * gated and partial sums of squares (`mamba_decode_step_deferred_norm`)
GATE_ONLY = 2  # write it as it is (`mamba_decode_step_gate_only`)
# channels, and partial sums, per step of the last program's row epilogue (2048 channels would
# take ~120 registers for the whole kernel instead of ~50, and cost the state update occupancy)
EPILOGUE_BLOCK = 1024
PARTS_BLOCK = 1024


def layout(zxbcdt: torch.Tensor, ssm_state: torch.Tensor, conv_weight: torch.Tensor):
    """(H, P, G, N, W) of a step, read off the tensor shapes; checks that they agree."""
    _, H, P, N = ssm_state.shape
    conv_dim, W = conv_weight.shape
    d_inner = H * P
    gn2 = conv_dim - d_inner
    if gn2 <= 0 or gn2 % (2 * N):
        raise ValueError(f"conv_dim {conv_dim} is not d_inner {d_inner} + 2 * groups * d_state {N}")
    G = gn2 // (2 * N)
    if zxbcdt.shape[-1] != d_inner + conv_dim + H:
        raise ValueError(f"zxbcdt has {zxbcdt.shape[-1]} columns, expected z | xBC | dt = {d_inner + conv_dim + H}")
    heads_per_group(H, G)
    return H, P, G, N, W


# --------------------------------------------------------------------------------------------
# PyTorch reference twin: the unfused composition
# --------------------------------------------------------------------------------------------


def mamba_decode_step_ref(
    zxbcdt, conv_state, ssm_state, slot_idx, cache_lens, conv_weight, conv_bias, A, D, dt_bias, dt_limit,
    norm_weight, norm_group_size: int, norm_eps: float, arrivals=None,
):
    """PyTorch twin of `mamba_decode_step`, composed from the unfused references.

    zxbcdt (B, 2 d_inner + 2 G N + H) in_proj output (z | xBC | dt) in the activation dtype;
    conv_state (S, conv_dim, W) rings (model dtype) and ssm_state (S, H, P, N) (fp32), both advanced in
    place at `slot_idx (B,)`, whose committed lengths are `cache_lens (B,)` int32; conv_weight
    (conv_dim, W), conv_bias (conv_dim,) or None; A, D, dt_bias (H,) fp32 (D may be None); norm_weight (d_inner,). `arrivals` is the Triton kernel's workspace
    (unused here). -> (B, d_inner) in the promoted dtype of norm_weight and zxbcdt.
    """
    y, z = _gated_inputs_ref(zxbcdt, conv_state, ssm_state, slot_idx, cache_lens, conv_weight, conv_bias, A, D, dt_bias,
                             dt_limit)
    return gated_rms_norm_ref(y, z, norm_weight, norm_group_size, norm_eps, z.dtype)


def mamba_decode_step_deferred_norm_ref(
    zxbcdt, conv_state, ssm_state, slot_idx, cache_lens, conv_weight, conv_bias, A, D, dt_bias, dt_limit,
    norm_weight, norm_eps: float, arrivals=None,
):
    """PyTorch twin of `mamba_decode_step_deferred_norm`: as `mamba_decode_step_ref` with one norm
    group, but -> (u (B, d_inner), SumOfSquares) of `gated_rms_norm_deferred_ref`, so that
    rstd[:, None] * out_proj(u) is out_proj of the normalised step output (up to rounding)."""
    y, z = _gated_inputs_ref(zxbcdt, conv_state, ssm_state, slot_idx, cache_lens, conv_weight, conv_bias, A, D, dt_bias,
                             dt_limit)
    return gated_rms_norm_deferred_ref(y, z, norm_weight, norm_eps, z.dtype)


def mamba_decode_step_gate_only_ref(
    zxbcdt, conv_state, ssm_state, slot_idx, cache_lens, conv_weight, conv_bias, A, D, dt_bias, dt_limit, arrivals=None,
):
    """PyTorch twin of `mamba_decode_step_gate_only`: the arguments of `mamba_decode_step_ref` less the
    norm's -> y * silu(z) (B, d_inner) in zxbcdt's dtype (the chain update applies the gate)."""
    y, _ = _gated_inputs_ref(zxbcdt, conv_state, ssm_state, slot_idx, cache_lens, conv_weight, conv_bias, A, D,
                             dt_bias, dt_limit, gate=True)
    return y


def _gated_inputs_ref(zxbcdt, conv_state, ssm_state, slot_idx, cache_lens, conv_weight, conv_bias, A, D, dt_bias,
                      dt_limit, gate: bool = False):
    """The step up to the gated norm: advances both states in place -> (y (B, d_inner), z (B, d_inner));
    with `gate`, y is already y * silu(z)."""
    H, P, G, N, W = layout(zxbcdt, ssm_state, conv_weight)
    nb = zxbcdt.shape[0]
    d_inner = H * P
    z, xbc, dt = zxbcdt.split([d_inner, d_inner + 2 * G * N, H], dim=-1)
    one = torch.ones(nb, dtype=torch.int32, device=zxbcdt.device)
    cu = torch.arange(nb + 1, dtype=torch.int32, device=zxbcdt.device)
    conv_out = tree_conv1d_ref(xbc, conv_weight, conv_bias, conv_state, -one, cu, slot_idx, cache_lens, 1)
    conv_state_commit_ref(conv_state, slot_idx, xbc, cu[:-1, None], one, cache_lens)  # row b is step 0 of b
    x, Bm, Cm = conv_out.split([d_inner, G * N, G * N], dim=-1)
    y = ssm_chain_update_ref(
        ssm_state, slot_idx, x.reshape(nb, 1, H, P), dt[:, None], A, Bm.reshape(nb, 1, G, N),
        Cm.reshape(nb, 1, G, N), D, dt_bias, dt_limit, z=z.reshape(nb, 1, H, P) if gate else None,
    )
    return y.reshape(nb, d_inner), z


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _conv_window(st, w_ptr, b_ptr, ch, ok, n, s_cd, s_w, W: tl.constexpr, HAS_BIAS: tl.constexpr):
    """What the depthwise conv of channels `ch` needs besides the new input: the window columns
    newest first (o1, o2, o3: positions n-1, n-2, n-3 of the ring; zeros past the width) with their
    taps (w1, w2, w3), the new input's tap w0, and the bias. Kernels of the same step never write
    these (a layer's ring moves only in its own step kernel, and into column n mod W), so they load
    before the wait for the kernel before."""
    zero = tl.zeros(ch.shape, dtype=tl.float32)
    o1, o2, o3, w1, w2, w3, bias = zero, zero, zero, zero, zero, zero, zero
    w0 = tl.load(w_ptr + ch * s_w + (W - 1), mask=ok, other=0.0).to(tl.float32)
    if W > 1:
        o1 = tl.load(st + ch * s_cd + (n + W - 1) % W, mask=ok, other=0.0).to(tl.float32)
        w1 = tl.load(w_ptr + ch * s_w + (W - 2), mask=ok, other=0.0).to(tl.float32)
    if W > 2:
        o2 = tl.load(st + ch * s_cd + (n + W - 2) % W, mask=ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + ch * s_w + (W - 3), mask=ok, other=0.0).to(tl.float32)
    if W > 3:
        o3 = tl.load(st + ch * s_cd + (n + W - 3) % W, mask=ok, other=0.0).to(tl.float32)
        w3 = tl.load(w_ptr + ch * s_w + (W - 4), mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + ch, mask=ok, other=0.0).to(tl.float32)
    return w0, o1, w1, o2, w2, o3, w3, bias


@triton.jit
def _conv_silu(xbc_row, ch, ok, window, W: tl.constexpr, HAS_BIAS: tl.constexpr):
    """SiLU(conv + bias) of channels `ch` over [window | new input] (`window` from `_conv_window`),
    summed in tree_conv1d's order (the new input first, then the window from newest to oldest),
    rounded to the activation dtype (as tree_conv1d's output is) and returned in fp32, with the raw
    new input."""
    w0, o1, w1, o2, w2, o3, w3, bias = window
    new = tl.load(xbc_row + ch, mask=ok, other=0.0)
    acc = new.to(tl.float32) * w0
    if W > 1:
        acc += o1 * w1
    if W > 2:
        acc += o2 * w2
    if W > 3:
        acc += o3 * w3
    if HAS_BIAS:
        acc += bias
    return silu(acc).to(xbc_row.dtype.element_ty).to(tl.float32), new


@triton.jit
def _mamba_step_kernel(
    zx_ptr, conv_ptr, cw_ptr, cb_ptr, ssm_ptr, slot_ptr, lens_ptr, A_ptr, D_ptr, dtb_ptr, nw_ptr,
    gate_ptr, part_ptr, arrive_ptr, out_ptr,
    H, heads_per_group, GN, group_size, n_norm_groups, dt_lo, dt_hi, eps,
    s_zx, s_cs, s_cd, s_w, ss_s, ss_h, ss_p, ss_n, s_out,
    P: tl.constexpr, N: tl.constexpr, W: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_CONV_BIAS: tl.constexpr, HAS_D: tl.constexpr, EPI: tl.constexpr, PARTS: tl.constexpr,
    GATE: tl.constexpr,
    PDL: tl.constexpr,
):
    """GATE (see GATE_NORM, GATE_DEFER, GATE_ONLY): GATE_DEFER writes w * gated to out and each
    program's partial sum of squares to part_ptr (one norm group) instead of normalising the row in
    the last program; GATE_ONLY writes gated to out and reads no norm weight. Only GATE_NORM counts
    arrivals."""
    release_next(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    pt = tl.program_id(2)
    N_PT: tl.constexpr = (P + BP - 1) // BP
    n_prog = H * N_PT  # programs per row
    DI = H * P
    g = h // heads_per_group
    b64 = b.to(tl.int64)
    offs_p = pt * BP + tl.arange(0, BP)
    p_ok = offs_p < P
    cx = h * P + offs_p
    offs_n = tl.arange(0, BN)
    n_ok = offs_n < N

    # ---- before the wait (PDL): what the kernel before cannot have written. The slot ids and lengths
    # are set before the step's first kernel; this layer's conv ring and SSM state change only here.
    slot = tl.load(slot_ptr + b).to(tl.int64)
    n = tl.load(lens_ptr + b)
    st = conv_ptr + slot * s_cs
    x_window = _conv_window(st, cw_ptr, cb_ptr, cx, p_ok, n, s_cd, s_w, W, HAS_CONV_BIAS)
    B_window = _conv_window(st, cw_ptr, cb_ptr, DI + g * N + offs_n, n_ok, n, s_cd, s_w, W, HAS_CONV_BIAS)
    C_window = _conv_window(st, cw_ptr, cb_ptr, DI + GN + g * N + offs_n, n_ok, n, s_cd, s_w, W, HAS_CONV_BIAS)
    A = tl.load(A_ptr + h).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    D = tl.load(D_ptr + h).to(tl.float32) if HAS_D else 0.0
    if GATE == 1:  # norm weight of own channels
        w_own = tl.load(nw_ptr + cx, mask=p_ok, other=0.0).to(tl.float32)
    st_ptrs = ssm_ptr + slot * ss_s + h * ss_h + offs_p[:, None] * ss_p + offs_n[None, :] * ss_n
    st_mask = p_ok[:, None] & n_ok[None, :]
    state = tl.load(st_ptrs, mask=st_mask, other=0.0)
    wait_for_previous(PDL)  # the in_proj row below is the kernel before's output
    row = zx_ptr + b64 * s_zx  # z | xBC | dt of this sequence
    xbc_row = row + DI

    # ---- conv: this program's x channels and its group's B, C; the new inputs enter the ring at
    # column n mod W, which no program reads in this step: x by its owner, B and C by the group's
    # first program
    x, x_new = _conv_silu(xbc_row, cx, p_ok, x_window, W, HAS_CONV_BIAS)
    Bv, B_new = _conv_silu(xbc_row, DI + g * N + offs_n, n_ok, B_window, W, HAS_CONV_BIAS)
    Cv, C_new = _conv_silu(xbc_row, DI + GN + g * N + offs_n, n_ok, C_window, W, HAS_CONV_BIAS)
    col = n % W
    tl.store(st + cx * s_cd + col, x_new.to(conv_ptr.dtype.element_ty), mask=p_ok)
    if (h % heads_per_group == 0) & (pt == 0):
        tl.store(st + (DI + g * N + offs_n) * s_cd + col, B_new.to(conv_ptr.dtype.element_ty), mask=n_ok)
        tl.store(st + (DI + GN + g * N + offs_n) * s_cd + col, C_new.to(conv_ptr.dtype.element_ty), mask=n_ok)

    # ---- SSM state update, as ssm_chain_update with K = 1
    dt = tl.load(xbc_row + DI + 2 * GN + h).to(tl.float32)
    dt = softplus_clamped(dt + dt_bias, dt_lo, dt_hi)
    state = state * tl.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
    tl.store(st_ptrs, state, mask=st_mask)
    y = tl.sum(state * Cv[None, :], axis=1)
    if HAS_D:
        y += D * x
    if GATE != 2:  # ssm_chain_update's output dtype (with the gate, it rounds only the gated value)
        y = y.to(zx_ptr.dtype.element_ty).to(tl.float32)

    # ---- gate; the norm needs the whole group: hand over the gated values and their sum of squares
    z = tl.load(row + cx, mask=p_ok, other=0.0).to(tl.float32)
    gated = tl.where(p_ok, y * silu(z), 0.0)
    if GATE == 2:
        tl.store(out_ptr + b64 * s_out + cx, gated.to(out_ptr.dtype.element_ty), mask=p_ok)
    elif GATE == 1:  # w * gated, rounded where gated_rms_norm_deferred_ref rounds
        g_own = gated.to(zx_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + b64 * s_out + cx, (w_own * g_own).to(out_ptr.dtype.element_ty), mask=p_ok)
    else:
        tl.store(gate_ptr + b64 * DI + cx, gated, mask=p_ok)
    if GATE != 2:
        tl.store(part_ptr + b64 * n_prog + h * N_PT + pt, tl.sum(gated * gated, axis=0))
    if GATE == 0:
        # all of this program's reads and writes are done (barrier) before its arrival is published
        # (release); the last arriver's acquire makes every program's writes visible to it
        tl.debug_barrier()
        arrived = tl.atomic_add(arrive_ptr + b, 1, sem="acq_rel", scope="gpu")
        if arrived == n_prog - 1:
            _normalise_row(gate_ptr, part_ptr, nw_ptr, out_ptr, zx_ptr, b64, DI, n_prog, group_size,
                           n_norm_groups, eps, s_out, P, N_PT, EPI, PARTS)
            tl.store(arrive_ptr + b, 0)  # ready for the next launch


@triton.jit
def _normalise_row(gate_ptr, part_ptr, nw_ptr, out_ptr, zx_ptr, b64, DI, n_prog, group_size, n_norm_groups, eps,
                   s_out, P: tl.constexpr, N_PT: tl.constexpr, EPI: tl.constexpr, PARTS: tl.constexpr):
    """The last program of a row: gated RMSNorm group by group, from every program's gated values and
    partial sums; programs never straddle groups (group_size % P == 0)."""
    per_group = group_size // P * N_PT
    for j in range(n_norm_groups):
        ss = tl.zeros((PARTS,), dtype=tl.float32)
        for q0 in range(0, per_group, PARTS):
            q = q0 + tl.arange(0, PARTS)
            ss += tl.load(part_ptr + b64 * n_prog + j * per_group + q, mask=q < per_group, other=0.0,
                          cache_modifier=".cg")
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / group_size + eps)
        for c0 in range(0, group_size, EPI):
            c = c0 + tl.arange(0, EPI)
            ok = c < group_size
            ch = j * group_size + c
            gv = tl.load(gate_ptr + b64 * DI + ch, mask=ok, other=0.0, cache_modifier=".cg")
            v = (gv * rstd).to(zx_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(nw_ptr + ch, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + b64 * s_out + ch, (w * v).to(out_ptr.dtype.element_ty), mask=ok)


def new_arrivals(rows: int, device) -> torch.Tensor:
    """Zeroed arrival counters for batches of up to `rows` sequences (one per row; every launch leaves
    them at zero, so one buffer serves every step and layer that runs on its stream)."""
    return torch.zeros(rows, dtype=torch.int32, device=device)


def mamba_decode_step(
    zxbcdt, conv_state, ssm_state, slot_idx, cache_lens, conv_weight, conv_bias, A, D, dt_bias, dt_limit,
    norm_weight, norm_group_size: int, norm_eps: float, arrivals=None,
):
    """Triton `mamba_decode_step`: same contract as `mamba_decode_step_ref`; `arrivals` int32 (>= B,)
    zeros (see `new_arrivals`; allocated here when None, which a CUDA graph capture must not rely on).

    Slots in `slot_idx` must be distinct except for a scratch slot whose results do not matter
    (padded rows of captured graphs). Needs norm groups of whole heads (`norm_group_size % P == 0`).
    """
    out, _ = _launch(zxbcdt, conv_state, ssm_state, slot_idx, cache_lens, conv_weight, conv_bias, A, D, dt_bias,
                     dt_limit, norm_weight, norm_group_size, norm_eps, arrivals, GATE_NORM)
    return out


def mamba_decode_step_deferred_norm(
    zxbcdt, conv_state, ssm_state, slot_idx, cache_lens, conv_weight, conv_bias, A, D, dt_bias, dt_limit,
    norm_weight, norm_eps: float, arrivals=None,
):
    """Triton `mamba_decode_step_deferred_norm`: same contract as its `_ref` twin, same conditions as
    `mamba_decode_step` -> (u (B, d_inner), SumOfSquares with one partial sum per program of a row);
    `arrivals` is not used (no program waits for the others)."""
    return _launch(zxbcdt, conv_state, ssm_state, slot_idx, cache_lens, conv_weight, conv_bias, A, D, dt_bias,
                   dt_limit, norm_weight, None, norm_eps, arrivals, GATE_DEFER)


def mamba_decode_step_gate_only(
    zxbcdt, conv_state, ssm_state, slot_idx, cache_lens, conv_weight, conv_bias, A, D, dt_bias, dt_limit,
    arrivals=None,
):
    """Triton `mamba_decode_step_gate_only`: same contract as its `_ref` twin, slots as in
    `mamba_decode_step` -> y * silu(z) (B, d_inner) in zxbcdt's dtype; `arrivals` is not used."""
    out, _ = _launch(zxbcdt, conv_state, ssm_state, slot_idx, cache_lens, conv_weight, conv_bias, A, D, dt_bias,
                     dt_limit, None, None, 0.0, arrivals, GATE_ONLY)
    return out


def _launch(zxbcdt, conv_state, ssm_state, slot_idx, cache_lens, conv_weight, conv_bias, A, D, dt_bias, dt_limit,
            norm_weight, norm_group_size: int | None, norm_eps: float, arrivals, gate: int):
    """Check, allocate and launch -> (out (B, d_inner), SumOfSquares for GATE_DEFER, else None).
    `norm_group_size` None: one norm group over the whole row (d_inner channels); `norm_weight`
    None with GATE_ONLY."""
    H, P, G, N, W = layout(zxbcdt, ssm_state, conv_weight)
    nb = zxbcdt.shape[0]
    d_inner = H * P
    if norm_group_size is None:
        norm_group_size = d_inner
    if not 1 <= W <= 4:
        raise ValueError(f"conv width {W} is not in 1..4")
    if d_inner % norm_group_size or norm_group_size % P:
        raise ValueError(f"norm groups of {norm_group_size} channels must be whole heads of {P} within {d_inner}")
    check_ring(conv_state, W)
    out_dtype = zxbcdt.dtype if norm_weight is None else torch.promote_types(norm_weight.dtype, zxbcdt.dtype)
    out = ssm_common.new_output((nb, d_inner), out_dtype, zxbcdt.device)
    bn = pow2(N, 1)
    bp = max(1, min(pow2(P, 1), STATE_TILE // bn))
    n_prog = H * triton.cdiv(P, bp)
    parts = torch.empty(nb, n_prog, dtype=torch.float32, device=zxbcdt.device) if gate != GATE_ONLY else out
    scale = SumOfSquares(parts, d_inner, float(norm_eps)) if gate == GATE_DEFER else None
    if nb == 0:
        return out, scale
    if gate == GATE_NORM:
        if arrivals is None:
            arrivals = new_arrivals(nb, zxbcdt.device)
        if arrivals.dtype != torch.int32 or arrivals.numel() < nb or not arrivals.is_contiguous():
            raise ValueError(f"arrivals must be {nb} or more contiguous int32 zeros")
    zxbcdt = last_axis_contiguous(zxbcdt)
    conv_weight = conv_weight.contiguous()
    per_group = norm_group_size // P * triton.cdiv(P, bp)
    # the gated values only travel through memory when the last program normalises them
    gated = torch.empty(nb, d_inner, dtype=torch.float32, device=zxbcdt.device) if gate == GATE_NORM else out
    lo, hi = limits(dt_limit)
    _mamba_step_kernel[(nb, H, triton.cdiv(P, bp))](
        zxbcdt, conv_state, conv_weight, conv_bias if conv_bias is not None else conv_weight, ssm_state,
        as_int32(slot_idx), as_int32(cache_lens), A, D if D is not None else A,
        dt_bias if dt_bias is not None else torch.zeros_like(A),
        out if norm_weight is None else norm_weight.contiguous(), gated, parts,
        arrivals if gate == GATE_NORM else parts, out,
        H, heads_per_group(H, G), G * N, norm_group_size, d_inner // norm_group_size, lo, hi, float(norm_eps),
        zxbcdt.stride(0), conv_state.stride(0), conv_state.stride(1),
        conv_weight.stride(0), *ssm_state.stride(), out.stride(0),
        P=P, N=N, W=W, BP=bp, BN=bn, HAS_CONV_BIAS=conv_bias is not None, HAS_D=D is not None,
        EPI=EPILOGUE_BLOCK, PARTS=min(PARTS_BLOCK, pow2(per_group, 1)), GATE=gate,
        **pdl.launch_options(zxbcdt.device), num_warps=4,
    )
    return out, scale
