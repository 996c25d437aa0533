"""tree_conv_ssd_scan (Triton, interpreted) vs its twin vs the float64 per-node oracle, stash included."""
import pytest
import torch

from kernels import conv_ssd_tree, ssm_common
from kernels.conv_ssd_tree import fuses, tree_conv_ssd_scan, tree_conv_ssd_scan_ref
from tests.kernels import tree_cases
from tests.kernels.ssm_oracle import assert_close, conv_scan_case, nan_output, oracle_conv_scan


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(ssm_common, "new_output", nan_output)


def run(fn, args):
    """fn on fresh NaN-poisoned stash buffers -> (y, stash_raw, stash_xB)."""
    a = dict(args, stash_raw=args["stash_raw"].clone(), stash_xB=args["stash_xB"].clone())
    y = fn(**a)
    return y, a["stash_raw"], a["stash_xB"]


def check(args, lists, tol):
    pools = (args["ssm_state"].clone(), args["conv_state"].clone())
    want_y, want_conv = oracle_conv_scan(args, lists)
    want_xB = want_conv[:, : args["stash_xB"].shape[1]]
    for name, fn in (("reference", tree_conv_ssd_scan_ref), ("triton", tree_conv_ssd_scan)):
        y, raw, xB = run(fn, args)
        assert y.dtype == args["xbc_dt"].dtype
        assert_close(y, want_y, tol, f"{name} y vs oracle")
        assert torch.equal(raw, args["xbc_dt"]), f"{name}: the stash's raw xBC | dt must be the input, bit for bit"
        assert_close(xB, want_xB, tol, f"{name} stashed conv x | B vs oracle")
    ref = run(tree_conv_ssd_scan_ref, args)
    got = run(tree_conv_ssd_scan, args)
    assert_close(got[0], ref[0], tol, "triton vs reference")
    assert_close(got[2], ref[2], tol, "stashed conv x | B: triton vs reference")
    assert torch.equal(args["ssm_state"], pools[0]) and torch.equal(args["conv_state"], pools[1]), \
        "the state pools must not be modified"


# (H, P, N, G, W): ngroups 1, > 1 and = H; headdim and d_state not powers of two; conv widths 1-4
SHAPES = [(4, 16, 16, 2, 4), (2, 24, 40, 1, 4), (4, 16, 32, 4, 3), (2, 16, 16, 1, 2), (2, 16, 16, 2, 1)]


@pytest.mark.parametrize("kind", tree_cases.KINDS)
def test_every_tree_kind_in_a_ragged_batch(kind):
    k = tree_cases.KINDS.index(kind)
    spec = [(11 + 3 * k, kind), (1, "single"), (5 + k, "random")]
    check(*conv_scan_case(spec, *SHAPES[k % len(SHAPES)], seed=k, with_bias=k % 2 == 0), 1e-4)


@pytest.mark.parametrize("shape", SHAPES[3:])
def test_narrow_conv_widths(shape):
    check(*conv_scan_case([(9, "deep"), (6, "star")], *shape, seed=20), 1e-4)


def test_default_limit():
    assert fuses(16) and not fuses(17)


def test_full_tile_of_64_nodes(monkeypatch):
    """64 nodes, the tallest tree the kernel can take (d_state in chunks)."""
    monkeypatch.setattr(conv_ssd_tree, "FUSED_MAX_NODES", 64)
    assert fuses(64) and not fuses(65)
    check(*conv_scan_case([(64, "random"), (30, "deep")], 1, 16, 80, 1, 4, seed=21), 1e-4)


def test_taller_trees_take_the_separate_kernels(monkeypatch):
    calls = []
    separate = conv_ssd_tree.tree_ssd_scan
    monkeypatch.setattr(conv_ssd_tree, "tree_ssd_scan", lambda *a, **k: calls.append(1) or separate(*a, **k))
    check(*conv_scan_case([(70, "deep"), (3, "star")], 1, 16, 16, 1, 4, seed=22), 1e-4)
    assert calls, "a 70-node tree must go through the separate scan"


def test_no_skip_no_conv_bias():
    args, lists = conv_scan_case([(9, "random"), (4, "chain")], 2, 16, 16, 1, 4, seed=23, with_bias=False)
    args["D"] = None
    check(args, lists, 1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_activations(dtype):
    args, lists = conv_scan_case([(10, "random"), (6, "bushy")], 2, 16, 32, 2, 4, seed=24, dtype=dtype)
    check(args, lists, 3e-2 if dtype == torch.bfloat16 else 6e-3)


def test_large_dt_does_not_overflow():
    args, lists = conv_scan_case([(12, "random"), (7, "deep")], 2, 16, 16, 1, 4, seed=25, dt_scale=12.0,
                                 dt_shift=18.0, a_max=60.0)
    assert args["xbc_dt"][:, -2:].max() > 30
    check(args, lists, 1e-4)


def test_dt_limit_is_applied():
    args, lists = conv_scan_case([(8, "random")], 2, 16, 16, 1, 4, seed=26, dt_scale=3.0)
    args["dt_limit"] = (0.05, 0.5)
    check(args, lists, 1e-4)


def test_equals_the_separate_kernels_in_half_precision():
    """The one launch rounds its conv output as the separate conv does, so the scan sees the same
    inputs: outputs agree with the three-launch path to half-precision rounding."""
    args, _ = conv_scan_case([(16, "random"), (5, "chain"), (1, "single")], 4, 16, 32, 2, 4, seed=27,
                             dtype=torch.float16)
    fused = run(tree_conv_ssd_scan, args)
    from kernels.conv_tree import tree_conv1d
    from kernels.ssd_tree import tree_ssd_scan

    conv_dim = args["conv_weight"].shape[0]
    xbc, dt = args["xbc_dt"][:, :conv_dim], args["xbc_dt"][:, conv_dim:]
    conv = tree_conv1d(xbc, args["conv_weight"], args["conv_bias"], args["conv_state"], args["parents"],
                       args["cu_seqlens"], args["slot_idx"], args["max_nodes"])
    T = conv.shape[0]
    x, B, C = conv.split([64, 32 * 2, 32 * 2], dim=1)
    y = tree_ssd_scan(x.reshape(T, 4, 16), dt, args["A"], B.reshape(T, 2, 32), C.reshape(T, 2, 32), args["D"],
                      args["dt_bias"], args["ssm_state"], args["parents"], args["cu_seqlens"], args["slot_idx"],
                      args["max_nodes"], args["dt_limit"])
    assert torch.equal(fused[2], conv[:, :128]), "the stashed conv x | B must be the separate conv's output"
    assert_close(fused[0], y, 2e-3, "one launch vs separate kernels")


def test_rejects_shapes_of_another_layer():
    args, _ = conv_scan_case([(4, "chain")], 2, 16, 16, 1, 4, seed=28)
    with pytest.raises(ValueError, match="one Mamba2 layer"):
        tree_conv_ssd_scan(**dict(args, xbc_dt=args["xbc_dt"][:, :-1]))
    with pytest.raises(ValueError, match="stash"):
        tree_conv_ssd_scan(**dict(args, stash_xB=args["stash_xB"][:, :-1]))


def test_compiles_for_sm90(monkeypatch):
    """At the GPU shapes' constexprs (headdim 64 in tiles of 32 and 64, d_state 128, width 4; trees
    of up to 16 nodes; bf16 and fp32), for an H100 through ptxas. Its conv operands leave no
    registers to spare: with bf16 activations it may spill a few words (at most SPILL_BYTES); the
    fp32 variant (three-pass products, correctness runs) spills more."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from tests.kernels.ssm_oracle import assert_compiles_for_sm90

    def run_all():
        for sms, dtype in ((132, torch.bfloat16), (1, torch.bfloat16), (132, torch.float32)):
            monkeypatch.setattr(conv_ssd_tree, "_sm_count", lambda device, sms=sms: sms)
            args, _ = conv_scan_case([(16, "random")], 2, 64, 128, 1, 4, seed=29, dtype=dtype)
            tree_conv_ssd_scan(**args)

    results = assert_compiles_for_sm90([conv_ssd_tree._tree_conv_ssd_kernel], run_all, spills_ok=lambda spec: True)
    bf16 = results[:2]  # the launches in run_all's order
    assert all(r["spill_bytes"] <= SPILL_BYTES for r in bf16), bf16


SPILL_BYTES = 16
