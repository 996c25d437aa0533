"""SSM kernels on CUDA at the real layer shapes (design §9), bf16 activations, fp32 state.

Run on a GPU machine with compiled (not interpreted) Triton:

    TRITON_INTERPRET=0 python -m pytest -q tests/gpu/test_ssm_gpu.py

Tolerances (elementwise, |err| <= tol * (|expected| + max|expected|)): bf16 activations 1e-2 against the
float64 oracle run on the same bf16-rounded inputs (bf16 output rounding is 4e-3; tf32 and bf16 products inside);
fp32 states 1e-3 (5e-3 for prefill's chunk-state products); fp32 activations 1e-4 (3-pass tf32 products). `test_kernels_compile_for_h100` needs no GPU: it compiles every
SSM kernel for sm_90 on whatever machine runs it.
"""
import os

import pytest
import torch

from kernels import ops, ssd_tree, ssm_common
from kernels.ssd_prefill import ssd_prefill, ssd_prefill_ref
from kernels.ssd_tree import (
    tree_ssd_scan,
    tree_ssd_scan_deferred_norm,
    tree_ssd_scan_deferred_norm_ref,
    tree_ssd_scan_ref,
)
from kernels.ssm_commit import ssm_state_commit, ssm_state_commit_ref
from kernels.ssm_decode import ssm_chain_update, ssm_chain_update_ref
from kernels.tree_struct import ancestor_bits, ancestor_bits_ref
from tests.gpu.marks import compiled_triton, gpu  # noqa: F401 (fixture)
from tests.kernels.ssm_oracle import (
    assert_close,
    assert_compiles_for_sm90,
    chain_case,
    commit_case,
    nan_output,
    on,
    oracle_chain,
    oracle_commit,
    oracle_prefill,
    oracle_tree,
    prefill_case,
    tree_case,
    untouched_slots,
)
from tests.kernels.test_ssd_prefill import split_in_two
from tests.kernels.test_ssm_commit import commit_then_decode

# (H, P, N, G)
SHAPES = {"mamba2-2.7b": (80, 64, 128, 1), "hybrid-8b": (32, 128, 128, 32)}
BF16_TOL = 1e-2
FP32_TOL = 1e-4
PREFILL_STATE_TOL = 5e-3  # chunk states are tl.dot products with tf32-rounded dt-scaled x

DEV = "cuda"


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(ssm_common, "new_output", nan_output)


def assert_close_to_oracle_on_first_trees(out, a, lists, k: int, what: str) -> None:
    """The scan's output `out` for the first `k` trees of the inputs `a` against the float64 oracle,
    which walks every root-to-node path in Python (too slow for the whole batch)."""
    n = int(a["cu_seqlens"][k])
    first = {**a, "cu_seqlens": a["cu_seqlens"][: k + 1], "slot_idx": a["slot_idx"][:k]}
    for key in ("x", "dt", "B", "C", "z", "parents"):
        first[key] = a[key][:n]
    assert_close(out[:n], oracle_tree(first, lists[:k]), BF16_TOL, what)


TREES = [(64, "random"), (16, "bushy"), (1, "single"), (7, "chain"), (40, "deep"), (130, "random"), (256, "bushy")]


@gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_tree_scan(shape):
    args, lists = tree_case(TREES, *SHAPES[shape], seed=1, dtype=torch.bfloat16, slots=9)
    a = on(args, DEV)
    before = a["ssm_state"].clone()
    out = tree_ssd_scan(**a)
    ref = tree_ssd_scan_ref(**a)
    assert_close(out, ref, BF16_TOL, "triton vs reference")
    assert torch.equal(a["ssm_state"], before), "the state pool must not be modified"
    assert_close_to_oracle_on_first_trees(out, a, lists, 5, "triton vs oracle")
    # as the model calls it: the ancestor bits built once on the device and passed in
    bits = ancestor_bits(a["parents"], a["cu_seqlens"], a["max_nodes"])
    assert torch.equal(bits, ancestor_bits_ref(a["parents"], a["cu_seqlens"], a["max_nodes"]))
    assert torch.equal(tree_ssd_scan(**a, ancestors=bits), out)


@gpu
@pytest.mark.parametrize("shape", ["mamba2-2.7b"])
@pytest.mark.parametrize("trees", [TREES, [(16, "random")], [(16, "bushy")] * 16])
def test_tree_scan_deferred_norm(shape, trees):
    """The scan with the gated norm less its scale (what a Mamba2 verify runs): u equal to its twin
    within a bf16 ulp, the rstd of the partial sums within the rounding of y (as for the decode
    step), u * rstd the normalised output, every node's partial sums written; one tree of 16 nodes
    (split headdim tiles) and 16 of them."""
    args, lists = tree_case(trees, *SHAPES[shape], seed=3, dtype=torch.bfloat16, slots=len(trees) + 2)
    a = on(args, DEV)
    T, H, P = a["x"].shape
    w = (torch.rand(H * P, device=DEV) + 0.5).to(torch.bfloat16)
    before = a["ssm_state"].clone()
    u, sums = tree_ssd_scan_deferred_norm(**a, norm_weight=w, norm_eps=1e-5)
    u_ref, sums_ref = tree_ssd_scan_deferred_norm_ref(**a, norm_weight=w, norm_eps=1e-5)
    assert not sums.parts.isnan().any(), "unwritten partial sums"
    assert_close(u, u_ref, BF16_TOL, "triton vs reference u")
    torch.testing.assert_close(sums.rstd(), sums_ref.rstd(), rtol=8e-3, atol=0)
    y = tree_ssd_scan(**{**a, "z": None}).reshape(T, H * P)
    g = ops.gated_rms_norm(y, a["z"].reshape(T, H * P), w, H * P, 1e-5, torch.bfloat16)
    assert_close(u.float() * sums.rstd()[:, None], g.float(), BF16_TOL, "u * rstd vs the scan and the norm apart")
    assert torch.equal(a["ssm_state"], before), "the state pool must not be modified"


@gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_tree_scan_at_a_serving_batch(shape):
    """24 trees of up to 16 nodes: the persistent launch (what the launch rule picks at this batch)
    against the twin, the float64 oracle on the first trees, and one program per tile."""
    from tests.kernels import tree_cases

    trees = [(16, kind) for kind in tree_cases.KINDS] * 3 + [(5, "chain"), (11, "random")] * 3
    args, lists = tree_case(trees, *SHAPES[shape], seed=5, dtype=torch.bfloat16, slots=len(trees) + 3)
    a = on(args, DEV)
    bits = ancestor_bits(a["parents"], a["cu_seqlens"], a["max_nodes"])
    H, P = a["x"].shape[1:]
    assert ssd_tree.persistent_programs_per_sm(16, len(trees) * H * P // 64, 132)
    before = a["ssm_state"].clone()
    out = tree_ssd_scan(**a, ancestors=bits)
    assert_close(out, tree_ssd_scan_ref(**a), BF16_TOL, "persistent vs reference")
    assert_close(out, tree_ssd_scan(**a, ancestors=bits, programs_per_sm=0), BF16_TOL, "persistent vs one-tile")
    assert_close_to_oracle_on_first_trees(out, a, lists, 4, "persistent vs oracle")
    assert torch.equal(a["ssm_state"], before), "the state pool must not be modified"


@gpu
def test_ancestor_bits_batches():
    import random

    from tests.kernels import tree_cases

    rng = random.Random(4)
    for spec in ([(n, kind) for n in (1, 16, 33, 64, 128) for kind in tree_cases.KINDS],
                 [(256, "chain"), (256, "random"), (200, "deep")] * 8):
        parents, cu, mx, _ = tree_cases.packed_batch(spec, rng, device=DEV)
        assert torch.equal(ancestor_bits(parents, cu, mx), ancestor_bits_ref(parents, cu, mx))


@gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_tree_scan_fp32_activations(shape):
    args, lists = tree_case([(64, "random"), (5, "star")], *SHAPES[shape], seed=2, slots=3)
    a = on(args, DEV)
    out = tree_ssd_scan(**a)
    assert_close(out, oracle_tree(a, lists), FP32_TOL, "triton vs oracle")


@gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_large_dt_does_not_overflow(shape):
    args, lists = tree_case([(24, "random")], *SHAPES[shape], seed=3, dtype=torch.bfloat16, dt_scale=12.0,
                            dt_shift=18.0, a_max=60.0, slots=2)
    a = on(args, DEV)
    assert_close(tree_ssd_scan(**a), oracle_tree(a, lists), BF16_TOL, "tree scan vs oracle")
    c = on(chain_case(2, 4, *SHAPES[shape], seed=3, dtype=torch.bfloat16, dt_scale=12.0, dt_shift=18.0,
                      a_max=60.0), DEV)
    y_exp, h_exp = oracle_chain(c)
    assert_close(ssm_chain_update(**c), y_exp, BF16_TOL, "chain update vs oracle")
    assert_close(c["ssm_state"][c["slot_idx"].long()], h_exp, BF16_TOL, "chain state vs oracle")


@gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nb,K", [(1, 1), (16, 1), (16, 4)])
def test_chain_update(shape, nb, K):
    args = on(chain_case(nb, K, *SHAPES[shape], seed=nb + K, dtype=torch.bfloat16, slots=20), DEV)
    pool0 = args["ssm_state"].clone()
    y_exp, h_exp = oracle_chain(args)
    slots = args["slot_idx"].long()
    keep = untouched_slots(pool0, slots)
    for fn, name in ((ssm_chain_update, "triton"), (ssm_chain_update_ref, "reference")):
        args["ssm_state"] = pool0.clone()
        y = fn(**args)
        assert_close(y, y_exp, BF16_TOL, f"{name} y vs oracle")
        assert_close(args["ssm_state"][slots], h_exp, FP32_TOL * 10, f"{name} state vs oracle")
        assert torch.equal(args["ssm_state"][keep], pool0[keep]), f"{name} touched other slots"


@gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_commit(shape):
    lens = [1, 3, 8, 5, 2, 8, 4, 6, 7, 1, 2, 3, 5, 8, 6, 4]
    args = on(commit_case(lens, 8, *SHAPES[shape], seed=5, dtype=torch.bfloat16, slots=20), DEV)
    pool0 = args["ssm_state"].clone()
    expected = oracle_commit(args)
    slots = args["slot_idx"].long()
    keep = untouched_slots(pool0, slots)
    for fn, name in ((ssm_state_commit, "triton"), (ssm_state_commit_ref, "reference")):
        args["ssm_state"] = pool0.clone()
        fn(**args)
        assert_close(args["ssm_state"][slots], expected, FP32_TOL * 10, f"{name} vs oracle")
        assert torch.equal(args["ssm_state"][keep], pool0[keep]), f"{name} touched other slots"


@gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_commit_of_long_paths(shape):
    """Paths past the unrolled steps (the kernel's loop); a path of length 0 and the slots no path
    names left as they were, to the bit; and the loop equal to the unrolled program at a short path,
    to the bit."""
    lens = [64, 17, 40, 1, 0, 33]
    args = on(commit_case(lens, 64, *SHAPES[shape], seed=15, dtype=torch.bfloat16, slots=8), DEV)
    pool0 = args["ssm_state"].clone()
    expected = oracle_commit(args)
    slots = args["slot_idx"].long()
    keep = untouched_slots(pool0, slots)
    empty = slots[lens.index(0)]
    for fn, name in ((ssm_state_commit, "triton"), (ssm_state_commit_ref, "reference")):
        args["ssm_state"] = pool0.clone()
        fn(**args)
        assert_close(args["ssm_state"][slots], expected, FP32_TOL * 10, f"{name} vs oracle")
        assert torch.equal(args["ssm_state"][keep], pool0[keep]), f"{name} touched other slots"
        assert torch.equal(args["ssm_state"][empty], pool0[empty]), f"{name} changed the empty path's slot"
    short = on(commit_case([5, 2], 8, *SHAPES[shape], seed=16, dtype=torch.bfloat16, slots=3), DEV)
    start = short["ssm_state"].clone()
    unrolled, looped = start.clone(), start.clone()
    ssm_state_commit(**{**short, "ssm_state": unrolled})
    ssm_state_commit(**{**short, "ssm_state": looped}, unrolled_steps=0)
    assert torch.equal(looped, unrolled)


@gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_commit_then_decode(shape):
    commit_then_decode(DEV, *SHAPES[shape], dtype=torch.bfloat16, tol=BF16_TOL)


@gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_chain_tree_equals_chain_update(shape):
    args, _ = tree_case([(12, "chain")], *SHAPES[shape], seed=6, dtype=torch.bfloat16, slots=2)
    a = on(args, DEV)
    y_tree = tree_ssd_scan(**a)
    y_chain = ssm_chain_update(a["ssm_state"].clone(), a["slot_idx"], a["x"][None], a["dt"][None], a["A"],
                               a["B"][None], a["C"][None], a["D"], a["dt_bias"], a["dt_limit"], z=a["z"][None])
    assert_close(y_tree, y_chain[0], BF16_TOL, "chain tree vs chain update")


@gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill(shape):
    args = on(prefill_case(1000, *SHAPES[shape], seed=7, dtype=torch.bfloat16), DEV)
    y_exp, h_exp = oracle_prefill(args)
    for fn, name in ((ssd_prefill, "triton"), (ssd_prefill_ref, "reference")):
        y, h = fn(**args)
        assert_close(y, y_exp, BF16_TOL, f"{name} y vs oracle")
        assert_close(h, h_exp, PREFILL_STATE_TOL, f"{name} final state vs oracle")
    y2, h2 = split_in_two(ssd_prefill, args, 333, 64)
    assert_close(y2, y_exp, BF16_TOL, "two halves y vs oracle")
    assert_close(h2, h_exp, PREFILL_STATE_TOL, "two halves state vs oracle")


@gpu
def test_dispatch_picks_triton_on_cuda(monkeypatch):
    monkeypatch.delenv("TREESERVE_KERNELS", raising=False)
    dev = torch.device(DEV)
    for name, fn in (("tree_ssd_scan", tree_ssd_scan), ("ssm_state_commit", ssm_state_commit),
                     ("ssm_chain_update", ssm_chain_update), ("ssd_prefill", ssd_prefill)):
        assert ops.implementation(name, dev) is fn


def test_kernels_compile_for_h100():
    """Every SSM kernel at the GPU shapes' constexprs (headdim 64/128, d_state 128, node tiles 16..64
    incl. multi-tile trees up to 256 nodes, the persistent launch of 16-node trees, the ancestor-bits
    build, K = 1 and 8, bf16) through the real sm_90 compiler, without spills.
    Launch arguments are recorded from interpreted runs with few heads (heads are not constexpr)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("records launches from interpreted runs (TRITON_INTERPRET=1); CUDA runs compile anyway")
    from kernels import ssd_prefill as prefill_mod
    from kernels import ssd_tree, ssm_commit, ssm_decode, tree_struct

    def run():
        for P in (64, 128):
            args, _ = tree_case([(64, "random"), (5, "star")], 1, P, 128, 1, seed=8, dtype=torch.bfloat16)
            tree_ssd_scan(**args)
            ssm_chain_update(**chain_case(1, 1, 1, P, 128, 1, seed=8, dtype=torch.bfloat16))
            ssm_state_commit(**commit_case([3], 8, 1, P, 128, 1, seed=8, dtype=torch.bfloat16))
            ssd_prefill(**prefill_case(70, 1, P, 128, 1, seed=8, dtype=torch.bfloat16))
        args, _ = tree_case([(130, "deep"), (16, "bushy")], 1, 64, 128, 1, seed=8, dtype=torch.bfloat16)
        tree_ssd_scan(**args)
        args, _ = tree_case([(256, "random"), (3, "chain")], 1, 64, 128, 1, seed=8, dtype=torch.bfloat16)
        tree_ssd_scan(**args)  # four row tiles; eight mask words per row
        args, _ = tree_case([(64, "random")], 1, 128, 128, 1, seed=8, dtype=torch.bfloat16)
        tree_ssd_scan(**args, block_p=32)  # the 8B shape's small-batch launch: d_state in one chunk
        for n in (16, 64):  # a Mamba2 verify: the gated norm less its scale in the epilogue
            args, _ = tree_case([(n, "random")], 1, 64, 128, 1, seed=8, dtype=torch.bfloat16)
            tree_ssd_scan_deferred_norm(**args, norm_weight=torch.ones(64, dtype=torch.bfloat16), norm_eps=1e-5)
        for P in (64, 128):  # small trees at a serving batch (8 items on the CPU's one "SM"): the persistent launch
            args, _ = tree_case([(16, "bushy"), (9, "random")], 4, P, 128, 1, seed=8, dtype=torch.bfloat16)
            tree_ssd_scan(**args)
            tree_ssd_scan_deferred_norm(**args, norm_weight=torch.ones(4 * P, dtype=torch.bfloat16), norm_eps=1e-5)
        args, _ = tree_case([(20, "random")], 1, 64, 128, 1, seed=8)  # fp32 activations: tf32x3 dots
        tree_ssd_scan(**args)
        ssd_prefill(**prefill_case(70, 1, 64, 128, 1, seed=8))
        ssm_chain_update(**chain_case(1, 4, 1, 64, 128, 1, seed=8, dtype=torch.bfloat16))

    kernels = [ssd_tree._tree_ssd_kernel, ssd_tree._tree_ssd_persistent_kernel, tree_struct._ancestor_bits_kernel,
               ssm_decode._chain_update_kernel, ssm_commit._commit_kernel,
               prefill_mod._chunk_state_kernel, prefill_mod._state_passing_kernel, prefill_mod._chunk_scan_kernel]

    def known_spills(spec):
        # trees over 64 nodes (several row tiles) and fp32 activations (3-pass tf32 dots) spill a
        # few hundred bytes per thread; the bf16 one-tile path the model runs must not
        c = spec["constexprs"]
        return c.get("ROW_TILES", 1) > 1 or c.get("PREC") == "tf32x3"

    assert_compiles_for_sm90(kernels, run, spills_ok=known_spills)
