"""tree_ssd_scan (Triton, interpreted) vs tree_ssd_scan_ref vs the float64 per-node oracle."""
import pytest
import torch

from kernels import ssm_common
from kernels.ssd_tree import tree_ssd_scan, tree_ssd_scan_ref
from kernels.ssm_decode import ssm_chain_update
from tests.kernels import tree_cases
from tests.kernels.ssm_oracle import assert_close, nan_output, oracle_tree, tree_case


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(ssm_common, "new_output", nan_output)


def check(args, lists, tol):
    state_before = args["ssm_state"].clone()
    expected = oracle_tree(args, lists)
    ref = tree_ssd_scan_ref(**args)
    assert_close(ref, expected, tol, "reference vs oracle")
    out = tree_ssd_scan(**args)
    assert out.dtype == args["x"].dtype
    assert_close(out, expected, tol, "triton vs oracle")
    assert_close(out, ref, tol, "triton vs reference")
    assert torch.equal(args["ssm_state"], state_before), "the state pool must not be modified"


# (H, P, N, G): ngroups 1, > 1 and = H; headdim and d_state not powers of two
SHAPES = [(4, 16, 16, 2), (2, 24, 40, 1), (4, 16, 32, 4)]


@pytest.mark.parametrize("kind", tree_cases.KINDS)
def test_every_tree_kind_in_a_ragged_batch(kind):
    k = tree_cases.KINDS.index(kind)
    spec = [(11 + 3 * k, kind), (1, "single"), (5 + k, "random")]
    check(*tree_case(spec, *SHAPES[k % len(SHAPES)], seed=k), 1e-4)


def test_tree_larger_than_one_tile():
    """70 nodes: two row tiles, walks that cross from the diagonal block into block 0."""
    check(*tree_case([(70, "deep"), (3, "star"), (40, "bushy")], H=1, P=16, N=16, G=1, seed=11), 1e-4)


def test_no_gate_no_skip():
    args, lists = tree_case([(9, "random"), (4, "chain")], 2, 16, 16, 1, seed=12, with_z=False)
    args["D"] = None
    check(args, lists, 1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_activations(dtype):
    args, lists = tree_case([(10, "random"), (6, "bushy")], 2, 16, 32, 2, seed=13, dtype=dtype)
    check(args, lists, 2e-2 if dtype == torch.bfloat16 else 4e-3)


def test_large_dt_does_not_overflow():
    """dt_raw up to +30 and more, A down to -60: decays underflow to 0, nothing may become inf/NaN."""
    args, lists = tree_case([(12, "random"), (7, "deep")], 2, 16, 16, 1, seed=14, dt_scale=12.0, dt_shift=18.0,
                            a_max=60.0)
    assert args["dt"].max() > 30
    check(args, lists, 1e-4)


def test_dt_limit_is_applied():
    args, lists = tree_case([(8, "random")], 2, 16, 16, 1, seed=15, dt_scale=3.0)
    args["dt_limit"] = (0.05, 0.5)
    check(args, lists, 1e-4)


def test_chain_tree_equals_chain_update():
    K = 6
    args, _ = tree_case([(K, "chain")], 2, 16, 24, 2, seed=16)
    y_tree = tree_ssd_scan(**args)
    pool = args["ssm_state"].clone()
    y_chain = ssm_chain_update(pool, args["slot_idx"], args["x"][None], args["dt"][None], args["A"], args["B"][None],
                               args["C"][None], args["D"], args["dt_bias"], args["dt_limit"], z=args["z"][None])
    assert_close(y_tree, y_chain[0], 1e-5, "chain tree vs chain update")
