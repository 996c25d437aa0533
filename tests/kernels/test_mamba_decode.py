"""The fused Mamba2 decode step: Triton (interpreted) vs its PyTorch twin (the unfused composition of
tree_conv1d, conv_state_commit, ssm_chain_update and gated_rms_norm) vs a float64 oracle, and vs the
unfused Triton kernels. Interpreted programs run one after another, so the "last arriver" epilogue
runs here, but races between programs only show on a GPU (tests/gpu/test_fused_decode_gpu.py).
Conv states are rings at random committed lengths (kernels/conv_tree.py), small ones included."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import conv_tree, mamba_decode, norms, ssm_common, ssm_decode
from kernels.mamba_decode import (
    mamba_decode_step,
    mamba_decode_step_deferred_norm,
    mamba_decode_step_deferred_norm_ref,
    mamba_decode_step_gate_only,
    mamba_decode_step_gate_only_ref,
    mamba_decode_step_ref,
)
from tests.kernels.ssm_oracle import (
    LIMIT,
    Mamba2Step,
    assert_close,
    layer_weights,
    nan_output,
    rand,
    ring_window,
    untouched_slots,
)

F32, F16 = torch.float32, torch.float16
TOL = {F32: 1e-4, F16: 1e-2}  # against the float64 oracle (fp16 rounds the conv output and y)
TWIN_TOL = {F32: 1e-5, F16: 2e-3}  # Triton vs twin: summation order, then at most an ulp of fp16


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(ssm_common, "new_output", nan_output)


def step_case(nb, H, P, N, G, W, seed, dtype=F32, slots=6, conv_bias=True, with_D=True, norm_groups=1,
              dt_limit=LIMIT, dt_shift=0.0):
    """kwargs of mamba_decode_step for `nb` sequences in distinct random slots of a pool of `slots`."""
    gen = torch.Generator().manual_seed(seed)
    d_inner, gn = H * P, G * N
    conv_dim = d_inner + 2 * gn
    A, D, dt_bias = layer_weights(H, gen)
    zxbcdt = rand(gen, nb, d_inner + conv_dim + H, dtype=dtype)
    zxbcdt[:, -H:] += dt_shift
    lens = [0, 1, 2, 3, 7, 40, 41, 42, 43]
    return dict(
        zxbcdt=zxbcdt, conv_state=rand(gen, slots, conv_dim, W, dtype=dtype), ssm_state=rand(gen, slots, H, P, N),
        slot_idx=torch.randperm(slots, generator=gen)[:nb].to(torch.int32),
        cache_lens=torch.tensor([lens[i] for i in torch.randint(len(lens), (nb,), generator=gen)], dtype=torch.int32),
        conv_weight=rand(gen, conv_dim, W, dtype=dtype, scale=0.5),
        conv_bias=rand(gen, conv_dim, dtype=dtype) if conv_bias else None, A=A, D=D if with_D else None,
        dt_bias=dt_bias, dt_limit=dt_limit, norm_weight=rand(gen, d_inner, dtype=dtype),
        norm_group_size=d_inner // norm_groups, norm_eps=1e-5,
    )


def oracle(args):
    """(out (B, d_inner), new conv rings (B, conv_dim, W), new SSM states (B, H, P, N), the gated
    value y * silu(z) (B, d_inner)) in float64, straight from the definitions (no rounding anywhere)."""
    _, H, P, N = args["ssm_state"].shape
    d_inner = H * P
    conv_dim, W = args["conv_weight"].shape
    step = Mamba2Step(args["A"], args["D"], args["dt_bias"], args["dt_limit"])
    outs, convs, ssms, gates = [], [], [], []
    for b, (slot, n) in enumerate(zip(args["slot_idx"].tolist(), args["cache_lens"].tolist())):
        z, xbc, dt = args["zxbcdt"][b].double().split([d_inner, conv_dim, H])
        ring = args["conv_state"][slot].double()
        window = torch.cat([ring_window(ring, n), xbc[:, None]], dim=1)  # (conv_dim, W)
        conv = (window * args["conv_weight"].double()).sum(1)
        if args["conv_bias"] is not None:
            conv = conv + args["conv_bias"].double()
        x, B, C = F.silu(conv).split([d_inner, (conv_dim - d_inner) // 2, (conv_dim - d_inner) // 2])
        h, y = step(args["ssm_state"][slot].double(), x.view(H, P), dt, B.view(-1, N), C.view(-1, N))
        gates.append(y.reshape(-1) * F.silu(z))
        g = gates[-1].view(-1, args["norm_group_size"])
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + args["norm_eps"])
        outs.append(g.reshape(-1) * args["norm_weight"].double())
        ring = ring.clone()
        ring[:, n % W] = xbc
        convs.append(ring)
        ssms.append(h)
    return torch.stack(outs), torch.stack(convs), torch.stack(ssms), torch.stack(gates)


def run(fn, args, **kw):
    """Run `fn` on a copy of the pools -> (out, conv pool, ssm pool)."""
    a = {**args, "conv_state": args["conv_state"].clone(), "ssm_state": args["ssm_state"].clone()}
    out = fn(**a, **kw)
    return out, a["conv_state"], a["ssm_state"]


def check(args, dtype=F32):
    """Triton vs twin vs oracle: outputs, both states at the batch's slots, every other slot untouched,
    and the arrival counters back at zero."""
    slots = args["slot_idx"].long()
    keep = untouched_slots(args["ssm_state"], slots)
    arrivals = torch.zeros(args["zxbcdt"].shape[0] + 3, dtype=torch.int32)
    want_out, want_conv, want_ssm, want_gated = oracle(args)
    got = run(mamba_decode_step, args, arrivals=arrivals)
    ref = run(mamba_decode_step_ref, args)
    assert not arrivals.any(), "arrival counters must return to zero"
    for (out, conv, ssm), name in ((got, "triton"), (ref, "twin")):
        assert out.dtype == torch.promote_types(args["norm_weight"].dtype, dtype)
        assert_close(out, want_out, TOL[dtype], f"{name} out vs oracle")
        assert torch.equal(conv[slots], want_conv.to(conv.dtype)), f"{name} conv state"
        assert_close(ssm[slots], want_ssm, TOL[dtype], f"{name} ssm state vs oracle")
        assert torch.equal(conv[keep], args["conv_state"][keep]), f"{name} touched other conv slots"
        assert torch.equal(ssm[keep], args["ssm_state"][keep]), f"{name} touched other ssm slots"
    assert_close(got[0], ref[0], TWIN_TOL[dtype], "triton vs twin out")
    assert_close(got[2][slots], ref[2][slots], TWIN_TOL[dtype], "triton vs twin ssm state")
    if args["norm_group_size"] == args["ssm_state"].shape[1] * args["ssm_state"].shape[2]:
        check_deferred(args, dtype, want_out, got)
    check_gate_only(args, dtype, want_gated, got, ref)
    return got, ref


def deferred_args(args):
    return {k: v for k, v in args.items() if k != "norm_group_size"}


def check_deferred(args, dtype, want_out, fused):
    """The deferred-norm step: u * rstd is the normalised output (oracle), Triton equals its twin,
    and both states advance exactly as in the normalising step `fused` (Triton). Its scale comes as
    partial sums of squares, one per program; the rstd they give is the twin's."""
    arrivals = torch.zeros(args["zxbcdt"].shape[0], dtype=torch.int32)
    (u, sums), conv, ssm = run(mamba_decode_step_deferred_norm, deferred_args(args), arrivals=arrivals)
    (u_ref, sums_ref), conv_ref, ssm_ref = run(mamba_decode_step_deferred_norm_ref, deferred_args(args))
    assert not arrivals.any(), "the deferred step counts no arrivals"
    nb, (_, H, P, _) = args["zxbcdt"].shape[0], args["ssm_state"].shape
    assert sums.parts.dtype == torch.float32 and sums.parts.shape[0] == nb and sums.parts.shape[1] >= H
    assert not sums.parts.isnan().any(), "every program writes its partial sum"
    assert sums.count == sums_ref.count == H * P and sums.eps == sums_ref.eps == args["norm_eps"]
    rstd, rstd_ref = sums.rstd(), sums_ref.rstd()
    assert u.dtype == fused[0].dtype
    for uu, rr, name in ((u, rstd, "triton"), (u_ref, rstd_ref, "twin")):
        assert_close(uu.double() * rr.double()[:, None], want_out, TOL[dtype], f"{name} deferred u * rstd vs oracle")
    assert_close(u, u_ref, TWIN_TOL[dtype], "triton vs twin u")
    assert_close(rstd, rstd_ref, TWIN_TOL[F32], "triton vs twin rstd")
    assert torch.equal(conv, fused[1]) and torch.equal(ssm, fused[2]), "deferred step moved the states differently"
    assert torch.equal(conv_ref, conv)


def gate_only_args(args):
    return {k: v for k, v in args.items() if not k.startswith("norm_")}


def check_gate_only(args, dtype, want_gated, fused, fused_ref):
    """The step without a norm (y * silu(z)): Triton and twin against the oracle and each other, in the
    activation dtype, and both states advanced exactly as the normalising step advances them."""
    arrivals = torch.zeros(args["zxbcdt"].shape[0], dtype=torch.int32)
    got, conv, ssm = run(mamba_decode_step_gate_only, gate_only_args(args), arrivals=arrivals)
    ref, conv_ref, ssm_ref = run(mamba_decode_step_gate_only_ref, gate_only_args(args))
    assert not arrivals.any(), "arrival counters must return to zero"
    assert got.dtype == ref.dtype == dtype
    for out, name in ((got, "triton"), (ref, "twin")):
        assert_close(out, want_gated, TOL[dtype], f"{name} gate-only out vs oracle")
    assert_close(got, ref, TWIN_TOL[dtype], "triton vs twin gate-only out")
    assert torch.equal(conv, fused[1]) and torch.equal(ssm, fused[2]), "gate-only step moved the states differently"
    assert torch.equal(conv_ref, fused_ref[1]) and torch.equal(ssm_ref, fused_ref[2])


# (nb, H, P, N, G, W): several tiles per head (N 128 -> 8-row tiles), a headdim that is not a power
# of two, one head, groups of several heads, every conv width
SHAPES = [
    (3, 4, 16, 8, 2, 4), (2, 2, 16, 128, 1, 4), (2, 3, 24, 16, 3, 3), (1, 1, 16, 16, 1, 2),
    (4, 4, 8, 32, 2, 4), (2, 6, 16, 16, 2, 1),
]


@pytest.mark.parametrize("nb,H,P,N,G,W", SHAPES)
@pytest.mark.parametrize("dtype", [F32, F16])
def test_matches_twin_and_oracle(nb, H, P, N, G, W, dtype):
    check(step_case(nb, H, P, N, G, W, seed=nb * 31 + H * 7 + W, dtype=dtype), dtype)


@pytest.mark.parametrize("norm_groups", [2, 4])
def test_grouped_norm(norm_groups):
    """NemotronH normalises by groups of heads."""
    check(step_case(3, 4, 16, 16, 2, 4, seed=5, norm_groups=norm_groups))


def test_no_conv_bias_no_skip_dt_limit():
    args = step_case(2, 4, 16, 16, 2, 4, seed=6, conv_bias=False, with_D=False, dt_limit=(0.05, 0.5))
    check(args)


def test_large_dt_does_not_overflow():
    check(step_case(2, 2, 16, 16, 1, 4, seed=7, dt_shift=40.0))


def test_epilogue_loops(monkeypatch):
    """Blocks smaller than the row: the last program loops over channel chunks and partial sums."""
    monkeypatch.setattr(mamba_decode, "EPILOGUE_BLOCK", 16)
    monkeypatch.setattr(mamba_decode, "PARTS_BLOCK", 2)
    monkeypatch.setattr(mamba_decode, "STATE_TILE", 64)  # 4-row tiles: 4 programs per head
    check(step_case(3, 4, 16, 16, 2, 4, seed=8, norm_groups=2))
    check(step_case(2, 3, 16, 24, 1, 3, seed=9))


def test_equals_unfused_triton_kernels():
    """The fused step against the unfused Triton kernels the decode path launched before."""
    args = step_case(3, 4, 16, 16, 2, 4, seed=10, dtype=F16)
    got_out, got_conv, got_ssm = run(mamba_decode_step, args)
    nb, H, P, N = 3, 4, 16, 16
    d_inner, conv_dim = H * P, H * P + 2 * 2 * N
    conv, ssm = args["conv_state"].clone(), args["ssm_state"].clone()
    z, xbc, dt = args["zxbcdt"].split([d_inner, conv_dim, H], dim=-1)
    one = torch.ones(nb, dtype=torch.int32)
    cu = torch.arange(nb + 1, dtype=torch.int32)
    conv_out = conv_tree.tree_conv1d(xbc, args["conv_weight"], args["conv_bias"], conv, -one, cu, args["slot_idx"],
                                     args["cache_lens"], 1)
    conv_tree.conv_state_commit(conv, args["slot_idx"], xbc, cu[:-1, None], one, args["cache_lens"])
    x, B, C = conv_out.split([d_inner, 2 * N, 2 * N], dim=-1)
    y = ssm_decode.ssm_chain_update(
        ssm, args["slot_idx"], x.reshape(nb, 1, H, P), dt[:, None], args["A"], B.reshape(nb, 1, 2, N),
        C.reshape(nb, 1, 2, N), args["D"], args["dt_bias"], args["dt_limit"],
    )
    out = norms.gated_rms_norm(y.reshape(nb, d_inner), z, args["norm_weight"], d_inner, 1e-5, F16)
    assert_close(got_out, out, TWIN_TOL[F16], "fused vs unfused out")
    assert torch.equal(got_conv, conv)
    assert_close(got_ssm, ssm, TWIN_TOL[F16], "fused vs unfused ssm state")


def test_consecutive_steps_and_strided_layer_views():
    """Five steps on per-layer views of (S, layers, ...) pools, as the model passes them (the rings
    wrap); the other layer is untouched and one arrival buffer serves every step."""
    nb, H, P, N, G, W, S = 2, 4, 16, 16, 2, 4, 5
    conv_pool = rand(torch.Generator().manual_seed(1), S, 2, H * P + 2 * G * N, W)
    ssm_pool = rand(torch.Generator().manual_seed(2), S, 2, H, P, N)
    pools = {"triton": (conv_pool.clone(), ssm_pool.clone()), "twin": (conv_pool.clone(), ssm_pool.clone())}
    arrivals = torch.zeros(4, dtype=torch.int32)
    for step in range(5):
        args = step_case(nb, H, P, N, G, W, seed=20 + step, slots=S)
        args["slot_idx"] = torch.tensor([3, 0], dtype=torch.int32)
        args["cache_lens"] = torch.tensor([step, 9 + step], dtype=torch.int32)
        outs = {}
        for name, fn in (("triton", mamba_decode_step), ("twin", mamba_decode_step_ref)):
            conv, ssm = pools[name]
            kw = dict(args, conv_state=conv[:, 1], ssm_state=ssm[:, 1])
            outs[name] = fn(**kw, arrivals=arrivals)
        assert not arrivals.any()
        assert_close(outs["triton"], outs["twin"], TWIN_TOL[F32], f"step {step} out")
        assert torch.equal(pools["triton"][0], pools["twin"][0]), f"step {step} conv pool"
        assert_close(pools["triton"][1], pools["twin"][1], TWIN_TOL[F32], f"step {step} ssm pool")
    for conv, ssm in pools.values():
        assert torch.equal(conv[:, 0], conv_pool[:, 0]) and torch.equal(ssm[:, 0], ssm_pool[:, 0])


def test_padded_rows_share_the_scratch_slot():
    """Captured graphs pad the batch with rows that all point at the scratch slot: real rows and real
    slots are unaffected, and the counters still return to zero."""
    args = step_case(5, 4, 16, 16, 2, 4, seed=11, slots=7)
    args["slot_idx"] = torch.tensor([2, 5, 6, 6, 6], dtype=torch.int32)  # slot 6 is scratch
    args["cache_lens"] = torch.tensor([5, 2, 0, 0, 0], dtype=torch.int32)
    real = dict(args, zxbcdt=args["zxbcdt"][:2], slot_idx=args["slot_idx"][:2], cache_lens=args["cache_lens"][:2])
    arrivals = torch.zeros(5, dtype=torch.int32)
    out, conv, ssm = run(mamba_decode_step, args, arrivals=arrivals)
    want_out, want_conv, want_ssm = run(mamba_decode_step_ref, real)
    assert not arrivals.any()
    assert_close(out[:2], want_out, TWIN_TOL[F32], "real rows")
    assert torch.equal(conv[:6], want_conv[:6])
    assert_close(ssm[:6], want_ssm[:6], TWIN_TOL[F32], "real slots")


def test_refuses_what_it_cannot_do():
    args = step_case(2, 4, 16, 16, 2, 4, seed=12)
    with pytest.raises(ValueError, match="whole heads"):
        mamba_decode_step(**dict(args, norm_group_size=8))
    with pytest.raises(ValueError, match="arrivals"):
        mamba_decode_step(**args, arrivals=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="columns"):
        mamba_decode_step(**dict(args, zxbcdt=args["zxbcdt"][:, 1:]))
    for step in (mamba_decode_step, mamba_decode_step_deferred_norm, mamba_decode_step_gate_only):
        with pytest.raises(ValueError, match="rings"):
            kw = {k: v for k, v in args.items() if k in step.__code__.co_varnames}
            step(**dict(kw, conv_state=args["conv_state"][..., 1:].contiguous()))


def test_compiles_for_sm90():
    """At the GPU shapes' constexprs (headdim 64 / 128, d_state 128 / 256, width 4; bf16 and fp32), for an
    H100 through ptxas, without register spills. Heads are not constexpr: two suffice to record."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from tests.kernels.ssm_oracle import assert_compiles_for_sm90

    def run_all():
        for P, G, dtype in ((64, 1, torch.bfloat16), (128, 2, torch.bfloat16), (64, 1, F32)):
            mamba_decode_step(**step_case(1, 2, P, 128, G, 4, seed=13, dtype=dtype))
        mamba_decode_step(**step_case(1, 2, 64, 128, 1, 4, seed=13, dtype=torch.bfloat16, conv_bias=False))
        for P, dtype in ((64, torch.bfloat16), (64, F32)):
            mamba_decode_step_deferred_norm(**deferred_args(step_case(1, 2, P, 128, 1, 4, seed=13, dtype=dtype)))
        for N in (128, 256):  # FalconH1: no norm, d_state up to 256
            mamba_decode_step_gate_only(**gate_only_args(step_case(1, 2, 64, N, 1, 4, seed=13, dtype=torch.bfloat16)))

    assert_compiles_for_sm90([mamba_decode._mamba_step_kernel], run_all)
