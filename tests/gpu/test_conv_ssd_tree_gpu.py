"""The one-launch verify pass of a Mamba2 layer (tree conv + scan + stash) on CUDA at the real layer
shapes, bf16 activations, fp32 state: against its twin, the float64 oracle and the three separate
kernels it replaces. Tolerances as in test_ssm_gpu.py (bf16 1e-2, fp32 1e-4)."""
import pytest
import torch

from kernels import conv_ssd_tree, ssm_common
from kernels.conv_ssd_tree import tree_conv_ssd_scan, tree_conv_ssd_scan_ref
from tests.gpu.marks import compiled_triton, gpu  # noqa: F401 (fixture)
from tests.kernels.ssm_oracle import assert_close, conv_scan_case, nan_output, on, oracle_conv_scan

SHAPES = {"mamba2-2.7b": (80, 64, 128, 1), "hybrid-8b": (32, 128, 128, 32)}  # (H, P, N, G)
DEV = "cuda"
# every kind of tree the one launch takes, in one ragged batch
SMALL = [(16, "random"), (16, "bushy"), (1, "single"), (7, "chain"), (12, "deep"), (16, "star"), (3, "random")]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(ssm_common, "new_output", nan_output)


def run(fn, a):
    a = dict(a, stash_raw=a["stash_raw"].clone(), stash_xB=a["stash_xB"].clone())
    return fn(**a), a["stash_raw"], a["stash_xB"]


@gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)])
def test_one_launch(shape, dtype, tol):
    args, lists = conv_scan_case(SMALL, *SHAPES[shape], 4, seed=1, dtype=dtype, slots=9)
    a = on(args, DEV)
    pools = (a["ssm_state"].clone(), a["conv_state"].clone())
    assert conv_ssd_tree.fuses(a["max_nodes"])
    y, raw, xB = run(tree_conv_ssd_scan, a)
    y_ref, _, xB_ref = run(tree_conv_ssd_scan_ref, a)
    assert_close(y, y_ref, tol, "triton vs reference")
    assert_close(xB, xB_ref, tol, "stashed conv x | B vs reference")
    assert torch.equal(raw, a["xbc_dt"])
    assert torch.equal(a["ssm_state"], pools[0]) and torch.equal(a["conv_state"], pools[1])
    k = 3  # the oracle walks every path in Python: the first trees only
    n = int(a["cu_seqlens"][k])
    first = dict(a, xbc_dt=a["xbc_dt"][:n], parents=a["parents"][:n], cu_seqlens=a["cu_seqlens"][: k + 1],
                 slot_idx=a["slot_idx"][:k])
    want_y, _ = oracle_conv_scan({key: v.cpu() if isinstance(v, torch.Tensor) else v for key, v in first.items()},
                                 lists[:k])
    assert_close(y[:n].cpu(), want_y, tol, "triton vs oracle")


@gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_one_launch_equals_the_separate_kernels(shape, monkeypatch):
    """Same conv rounding: the stash is bit-identical, y agrees to the scan's own rounding."""
    a = on(conv_scan_case(SMALL, *SHAPES[shape], 4, seed=2, dtype=torch.bfloat16, slots=9)[0], DEV)
    y, _, xB = run(tree_conv_ssd_scan, a)
    monkeypatch.setattr(conv_ssd_tree, "FUSED_MAX_NODES", 0)
    y_sep, _, xB_sep = run(tree_conv_ssd_scan, a)
    assert torch.equal(xB, xB_sep)
    assert_close(y, y_sep, 1e-2, "one launch vs separate kernels")


@gpu
def test_taller_trees_on_the_separate_kernels():
    args, lists = conv_scan_case([(64, "random"), (130, "deep"), (5, "star")], *SHAPES["mamba2-2.7b"], 4, seed=3,
                                 dtype=torch.bfloat16, slots=4)
    a = on(args, DEV)
    y, raw, xB = run(tree_conv_ssd_scan, a)
    y_ref, _, xB_ref = run(tree_conv_ssd_scan_ref, a)
    assert_close(y, y_ref, 1e-2, "triton vs reference")
    assert_close(xB, xB_ref, 1e-2, "stash vs reference")
    assert torch.equal(raw, a["xbc_dt"])
