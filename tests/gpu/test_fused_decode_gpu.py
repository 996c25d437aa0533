"""The fused decode kernels on CUDA at the real layer shapes (design §9), bf16 activations, fp32 state.

    TRITON_INTERPRET=0 python -m pytest -q tests/gpu/test_fused_decode_gpu.py

The fused Mamba2 step hands a grouped gated norm to the last program of each row to finish, and
every program of a group reads the B/C conv windows while one of them writes the new inputs into
the ring; only a GPU runs programs concurrently, so these tests repeat steps at large batches
(lengths advancing, so the rings wrap), where a missing release/acquire, a stale cache line or a
write into a column still being read would show as a wrong row. Tolerances as in test_ssm_gpu.py: 1e-2 relative for bf16 outputs (one bf16 ulp is 4e-3),
1e-3 for fp32 states plus the rounding of the update's bf16 factors (`assert_state_close`); conv
states are data movement and must be equal.
"""

import pytest
import torch

from kernels import norms, ops
from kernels.mamba_decode import (
    mamba_decode_step,
    mamba_decode_step_deferred_norm,
    mamba_decode_step_deferred_norm_ref,
    mamba_decode_step_gate_only,
    mamba_decode_step_gate_only_ref,
    mamba_decode_step_ref,
)
from tests.gpu.marks import compiled_triton, gpu  # noqa: F401 (fixture)
from tests.kernels.ssm_oracle import assert_close, on, untouched_slots
from tests.kernels.test_mamba_decode import deferred_args, gate_only_args, oracle, step_case

# (H, P, N, G, norm groups): Mamba2-2.7B; the 8B hybrid of bench.model_runtime (Bamba, ungrouped
# norm); a NemotronH-style layer whose gated norm works by groups
SHAPES = {
    "mamba2-2.7b": (80, 64, 128, 1, 1),
    "hybrid-8b": (32, 128, 128, 8, 1),
    "grouped-norm": (64, 64, 128, 8, 8),
    "falcon-h1": (48, 64, 256, 1, 1),  # bench.model_runtime's FalconH1 (d_state 256)
}
BF16, BF16_TOL, STATE_TOL = torch.bfloat16, 1e-2, 1e-3
DEV = "cuda"
NB_LARGE = 128
STEPS = 40


# The state update dt x (x) B takes x and B as the conv's bf16 outputs. The float64 oracle does not
# round them (each rounding moves a factor by up to 2^-8), and the kernel's fp32 conv and SiLU (FMA,
# fast exp) differ from PyTorch's by a few fp32 ulps, enough to round a factor to the other bf16
# neighbour (up to 2^-7). Either way the state moves by up to 2^-6 of |dt x B| at that element.
BF16_FACTORS = 2.0 ** -6


def update_size(args):
    """|dt x (x) B| at every element of the SSM pool (zero off the batch's slots): the twin's new
    state when the old one is zero."""
    zero = {**args, "conv_state": args["conv_state"].clone(), "ssm_state": torch.zeros_like(args["ssm_state"])}
    mamba_decode_step_ref(**zero)
    return zero["ssm_state"].abs()


def assert_state_close(actual, expected, update, what):
    """|a - e| <= STATE_TOL (|e| + max|e|) + BF16_FACTORS |dt x B| elementwise."""
    a, e = actual.double(), expected.double()
    bound = STATE_TOL * (e.abs() + e.abs().max().clamp(min=1e-6)) + BF16_FACTORS * update.double()
    err = (a - e).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: max |err| {err.max().item():.3g} is {worst:.2f}x the bound"


def case(shape, nb, seed, slots=None):
    H, P, N, G, ng = SHAPES[shape]
    return on(step_case(nb, H, P, N, G, 4, seed=seed, dtype=BF16, slots=slots or nb + 3, norm_groups=ng), DEV)


def compare(args, arrivals, what):
    """One step of the fused kernel and of its twin on copies of the pools; returns the twin's pools."""
    a = {**args, "conv_state": args["conv_state"].clone(), "ssm_state": args["ssm_state"].clone()}
    r = {**args, "conv_state": args["conv_state"].clone(), "ssm_state": args["ssm_state"].clone()}
    update = update_size(args)
    out = mamba_decode_step(**a, arrivals=arrivals)
    ref = mamba_decode_step_ref(**r)
    assert not arrivals.any(), f"{what}: arrival counters not back at zero"
    assert_close(out, ref, BF16_TOL, f"{what}: out")
    assert torch.equal(a["conv_state"], r["conv_state"]), f"{what}: conv state"
    assert_state_close(a["ssm_state"], r["ssm_state"], update, f"{what}: ssm state")
    return a, r


@gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nb", [1, 16, 64])
def test_fused_step_matches_twin(shape, nb):
    args = case(shape, nb, seed=nb)
    arrivals = torch.zeros(nb, dtype=torch.int32, device=DEV)
    a, _ = compare(args, arrivals, f"{shape} batch {nb}")
    slots = args["slot_idx"].long()
    keep = untouched_slots(args["ssm_state"], slots)
    assert torch.equal(a["ssm_state"][keep], args["ssm_state"][keep]), "touched other slots"
    if nb == 1:  # the float64 oracle walks rows in Python: one is enough
        want_out, want_conv, want_ssm, _ = oracle(args)
        update = update_size(args)[slots]
        out = mamba_decode_step(**args, arrivals=arrivals)
        assert_close(out, want_out, BF16_TOL, "out vs oracle")
        assert torch.equal(args["conv_state"][slots], want_conv.to(BF16))
        assert_state_close(args["ssm_state"][slots], want_ssm, update, "ssm state vs oracle")


@gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_many_steps_at_large_batch_with_padded_rows(shape):
    """40 steps of 120 real rows plus 8 padded rows on one scratch slot; each step checked."""
    nb, real = NB_LARGE, NB_LARGE - 8
    arrivals = torch.zeros(nb, dtype=torch.int32, device=DEV)
    args = case(shape, nb, seed=1, slots=real + 1)
    conv, ssm = args["conv_state"], args["ssm_state"]
    gen = torch.Generator(device=DEV).manual_seed(0)
    length = torch.randint(0, 50, (real + 1,), device=DEV, generator=gen, dtype=torch.int32)  # per slot
    for step in range(STEPS):
        args["zxbcdt"] = torch.randn(args["zxbcdt"].shape, device=DEV, generator=gen).to(BF16)
        perm = torch.randperm(real, device=DEV, generator=gen)
        args["slot_idx"] = torch.cat([perm, torch.full((nb - real,), real, device=DEV)]).to(torch.int32)
        args["cache_lens"] = length[args["slot_idx"].long()]
        length[perm] += 1
        r_conv, r_ssm = conv.clone(), ssm.clone()
        update = update_size(args)
        out = mamba_decode_step(**args, arrivals=arrivals)  # advances conv, ssm in place
        ref = mamba_decode_step_ref(**{**args, "conv_state": r_conv, "ssm_state": r_ssm})
        assert not arrivals.any(), f"step {step}: counters"
        assert_close(out[:real], ref[:real], BF16_TOL, f"step {step} out")
        assert torch.equal(conv[:real], r_conv[:real]), f"step {step} conv"
        assert_state_close(ssm[:real], r_ssm[:real], update[:real], f"step {step} ssm")
        ssm[:real] = r_ssm[:real]  # no drift between the two


UNGROUPED = [shape for shape, (*_, ng) in SHAPES.items() if ng == 1]


@gpu
@pytest.mark.parametrize("shape", UNGROUPED)
@pytest.mark.parametrize("nb", [1, 16, 128])
def test_deferred_norm_step(shape, nb):
    """The deferred-norm variant: the same states as the normalising step, u equal to its twin,
    the rstd of its partial sums within fp32 summation order of the twin's, and u * rstd the
    normalised output; repeated steps at large batch (no program waits for another here)."""
    args = case(shape, nb, seed=nb + 7)
    arrivals = torch.zeros(nb, dtype=torch.int32, device=DEV)
    for step in range(STEPS if nb == NB_LARGE else 3):
        a = {**args, "conv_state": args["conv_state"].clone(), "ssm_state": args["ssm_state"].clone()}
        r = {**args, "conv_state": args["conv_state"].clone(), "ssm_state": args["ssm_state"].clone()}
        update = update_size(args)
        out = mamba_decode_step(**args, arrivals=arrivals)  # advances args' pools
        u, sums = mamba_decode_step_deferred_norm(**deferred_args(a), arrivals=arrivals)
        u_ref, sums_ref = mamba_decode_step_deferred_norm_ref(**deferred_args(r))
        rstd, rstd_ref = sums.rstd(), sums_ref.rstd()
        assert not arrivals.any(), f"step {step}: counters"
        assert torch.equal(a["conv_state"], args["conv_state"]), f"step {step}: conv state"
        assert torch.equal(a["ssm_state"], args["ssm_state"]), f"step {step}: ssm state vs normalising step"
        assert_state_close(a["ssm_state"], r["ssm_state"], update, f"step {step}: ssm state vs twin")
        assert_close(u, u_ref, BF16_TOL, f"step {step}: u")
        # rstd sums squares of bf16-rounded y: y landing on the other bf16 neighbour (up to 2^-7
        # relative) at a dominant element moves the sum by up to 2^-6 and rstd by up to 2^-7
        torch.testing.assert_close(rstd, rstd_ref, rtol=8e-3, atol=0)
        assert_close(u.float() * rstd[:, None], out.float(), BF16_TOL, f"step {step}: u * rstd vs normalised")
        args["zxbcdt"] = torch.randn_like(args["zxbcdt"], dtype=torch.float32).to(BF16)
        args["cache_lens"] = args["cache_lens"] + 1


@gpu
@pytest.mark.parametrize("shape", ["mamba2-2.7b", "falcon-h1"])
@pytest.mark.parametrize("nb", [1, 16, 128])
def test_gate_only_step(shape, nb):
    """The step without a norm (FalconH1): y * silu(z) equal to its twin, the same states as the
    normalising step; repeated steps at large batch (no program waits for another here)."""
    args = case(shape, nb, seed=nb + 11)
    arrivals = torch.zeros(nb, dtype=torch.int32, device=DEV)
    for step in range(STEPS if nb == NB_LARGE else 3):
        a = {**args, "conv_state": args["conv_state"].clone(), "ssm_state": args["ssm_state"].clone()}
        r = {**args, "conv_state": args["conv_state"].clone(), "ssm_state": args["ssm_state"].clone()}
        update = update_size(args)
        mamba_decode_step(**args, arrivals=arrivals)  # advances args' pools
        out = mamba_decode_step_gate_only(**gate_only_args(a), arrivals=arrivals)
        ref = mamba_decode_step_gate_only_ref(**gate_only_args(r))
        assert not arrivals.any(), f"step {step}: counters"
        assert out.dtype == BF16
        assert torch.equal(a["conv_state"], args["conv_state"]), f"step {step}: conv state"
        assert torch.equal(a["ssm_state"], args["ssm_state"]), f"step {step}: ssm state vs normalising step"
        assert torch.equal(r["conv_state"], a["conv_state"]), f"step {step}: twin conv state"
        assert_state_close(a["ssm_state"], r["ssm_state"], update, f"step {step}: ssm state vs twin")
        assert_close(out, ref, BF16_TOL, f"step {step}: out")
        args["zxbcdt"] = torch.randn_like(args["zxbcdt"], dtype=torch.float32).to(BF16)
        args["cache_lens"] = args["cache_lens"] + 1


@gpu
def test_fused_step_in_a_cuda_graph():
    """Captured once (workspace allocated inside the capture), replayed on changing inputs."""
    args = case("mamba2-2.7b", 4, seed=3)
    arrivals = torch.zeros(4, dtype=torch.int32, device=DEV)
    static = dict(args)
    mamba_decode_step(**{**static, "conv_state": static["conv_state"].clone(),
                         "ssm_state": static["ssm_state"].clone()}, arrivals=arrivals)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mamba_decode_step(**static, arrivals=arrivals)
    for step in range(5):
        new = case("mamba2-2.7b", 4, seed=10 + step)
        static["zxbcdt"].copy_(new["zxbcdt"])
        static["cache_lens"].add_(1)
        r_conv, r_ssm = static["conv_state"].clone(), static["ssm_state"].clone()
        update = update_size(static)
        ref = mamba_decode_step_ref(**{**static, "conv_state": r_conv, "ssm_state": r_ssm})
        graph.replay()
        assert not arrivals.any()
        assert_close(out, ref, BF16_TOL, f"replay {step}")
        assert torch.equal(static["conv_state"], r_conv)
        assert_state_close(static["ssm_state"], r_ssm, update, f"replay {step} ssm")


@gpu
@pytest.mark.parametrize("d", [2560, 4096])
@pytest.mark.parametrize("residual", [torch.float32, BF16])
def test_add_rms_norm_bf16(d, residual):
    gen = torch.Generator(device=DEV).manual_seed(d)
    h = torch.randn(64, d, device=DEV, generator=gen).to(residual) * 3
    out = torch.randn(64, d, device=DEV, generator=gen).to(BF16)
    w = torch.randn(d, device=DEV, generator=gen).to(BF16)
    for mult, norm_dtype in ((1.0, BF16), (0.3, None)):
        got_h, got_x = norms.add_rms_norm(h, out, w, 1e-5, mult, norm_dtype)
        ref_h, ref_x = norms.add_rms_norm_ref(h, out, w, 1e-5, mult, norm_dtype)
        assert torch.equal(got_h, ref_h)
        assert got_x.dtype == ref_x.dtype
        if got_x.dtype == BF16:
            torch.testing.assert_close(got_x, ref_x, rtol=8e-3, atol=1e-5)  # one bf16 ulp at most
            # fp32 differences (summation order, approximate rsqrt) rarely cross a bf16 rounding
            assert (got_x != ref_x).float().mean().item() < 0.01
        else:
            # fp32 output (fp32 residual, no norm dtype): rstd differs by a few fp32 ulps (summation
            # order, approximate rsqrt), which moves the last bit of most elements, and no more
            torch.testing.assert_close(got_x, ref_x, rtol=4e-6, atol=1e-7)


@gpu
@pytest.mark.parametrize("d,group", [(5120, 5120), (4096, 4096), (8192, 1024)])
def test_gated_rms_norm_bf16(d, group):
    gen = torch.Generator(device=DEV).manual_seed(d + group)
    zx = torch.randn(32, 2 * d, device=DEV, generator=gen).to(BF16)
    y, z = zx[:, d:], zx[:, :d]
    w = torch.randn(d, device=DEV, generator=gen).to(BF16)
    got = norms.gated_rms_norm(y, z, w, group, 1e-5, BF16)
    ref = norms.gated_rms_norm_ref(y, z, w, group, 1e-5, BF16)
    torch.testing.assert_close(got, ref, rtol=8e-3, atol=1e-5)
    assert (got != ref).float().mean().item() < 0.01


@gpu
def test_dispatch_picks_triton_on_cuda(monkeypatch):
    monkeypatch.delenv("TREESERVE_KERNELS", raising=False)
    for name, fn in (("mamba_decode_step", mamba_decode_step),
                     ("mamba_decode_step_deferred_norm", mamba_decode_step_deferred_norm),
                     ("add_rms_norm", norms.add_rms_norm),
                     ("rms_norm", norms.rms_norm), ("gated_rms_norm", norms.gated_rms_norm)):
        assert ops.implementation(name, torch.device(DEV)) is fn
