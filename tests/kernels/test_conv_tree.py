"""Tree causal conv, conv-state commit and prefill conv: Triton (interpreted) vs reference vs a float64
per-node oracle (the ordinary 1-D causal conv over [committed window | root-to-node path inputs]).
Conv states are rings (kernels/conv_tree.py) of slots at random committed lengths, small ones
included, so windows wrap around the ring and reach before the first token."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kernels import conv_tree as ct
from tests.kernels.interpret_compat import install as _fix_interpreter
from tests.kernels.ssm_oracle import ring_window as _window
from tests.kernels.tree_cases import KINDS, packed_batch, path_to, random_branch

_fix_interpreter()

TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


def _oracle_conv(state: torch.Tensor, inputs: torch.Tensor, weight, bias) -> torch.Tensor:
    """SiLU(causal conv) of the last input. state (D, W-1) window, inputs (n, D) -> (D,) float64."""
    seq = torch.cat([state.double(), inputs.double().t()], dim=1)
    b = bias.double() if bias is not None else None
    y = F.conv1d(seq[None], weight.double()[:, None, :], b, groups=weight.shape[0])[0, :, -1]
    return F.silu(y)


def _batch(kinds_sizes, D, W, dtype, seed, S=7):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    parents, cu, max_nodes, lists = packed_batch(kinds_sizes, rng)
    T = int(cu[-1])
    slots = torch.tensor(rng.sample(range(S), len(lists)), dtype=torch.int32)
    xbc = torch.randn(T, D, generator=gen).to(dtype)
    weight = (torch.randn(D, W, generator=gen) * 0.5).to(dtype)
    bias = torch.randn(D, generator=gen).to(dtype)
    state = torch.randn(S, D, W, generator=gen).to(dtype)
    lens = torch.tensor([rng.choice([0, 1, 2, 3, rng.randrange(4, 90)]) for _ in lists], dtype=torch.int32)
    return parents, cu, max_nodes, lists, slots, lens, xbc, weight, bias, state


MIXED = [(1, "single"), (5, "chain"), (6, "star"), (9, "deep"), (7, "random"), (8, "bushy")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("W,D,with_bias", [(4, 37, True), (3, 300, False), (2, 19, True), (1, 16, True)])
def test_tree_conv1d_matches_oracle(dtype, W, D, with_bias):
    parents, cu, max_nodes, lists, slots, lens, xbc, weight, bias, state = _batch(MIXED + [(20, "chain")], D, W, dtype, 1)
    bias = bias if with_bias else None
    out = torch.full_like(xbc, float("nan"))
    got = ct.tree_conv1d(xbc, weight, bias, state, parents, cu, slots, lens, max_nodes, out=out)
    ref = ct.tree_conv1d_ref(xbc, weight, bias, state, parents, cu, slots, lens, max_nodes)
    assert got is out and not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    for b, lst in enumerate(lists):
        r0 = int(cu[b])
        for i in range(len(lst)):
            path = torch.tensor(path_to(lst, i)) + r0
            want = _oracle_conv(_window(state[int(slots[b])], int(lens[b])), xbc[path], weight, bias)
            torch.testing.assert_close(got[r0 + i].double(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
            torch.testing.assert_close(ref[r0 + i].double(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)


@pytest.mark.parametrize("kind", KINDS)
def test_tree_conv1d_each_kind_alone(kind):
    parents, cu, max_nodes, lists, slots, lens, xbc, weight, bias, state = _batch([(24, kind)], 24, 4, torch.float32, 2)
    got = ct.tree_conv1d(xbc, weight, bias, state, parents, cu, slots, lens, max_nodes)
    ref = ct.tree_conv1d_ref(xbc, weight, bias, state, parents, cu, slots, lens, max_nodes)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fn", ["tree_conv1d", "tree_conv1d_ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("W,D,E", [(4, 300, 7), (3, 37, 0), (2, 19, 16)])
def test_tree_conv1d_stash(fn, dtype, W, D, E):
    """The stash a verify keeps: raw <- the input (D conv channels and E carried columns), bit for bit;
    the output, written into rows of a wider buffer as a verify does, the same as without a stash."""
    parents, cu, max_nodes, _, slots, lens, xbc, weight, bias, state = _batch(MIXED + [(20, "chain")], D + E, W, dtype, 5)
    weight, bias, state = weight[:D], bias[:D], state[:, :D]
    conv = getattr(ct, fn)
    raw = torch.full_like(xbc, float("nan"))
    wide = torch.full((xbc.shape[0], D + 9), float("nan"), dtype=dtype)
    got = conv(xbc, weight, bias, state, parents, cu, slots, lens, max_nodes, out=wide[:, 3 : 3 + D], stash=raw)
    plain = conv(xbc[:, :D].contiguous(), weight, bias, state, parents, cu, slots, lens, max_nodes)
    assert got.data_ptr() == wide[:, 3:].data_ptr()
    assert torch.equal(got, plain)
    assert torch.equal(raw, xbc)
    assert wide[:, :3].isnan().all() and wide[:, 3 + D :].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tree_conv1d_packed_channel_words(dtype):
    """A width-4 conv in 2-byte values reads each channel's weights and ring as one 64-bit word: the
    same output, bit for bit, as the column-at-a-time read it takes when the ring rows are padded."""
    parents, cu, max_nodes, lists, slots, lens, xbc, weight, bias, state = _batch(MIXED + [(20, "deep")], 300, 4, dtype, 8)
    padded = torch.full((*state.shape[:2], 5), float("nan"), dtype=dtype)[..., :4]
    padded.copy_(state)
    assert ct.packs_channels(weight, state) and not ct.packs_channels(weight, padded)
    assert not ct.packs_channels(weight[:, :3].contiguous(), state[..., :3].contiguous())
    assert not ct.packs_channels(weight.float(), state.float())
    packed = ct.tree_conv1d(xbc, weight, bias, state, parents, cu, slots, lens, max_nodes)
    columns = ct.tree_conv1d(xbc, weight, bias, padded, parents, cu, slots, lens, max_nodes)
    assert torch.equal(packed, columns)
    ref = ct.tree_conv1d_ref(xbc, weight, bias, state, parents, cu, slots, lens, max_nodes)
    torch.testing.assert_close(packed.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_tree_conv1d_stash_errors():
    parents, cu, max_nodes, _, slots, lens, xbc, weight, bias, state = _batch([(5, "random")], 40, 4, torch.float32, 6)
    T = xbc.shape[0]
    for fn in (ct.tree_conv1d, ct.tree_conv1d_ref):
        with pytest.raises(ValueError, match="stash"):
            fn(xbc, weight, bias, state, parents, cu, slots, lens, max_nodes, stash=torch.empty(T, 39))
        with pytest.raises(ValueError, match="stash"):
            fn(xbc, weight, bias, state, parents, cu, slots, lens, max_nodes, stash=(torch.empty_like(xbc), torch.empty(T, 4)))
        with pytest.raises(ValueError, match="contiguous"):
            fn(xbc, weight, bias, state, parents, cu, slots, lens, max_nodes, stash=torch.empty(40, T).t())
    with pytest.raises(ValueError, match="columns"):
        ct.tree_conv1d(xbc, weight[:39], bias[:39], state[:, :39], parents, cu, slots, lens, max_nodes)


def _commit_rows(lens, K, R, gen):
    """(nb, K) row table: distinct random rows (never row 0) for the accepted steps, row 0 past each path."""
    perm = 1 + torch.randperm(R - 1, generator=gen)
    rows = torch.zeros(len(lens), K, dtype=torch.int64)
    at = 0
    for b, n in enumerate(lens):
        rows[b, :n] = perm[at : at + n]
        at += n
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("W", [4, 3, 2, 1])
def test_conv_state_commit(dtype, W):
    """Each ring takes its path's last min(k, W) inputs, each in its position's column; the other
    columns and slots keep their values; the window after the commit is the last W-1 inputs of
    [window before | path]. Two no-op items on one slot (as padded graph rows are) change nothing."""
    gen = torch.Generator().manual_seed(3)
    S, D, K, R = 9, 37, 6, 30
    plen = [1, 2, 3, 6, 4, 0, 0, 5]
    slots = torch.tensor([5, 0, 7, 2, 3, 8, 8, 1], dtype=torch.int32)
    lens = torch.tensor([0, 1, 2, 7, 30, 4, 9, 3], dtype=torch.int32)
    state = torch.randn(S, D, W, generator=gen).to(dtype)
    xbc = torch.randn(R, D + 5, generator=gen).to(dtype)[:, :D]  # rows of a wider buffer, as the stash
    rows = _commit_rows(plen, K, R, gen)
    xbc[0] = float("nan")  # the row table's padding: never read
    path_len = torch.tensor(plen, dtype=torch.int32)
    got, ref = state.clone(), state.clone()
    ct.conv_state_commit(got, slots, xbc, rows, path_len, lens)
    ct.conv_state_commit_ref(ref, slots, xbc, rows, path_len, lens)
    assert torch.equal(got, ref)
    untouched = [s for s in range(S) if s not in slots.tolist()]
    assert torch.equal(got[untouched], state[untouched])
    for b, k in enumerate(plen):
        s, n = int(slots[b]), int(lens[b])
        want = state[s].clone()
        for i in range(max(0, k - W), k):
            want[:, (n + i) % W] = xbc[rows[b, i]]
        assert torch.equal(got[s], want), f"item {b}"
        seq = torch.cat([_window(state[s], n), xbc[rows[b, :k]].t()], dim=1)
        assert torch.equal(_window(got[s], n + k), seq[:, seq.shape[1] - (W - 1):])


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_conv_state_commit_layers_at_once(impl):
    """A layer axis commits every layer in one call: the same as committing each layer on its own."""
    commit = getattr(ct, "conv_state_commit" + ("" if impl == "triton" else "_ref"))
    gen = torch.Generator().manual_seed(11)
    S, L, D, W, K, R = 5, 3, 19, 4, 4, 12
    plen = [2, 4, 1]
    slots = torch.tensor([4, 1, 2], dtype=torch.int32)
    lens = torch.tensor([5, 0, 2], dtype=torch.int32)
    state = torch.randn(S, L, D, W, generator=gen)
    xbc = torch.randn(R, L, D + 3, generator=gen)[..., :D]
    rows = _commit_rows(plen, K, R, gen)
    path_len = torch.tensor(plen, dtype=torch.int32)
    got = state.clone()
    commit(got, slots, xbc, rows, path_len, lens)
    for layer in range(L):
        want = state[:, layer].clone()
        ct.conv_state_commit_ref(want, slots, xbc[:, layer], rows, path_len, lens)
        assert torch.equal(got[:, layer], want), f"layer {layer}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("L", [1, 2, 3, 21])
@pytest.mark.parametrize("start", [None, 0, 2, 9])
def test_conv1d_prefill(dtype, L, start):
    """A prompt from a fresh slot (None) or continuing a ring at committed length `start`."""
    gen = torch.Generator().manual_seed(L)
    D, W = 37, 4
    xbc = torch.randn(L, D, generator=gen).to(dtype)
    weight = torch.randn(D, W, generator=gen).to(dtype)
    bias = torch.randn(D, generator=gen).to(dtype)
    init = torch.randn(D, W, generator=gen).to(dtype) if start is not None else None
    n = start or 0
    out, new_state = ct.conv1d_prefill(xbc, weight, bias, init, n)
    out_ref, state_ref = ct.conv1d_prefill_ref(xbc, weight, bias, init, n)
    torch.testing.assert_close(out.float(), out_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(new_state, state_ref)
    ring = init if init is not None else torch.zeros(D, W, dtype=dtype)
    for t in range(L):
        want = _oracle_conv(_window(ring, n), xbc[: t + 1], weight, bias)
        torch.testing.assert_close(out[t].double(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
    want_state = ring.clone()
    for p in range(max(n, n + L - W), n + L):
        want_state[:, p % W] = xbc[p - n]
    assert torch.equal(new_state, want_state)


@pytest.mark.parametrize("start", [0, 1, 6, 7])
@pytest.mark.parametrize("L", [1, 3, 18])
def test_conv1d_prefill_reads_its_start_on_the_device(start, L):
    """`start` as a one-element tensor (what a prefill graph passes: the slot's committed length,
    read at replay) gives what the int gives, in both twins."""
    gen = torch.Generator().manual_seed(start * 7 + L)
    D, W = 19, 4
    xbc, weight, bias, ring = (torch.randn(*shape, generator=gen) for shape in ((L, D), (D, W), (D,), (D, W)))
    on_device = torch.tensor([start], dtype=torch.int32)
    for prefill in (ct.conv1d_prefill, ct.conv1d_prefill_ref):
        want_out, want_ring = prefill(xbc, weight, bias, ring, start)
        out, new_ring = prefill(xbc, weight, bias, ring, on_device)
        assert torch.equal(out, want_out) and torch.equal(new_ring, want_ring)
    with pytest.raises(ValueError, match="one integer"):
        ct.conv1d_prefill(xbc, weight, bias, ring, torch.tensor([start, start]))


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_commit_then_decode_equals_sequential(impl):
    """Verify a tree, commit one branch, decode the bonus token: same outputs and state as feeding the
    accepted tokens one at a time (and as one prefill)."""
    suffix = "" if impl == "triton" else "_ref"
    tree_conv1d = getattr(ct, "tree_conv1d" + suffix)
    commit = getattr(ct, "conv_state_commit" + suffix)
    prefill = getattr(ct, "conv1d_prefill" + suffix)
    rng = random.Random(4)
    D, W, S = 21, 4, 4
    parents, cu, max_nodes, lists, slots, lens, xbc, weight, bias, state = _batch(
        [(11, "random"), (9, "deep"), (6, "chain")], D, W, torch.float32, 4, S=S)
    tree_out = tree_conv1d(xbc, weight, bias, state, parents, cu, slots, lens, max_nodes)
    branches = [random_branch(lst, rng) for lst in lists]
    K = max(len(p) for p in branches)
    rows = torch.zeros(len(lists), K, dtype=torch.int64)
    for b, p in enumerate(branches):
        rows[b, : len(p)] = int(cu[b]) + torch.tensor(p)
    xbc_path = xbc[rows]
    committed = state.clone()
    path_len = torch.tensor([len(p) for p in branches], dtype=torch.int32)
    commit(committed, slots, xbc, rows, path_len, lens)

    bonus = torch.randn(len(lists), D, generator=torch.Generator().manual_seed(5))
    one = torch.tensor([-1] * len(lists), dtype=torch.int32)
    cu1 = torch.arange(len(lists) + 1, dtype=torch.int32)
    decoded = tree_conv1d(bonus, weight, bias, committed, one, cu1, slots, lens + path_len, 1)
    for b, p in enumerate(branches):
        s, n = int(slots[b]), int(lens[b])
        seq_state = state[s].clone()
        for t, node in enumerate(p):  # one token at a time, through the single-node tree path
            step = tree_conv1d(xbc_path[b, t : t + 1], weight, bias, seq_state[None], one[:1], cu1[:2],
                               torch.zeros(1, dtype=torch.int32), torch.tensor([n + t], dtype=torch.int32), 1)
            torch.testing.assert_close(step[0], tree_out[int(cu[b]) + node], atol=2e-5, rtol=2e-5)
            seq_state[:, (n + t) % W] = xbc_path[b, t]
        assert torch.equal(committed[s], seq_state)
        pre_out, pre_state = prefill(torch.cat([xbc_path[b, : len(p)], bonus[b : b + 1]]), weight, bias, state[s], n)
        torch.testing.assert_close(decoded[b], pre_out[-1], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(pre_out[:-1], tree_out[int(cu[b]) + torch.tensor(p)], atol=2e-5, rtol=2e-5)


def test_ring_shape_errors():
    parents, cu, max_nodes, _, slots, lens, xbc, weight, bias, state = _batch([(5, "random")], 40, 4, torch.float32, 6)
    with pytest.raises(ValueError, match="ring"):
        ct.tree_conv1d(xbc, weight, bias, state[..., :3].contiguous(), parents, cu, slots, lens, max_nodes)
    with pytest.raises(ValueError, match="ring"):
        ct.conv1d_prefill(xbc, weight, bias, state[0, :, :3].contiguous(), 2)


def test_compiles_for_sm90():
    """The kernels as launched above also compile for an H100 (bf16), without register spills."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from tests.kernels.sm90 import compile_sm90, launch_spec, record_launches

    specs = []
    for trees in (MIXED, [(1, "single")] * 3):  # 8-row tiles; one-row tiles with wide channel blocks
        parents, cu, max_nodes, lists, slots, lens, xbc, weight, bias, state = _batch(trees, 300, 4, torch.bfloat16, 6)
        with record_launches(ct._tree_conv1d_kernel) as a:
            ct.tree_conv1d(xbc, weight, bias, state, parents, cu, slots, lens, max_nodes)
            out = torch.empty(xbc.shape[0], 290, dtype=xbc.dtype)[:, :280]  # as a verify calls it
            ct.tree_conv1d(xbc, weight[:280], bias[:280], state[:, :280], parents, cu, slots, lens, max_nodes, out=out,
                           stash=torch.empty_like(xbc))
            padded = torch.zeros(*state.shape[:2], 5, dtype=state.dtype)[..., :4]  # ring rows not packed
            ct.tree_conv1d(xbc, weight, bias, padded, parents, cu, slots, lens, max_nodes)
        specs += [launch_spec(ct._tree_conv1d_kernel, *call) for call in a]
    with record_launches(ct._conv_commit_kernel) as b, record_launches(ct._conv_prefill_kernel) as c:
        ct.conv_state_commit(state, slots, xbc, torch.zeros(len(lists), 3, dtype=torch.int64),
                             torch.ones(len(lists), dtype=torch.int32), lens)
        ct.conv1d_prefill(xbc[:5], weight, bias, state[0], 3)
    specs += [launch_spec(ct._conv_commit_kernel, *b[0]), launch_spec(ct._conv_prefill_kernel, *c[0])]
    for spec, result in zip(specs, compile_sm90(specs)):
        assert result["ok"], (spec["name"], result["error"])
        assert result["spill_bytes"] == 0, (spec["name"], result)
