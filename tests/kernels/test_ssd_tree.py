"""tree_ssd_scan (Triton, interpreted) vs tree_ssd_scan_ref vs the float64 per-node oracle."""
import pytest
import torch

from kernels import ssd_tree, ssm_common
from kernels.ssd_tree import (
    tree_ssd_scan,
    tree_ssd_scan_deferred_norm,
    tree_ssd_scan_deferred_norm_ref,
    tree_ssd_scan_ref,
)
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


def test_deep_segments_below_a_huge_path_keep_their_precision():
    """dt A of -5e3 to -1e4 per node for the first ten levels, then small steps: decays between deep
    nodes are differences of path sums near -5e4 .. -1e5, whose fp32 rounding (ulp 4e-3 .. 8e-3)
    would put errors of that size on every deep node's output."""
    args, lists = tree_case([(24, "chain"), (20, "deep")], 3, 16, 16, 1, seed=17, a_max=60.0)
    depth = torch.cat([torch.tensor([len(tree_cases.path_to(p, i)) - 1 for i in range(len(p))]) for p in lists])
    high = depth < 10
    args["dt"] = torch.where(high[:, None], torch.full_like(args["dt"], 160.0), args["dt"] * 0.3 - 4.0)
    args["dt_bias"] = torch.zeros_like(args["dt_bias"])
    args["A"] = torch.tensor([-30.0, -60.0, -2.0])  # the last head: a mild path, for contrast
    check(args, lists, 1e-4)


def test_trees_up_to_256_nodes():
    """Four row tiles (path sums gathered over several column blocks), next to a deep 130-node tree."""
    check(*tree_case([(256, "random"), (130, "deep"), (1, "single")], H=1, P=16, N=16, G=1, seed=18), 1e-4)


def test_structure_built_once_gives_the_same_result():
    """Passing the per-forward ancestor bits (as the model does) changes nothing, with max_nodes above the
    largest tree (CUDA-graph buckets) too."""
    from kernels.tree_struct import ancestor_bits, ancestor_bits_ref

    for spec, max_nodes in (([(9, "random"), (1, "single"), (14, "bushy")], None), ([(5, "deep"), (3, "star")], 64),
                            ([(70, "random"), (2, "chain")], 128)):
        args, lists = tree_case(spec, 2, 16, 16, 1, seed=19)
        if max_nodes:
            args["max_nodes"] = max_nodes
        bits = ancestor_bits(args["parents"], args["cu_seqlens"], args["max_nodes"])
        assert torch.equal(bits, ancestor_bits_ref(args["parents"], args["cu_seqlens"], args["max_nodes"]))
        check({**args, "ancestors": bits}, lists, 1e-4)
        assert torch.equal(tree_ssd_scan(**args, ancestors=bits), tree_ssd_scan(**args))
        assert torch.equal(tree_ssd_scan_ref(**args, ancestors=bits), tree_ssd_scan_ref(**args))


def test_mis_shaped_structure_is_refused():
    args, _ = tree_case([(20, "random")], 1, 16, 16, 1, seed=20)
    with pytest.raises(ValueError, match="ancestors"):
        tree_ssd_scan(**args, ancestors=torch.zeros(20, 4, dtype=torch.int32))


def check_deferred_norm(args, lists, tol, twin_tol):
    """The scan with the gated norm less its scale: u * rstd is the normalised gated output (float64
    oracle), Triton equals its twin (u, and the rstd of the partial sums), every node's partial sums
    are written, and the state pool is only read."""
    T, H, P = args["x"].shape
    gen = torch.Generator().manual_seed(T)
    weight = (torch.rand(H * P, generator=gen) + 0.5).to(args["x"].dtype)
    eps = 1e-5
    g = oracle_tree(args, lists).reshape(T, H * P)  # y * silu(z), float64
    want = weight.double() * g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    state_before = args["ssm_state"].clone()
    u, sums = tree_ssd_scan_deferred_norm(**args, norm_weight=weight, norm_eps=eps)
    u_ref, sums_ref = tree_ssd_scan_deferred_norm_ref(**args, norm_weight=weight, norm_eps=eps)
    assert u.shape == (T, H * P) and u.dtype == torch.promote_types(weight.dtype, args["z"].dtype)
    assert sums.parts.shape[0] == T and sums.parts.shape[1] >= H and not sums.parts.isnan().any()
    assert sums.count == sums_ref.count == H * P and sums.eps == sums_ref.eps == eps
    for uu, ss, name in ((u, sums, "triton"), (u_ref, sums_ref, "twin")):
        assert_close(uu.double() * ss.rstd().double()[:, None], want, tol, f"{name} u * rstd vs oracle")
    assert_close(u, u_ref, twin_tol, "triton vs twin u")
    assert_close(sums.rstd(), sums_ref.rstd(), twin_tol, "triton vs twin rstd")
    assert torch.equal(args["ssm_state"], state_before), "the state pool must not be modified"


@pytest.mark.parametrize("k", range(len(SHAPES)))
def test_deferred_norm_every_shape(k):
    kinds = tree_cases.KINDS
    spec = [(9 + 4 * k, kinds[k % len(kinds)]), (1, "single"), (6, "random"), (5, "chain")]
    check_deferred_norm(*tree_case(spec, *SHAPES[k], seed=40 + k), 1e-4, 1e-5)


def test_deferred_norm_tree_larger_than_one_tile():
    check_deferred_norm(*tree_case([(70, "deep"), (3, "star")], H=2, P=16, N=16, G=1, seed=44), 1e-4, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_deferred_norm_half_precision(dtype):
    """Rounded where the unfused scan + gated norm round (the scan's output, the gated value, the
    product with the weight): at most an ulp from the twin."""
    args, lists = tree_case([(10, "random"), (6, "bushy")], 2, 16, 32, 2, seed=45, dtype=dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    check_deferred_norm(args, lists, tol, tol)


def test_deferred_norm_refuses_what_it_cannot_do():
    args, _ = tree_case([(5, "random")], 2, 16, 16, 1, seed=46)
    weight = torch.ones(32)
    with pytest.raises(ValueError, match="norm weight"):
        tree_ssd_scan_deferred_norm(**args, norm_weight=weight[:31], norm_eps=1e-5)
    with pytest.raises(ValueError, match="z"):
        tree_ssd_scan_deferred_norm(**dict(args, z=None), norm_weight=weight, norm_eps=1e-5)


# Trees of up to 16 nodes run either launch: one program per (tree, head, headdim tile), or the
# persistent programs that take those items in turn (serving batches). On the CPU the launch rule
# sees one SM, so both are forced here: the persistent launch with one program (every item in one
# program's loop) and with two per SM (a program that runs out of items while another has one left).
LAUNCHES = {"one program per tile": 0, "persistent, one program": 1, "persistent, two programs": 2}


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("k", range(len(SHAPES)))
def test_both_launches_of_small_trees(monkeypatch, launch, k):
    monkeypatch.setattr(ssd_tree, "persistent_programs_per_sm", lambda tile, items, sms: LAUNCHES[launch])
    spec = [(16, kind) for kind in tree_cases.KINDS] + [(9 + k, "random"), (1, "single")]
    slots = len(spec) + 2
    check(*tree_case(spec, *SHAPES[k], seed=60 + k, slots=slots), 1e-4)
    check_deferred_norm(*tree_case(spec[::-1], *SHAPES[k], seed=63 + k, slots=slots), 1e-4, 1e-5)
    args, lists = tree_case(spec[:3], *SHAPES[k], seed=66 + k, with_z=False)
    args["D"] = None
    check(args, lists, 1e-4)


def test_persistent_launch_equals_one_program_per_tile():
    """Headdim 40 in tiles of 32: items of two headdim tiles, the second one masked."""
    args, lists = tree_case([(16, "bushy"), (3, "chain"), (12, "deep")], 3, 40, 40, 1, seed=70)
    one_tile = tree_ssd_scan(**args, programs_per_sm=0, block_p=32, block_n=64)
    assert_close(one_tile, oracle_tree(args, lists), 1e-4, "one program per tile vs oracle")
    for k in (1, 3):
        assert_close(tree_ssd_scan(**args, programs_per_sm=k, block_p=32), one_tile, 1e-6, f"{k} programs per SM")


def test_persistent_launch_rule():
    rule = ssd_tree.persistent_programs_per_sm
    sms = 132
    assert rule(16, 64 * 80, sms) == ssd_tree.PERSISTENT_PROGRAMS_PER_SM  # 64 sequences of 80 heads
    assert rule(16, 4 * 80, sms) == 0  # 4 sequences: too few items per program to pipeline
    assert rule(32, 64 * 80, sms) == 0  # taller trees: the one-tile launch
    with pytest.raises(ValueError, match="one-tile trees"):
        args, _ = tree_case([(70, "deep")], 1, 16, 16, 1, seed=71)
        tree_ssd_scan(**args, programs_per_sm=2)
