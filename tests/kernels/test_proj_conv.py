"""in_proj + tree conv in one launch (Triton, interpreted) vs its twin (the projection, then the tree
conv) vs a float64 oracle per node (the projection in float64, rounded as the kernel rounds it, then
the ordinary causal conv over [committed window | root-to-node path]): trees of every kind packed
together, conv widths 1..4, the conv channels in the middle of the projection's columns with
carried columns after them, tiles that straddle those boundaries, the reduction whole and split,
ring windows reaching before the first token. Outputs are poisoned so unwritten elements show."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kernels import few_rows_linear as frl
from kernels import proj_conv as pc
from tests.kernels.interpret_compat import install as _fix_interpreter
from tests.kernels.ssm_oracle import ring_window
from tests.kernels.tree_cases import KINDS, packed_batch, path_to

_fix_interpreter()

F32, F16 = torch.float32, torch.float16
TOL = {F32: 1e-5, F16: 4e-3}


def small_tiles(programs: int) -> dict:
    """16-column tiles (boundaries fall inside tiles) over 32-wide reduction tiles."""
    return {bm: frl.DotTile(16, 32, 4, 2, programs) for bm in (16, 32, 64)}


def _case(trees, K, z_cols, D, carried, W, dtype, seed, with_bias=True, S=6):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    parents, cu, max_nodes, lists = packed_batch(trees, rng)
    T, N = int(cu[-1]), z_cols + D + carried
    h = torch.randn(T, K + 3, generator=gen).to(dtype)[:, 3:]  # strided rows
    weight = (torch.randn(N, K, generator=gen) * K ** -0.5).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype) if with_bias else None
    conv_weight = (torch.randn(D, W, generator=gen) * 0.5).to(dtype)
    conv_bias = torch.randn(D, generator=gen).to(dtype) if with_bias else None
    state = torch.randn(S, D, W, generator=gen).to(dtype)
    slots = torch.tensor(rng.sample(range(S), len(lists)), dtype=torch.int32)
    lens = torch.tensor([rng.choice([0, 1, 2, rng.randrange(3, 50)]) for _ in lists], dtype=torch.int32)
    args = (h, weight, bias, z_cols, conv_weight, conv_bias, state, parents, cu, slots, lens, max_nodes)
    return args, lists


def _oracle(args, lists):
    """(y, conv) in float64: y rounded to the dtype first, as the kernel's taps are."""
    h, weight, bias, lo, cw, cb, state, parents, cu, slots, lens, _ = args
    y = h.double() @ weight.double().t() + (bias.double() if bias is not None else 0)
    yr = y.to(h.dtype).double()
    D = cw.shape[0]
    conv = torch.empty(y.shape[0], D, dtype=torch.float64)
    for b, lst in enumerate(lists):
        r0 = int(cu[b])
        window = ring_window(state[int(slots[b])], int(lens[b])).double()
        for i in range(len(lst)):
            path = torch.tensor(path_to(lst, i)) + r0
            seq = torch.cat([window, yr[path, lo:lo + D].t()], dim=1)
            out = F.conv1d(seq[None], cw.double()[:, None, :], cb.double() if cb is not None else None, groups=D)
            conv[r0 + i] = F.silu(out[0, :, -1])
    return y, conv


def _run(fn, args, carried):
    h, weight = args[0], args[1]
    T, N, lo = h.shape[0], weight.shape[0], args[3]
    stash = torch.full((T, N - lo), float("nan"), dtype=h.dtype)
    conv_out = torch.full((T, args[4].shape[0]), float("nan"), dtype=h.dtype)
    y, got = fn(*args, stash=stash, conv_out=conv_out)
    assert got is conv_out
    return y, got, stash


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


MIXED = [(1, "single"), (4, "chain"), (6, "star"), (9, "deep"), (5, "random"), (7, "bushy")]  # 32 rows


@pytest.mark.parametrize("programs", [1, 1000])
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("W,z_cols,D,carried", [(4, 40, 37, 5), (3, 16, 48, 0), (2, 0, 21, 16), (1, 8, 16, 3)])
def test_matches_twin_and_oracle(monkeypatch, programs, dtype, W, z_cols, D, carried):
    monkeypatch.setattr(frl, "DOT_TILES", small_tiles(programs))
    monkeypatch.setattr(frl.SplitWorkspace, "_by_device", {})
    args, lists = _case(MIXED, 72, z_cols, D, carried, W, dtype, seed=W * 100 + D + programs)
    y, conv, stash = _run(pc.project_tree_conv, args, carried)
    y_ref, conv_ref, stash_ref = _run(pc.project_tree_conv_ref, args, carried)
    y64, conv64 = _oracle(args, lists)
    assert not (y.isnan().any() or conv.isnan().any() or stash.isnan().any())
    assert torch.equal(stash, y[:, z_cols:])  # the stash is the projection's own output, bit for bit
    assert rel(y, y64) < TOL[dtype] and rel(y_ref, y64) < TOL[dtype]
    assert rel(conv, conv64) < TOL[dtype] and rel(conv_ref, conv64) < TOL[dtype]
    assert rel(conv, conv_ref) < TOL[dtype] and torch.equal(stash_ref, y_ref[:, z_cols:])


@pytest.mark.parametrize("kind", KINDS)
def test_each_tree_kind_alone(monkeypatch, kind):
    """One tree of each kind filling the largest row tile (one node for 'single', with a second tree)."""
    monkeypatch.setattr(frl, "DOT_TILES", small_tiles(1))
    n = 1 if kind == "single" else pc.MAX_CONV_ROWS
    args, lists = _case([(n, kind)] + ([(1, "single")] if n == 1 else []), 40, 16, 24, 4, 4, F32, seed=7)
    y, conv, stash = _run(pc.project_tree_conv, args, 4)
    y64, conv64 = _oracle(args, lists)
    assert rel(y, y64) < TOL[F32] and rel(conv, conv64) < TOL[F32]


def test_no_biases_and_refusals():
    args, lists = _case([(3, "chain"), (2, "star")], 32, 16, 16, 2, 4, F32, seed=3, with_bias=False)
    y, conv, _ = _run(pc.project_tree_conv, args, 2)
    y64, conv64 = _oracle(args, lists)
    assert rel(y, y64) < TOL[F32] and rel(conv, conv64) < TOL[F32]
    h, weight, bias, lo, cw, cb, state, *rest = args
    stash = torch.empty(h.shape[0], weight.shape[0] - lo)
    with pytest.raises(ValueError, match="rows"):
        pc.project_tree_conv(h[:1], weight, bias, lo, cw, cb, state, *rest, stash=stash[:1])
    with pytest.raises(ValueError, match="columns of"):
        pc.project_tree_conv(h, weight, bias, weight.shape[0], cw, cb, state, *rest, stash=stash)
    with pytest.raises(ValueError, match="stash"):
        pc.project_tree_conv(h, weight, bias, lo, cw, cb, state, *rest, stash=stash[:, 1:])
    with pytest.raises(ValueError, match="rings"):
        pc.project_tree_conv(h, weight, bias, lo, cw, cb, state[..., :3], *rest, stash=stash)
    assert pc.fits(2) and pc.fits(pc.MAX_CONV_ROWS) and not pc.fits(1) and not pc.fits(pc.MAX_CONV_ROWS + 1)


def test_compiles_for_sm90(monkeypatch):
    """bf16 launches with 16- and 32-row tiles, whole and split, one tree and several, compile for an
    H100 without register spills (a 64-row tile spilled 124 bytes, hence MAX_CONV_ROWS)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from tests.kernels.ssm_oracle import assert_compiles_for_sm90

    def run_all():
        for programs, trees in ((1, [(16, "random")]), (1000, [(16, "deep"), (8, "star"), (8, "random")])):
            monkeypatch.setattr(frl, "DOT_TILES", {bm: frl.DotTile(64, 128, 4, 3, programs) for bm in (16, 32, 64)})
            args, _ = _case(trees, 256, 64, 128, 16, 4, torch.bfloat16, seed=1)
            _run(pc.project_tree_conv, args, 16)

    assert_compiles_for_sm90([pc._project_tree_conv_kernel], run_all)
