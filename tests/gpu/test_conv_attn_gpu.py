"""Tree conv and tree attention kernels on CUDA at model sizes, bf16, against their PyTorch twins and a
float64 oracle. Skipped without CUDA, and under the interpreter. Run with compiled Triton:

    TRITON_INTERPRET=0 python -m pytest -q tests/gpu/test_conv_attn_gpu.py

Tolerances (bf16 inputs, fp32 accumulation on both sides, outputs rounded to bf16):
- conv outputs: atol 1e-2, rtol 1e-2 (one bf16 rounding of |y| <~ 10 is <= 0.04 absolute; SiLU values
  here are mostly < 3, so 1e-2 + 1e-2 |y| covers one ulp plus fp32 reordering);
- attention outputs: atol 1.5e-2, rtol 2e-2 (the kernel rounds softmax weights to bf16 before P·V,
  as flash attention does: relative error <~ 2^-8 per term; outputs are averages of N(0, 1) values);
- state / cache writes and commits: bit-identical to the reference.
"""
from __future__ import annotations

import math
import os
import random

import pytest
import torch
import torch.nn.functional as F

from kernels import conv_tree as ct
from kernels import tree_attention as ta
from tests.kernels.ssm_oracle import ring_window
from tests.kernels.tree_cases import packed_batch, path_to, random_branch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run with TRITON_INTERPRET=0"),
]

DEV = "cuda"
BF = torch.bfloat16
CONV_TOL = dict(atol=1e-2, rtol=1e-2)
ATTN_TOL = dict(atol=1.5e-2, rtol=2e-2)
TREES = [(64, "random"), (1, "single"), (16, "chain"), (33, "star"), (48, "deep"), (24, "bushy")]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _trees(spec, seed):
    parents, cu, max_nodes, lists = packed_batch(spec, random.Random(seed), device=DEV)
    return parents, cu, max_nodes, lists


# committed lengths of the conv tests' six trees: a fresh slot, windows that wrap around the ring
LENS = [0, 1, 2, 3, 130, 4097]


@pytest.mark.parametrize("D", [5376, 6144])
def test_tree_conv1d_model_size(D):
    W, S = 4, 8
    gen = _gen(D)
    parents, cu, max_nodes, lists = _trees(TREES, D)
    T = int(cu[-1])
    slots = torch.tensor([3, 0, 7, 1, 5, 2], dtype=torch.int32, device=DEV)
    lens = torch.tensor(LENS, dtype=torch.int32, device=DEV)
    xbc = torch.randn(T, D, generator=gen, device=DEV).to(BF)
    weight = (torch.randn(D, W, generator=gen, device=DEV) * 0.5).to(BF)
    bias = torch.randn(D, generator=gen, device=DEV).to(BF)
    state = torch.randn(S, D, W, generator=gen, device=DEV).to(BF)
    out = torch.full_like(xbc, float("nan"))
    got = ct.tree_conv1d(xbc, weight, bias, state, parents, cu, slots, lens, max_nodes, out=out)
    ref = ct.tree_conv1d_ref(xbc, weight, bias, state, parents, cu, slots, lens, max_nodes)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), ref.float(), **CONV_TOL)
    for b, lst in enumerate(lists):  # float64 oracle on a few nodes per tree
        for i in sorted({0, len(lst) // 2, len(lst) - 1}):
            path = int(cu[b]) + torch.tensor(path_to(lst, i), device=DEV)
            seq = torch.cat([ring_window(state[int(slots[b])], LENS[b]).double(), xbc[path].double().t()], dim=1)
            want = F.silu(F.conv1d(seq[None], weight.double()[:, None], bias.double(), groups=D)[0, :, -1])
            torch.testing.assert_close(got[int(cu[b]) + i].double(), want, **CONV_TOL)


@pytest.mark.parametrize("D,H", [(5376, 80), (6144, 128)])
def test_tree_conv1d_stash_model_size(D, H):
    """A verify's stash as the layer writes it: raw xBC | dt bit for bit, and the conv's output, in
    rows of the stash, the same as without a stash."""
    W, S = 4, 8
    gen = _gen(D + 2)
    parents, cu, max_nodes, _ = _trees(TREES, D + 2)
    T = int(cu[-1])
    slots = torch.tensor([3, 0, 7, 1, 5, 2], dtype=torch.int32, device=DEV)
    lens = torch.tensor(LENS, dtype=torch.int32, device=DEV)
    xbc_dt = torch.randn(T, D + H, generator=gen, device=DEV).to(BF)
    weight = (torch.randn(D, W, generator=gen, device=DEV) * 0.5).to(BF)
    bias = torch.randn(D, generator=gen, device=DEV).to(BF)
    state = torch.randn(S, D, W, generator=gen, device=DEV).to(BF)
    raw = torch.full_like(xbc_dt, float("nan"))
    rows = torch.full((T, 3, D), float("nan"), dtype=BF, device=DEV)  # the stash: (rows, layers, D)
    got = ct.tree_conv1d(xbc_dt, weight, bias, state, parents, cu, slots, lens, max_nodes, out=rows[:, 1],
                         stash=raw)
    assert torch.equal(got, ct.tree_conv1d(xbc_dt[:, :D].contiguous(), weight, bias, state, parents, cu, slots,
                                           lens, max_nodes))
    assert torch.equal(raw, xbc_dt) and rows[:, 0].isnan().all() and rows[:, 2].isnan().all()


@pytest.mark.parametrize("D", [5376, 6144])
def test_conv_state_commit_and_prefill_model_size(D):
    W, S, K = 4, 8, 9
    gen = _gen(D + 1)
    slots = torch.tensor([6, 1, 4, 0], dtype=torch.int32, device=DEV)
    state = torch.randn(S, D, W, generator=gen, device=DEV).to(BF)
    stashed = torch.randn(4 * K, D + 80, generator=gen, device=DEV).to(BF)[:, :D]  # rows of a wider stash
    rows = torch.randperm(4 * K, generator=gen, device=DEV).view(4, K)
    path_len = torch.tensor([1, 2, 9, 5], dtype=torch.int32, device=DEV)
    lens = torch.tensor([0, 3, 17, 4094], dtype=torch.int32, device=DEV)
    got, ref = state.clone(), state.clone()
    ct.conv_state_commit(got, slots, stashed, rows, path_len, lens)
    ct.conv_state_commit_ref(ref, slots, stashed, rows, path_len, lens)
    assert torch.equal(got, ref)

    L = 1000
    xbc = torch.randn(L, D, generator=gen, device=DEV).to(BF)
    weight = (torch.randn(D, W, generator=gen, device=DEV) * 0.5).to(BF)
    bias = torch.randn(D, generator=gen, device=DEV).to(BF)
    for init, start in ((None, 0), (state[2], 6)):
        out, new_state = ct.conv1d_prefill(xbc, weight, bias, init, start)
        out_ref, state_ref = ct.conv1d_prefill_ref(xbc, weight, bias, init, start)
        torch.testing.assert_close(out.float(), out_ref.float(), **CONV_TOL)
        assert torch.equal(new_state, state_ref)


def _attn_case(spec, lens, seed, Hq=32, Hkv=8, Dh=128, Lmax=4096 + 320, S=8):
    gen = _gen(seed)
    parents, cu, max_nodes, lists = _trees(spec, seed)
    T = int(cu[-1])
    slots = torch.tensor(random.Random(seed).sample(range(S), len(lists)), dtype=torch.int32, device=DEV)
    k_cache = torch.randn(S, Lmax, Hkv, Dh, generator=gen, device=DEV).to(BF)
    v_cache = torch.randn(S, Lmax, Hkv, Dh, generator=gen, device=DEV).to(BF)
    q = torch.randn(T, Hq, Dh, generator=gen, device=DEV).to(BF)
    k = torch.randn(T, Hkv, Dh, generator=gen, device=DEV).to(BF)
    v = torch.randn(T, Hkv, Dh, generator=gen, device=DEV).to(BF)
    cache_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    return dict(parents=parents, cu=cu, max_nodes=max_nodes, lists=lists, slots=slots, k_cache=k_cache,
                v_cache=v_cache, q=q, k=k, v=v, lens=cache_lens, scale=1.0 / math.sqrt(Dh))


def _oracle(c, b, i):
    r0, L, s = int(c["cu"][b]), int(c["lens"][b]), int(c["slots"][b])
    path = r0 + torch.tensor(path_to(c["lists"][b], i), device=DEV)
    k = torch.cat([c["k_cache"][s, :L], c["k"][path]]).double()
    v = torch.cat([c["v_cache"][s, :L], c["v"][path]]).double()
    Hq, Hkv = c["q"].shape[1], k.shape[1]
    kv_of = torch.arange(Hq, device=DEV) // (Hq // Hkv)
    scores = torch.einsum("hd,khd->hk", c["q"][r0 + i].double(), k[:, kv_of]) * c["scale"]
    return torch.einsum("hk,khd->hd", torch.softmax(scores, dim=1), v[:, kv_of])


@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_tree_attention_model_size(num_splits):
    lens = [4096, 128, 1000, 129, 2047, 3001]
    c = _attn_case(TREES, lens, seed=5)
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    kr, vr = c["k_cache"].clone(), c["v_cache"].clone()
    ta.write_tree_kv(kc, vc, c["k"], c["v"], c["cu"], c["slots"], c["lens"])
    ta.write_tree_kv_ref(kr, vr, c["k"], c["v"], c["cu"], c["slots"], c["lens"])
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    out = torch.full_like(c["q"], float("nan"))
    got = ta.tree_attention(c["q"], kc, vc, c["parents"], c["cu"], c["slots"], c["lens"], c["max_nodes"],
                            c["scale"], out=out, num_splits=num_splits)
    ref = ta.tree_attention_ref(c["q"], kr, vr, c["parents"], c["cu"], c["slots"], c["lens"], c["max_nodes"],
                                c["scale"])
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), ref.float(), **ATTN_TOL)
    c["k_cache"], c["v_cache"] = kr, vr
    for b, lst in enumerate(c["lists"]):
        for i in sorted({0, len(lst) // 3, len(lst) - 1}):
            torch.testing.assert_close(got[int(c["cu"][b]) + i].double(), _oracle(c, b, i), **ATTN_TOL)


def test_write_tree_kv_stash_model_size():
    """The verify's K/V stash written by the cache write: rows of a (T, layers, Hkv, Dh) buffer, bit-identical
    to the input; the other layers' columns untouched; the cache as without a stash."""
    c = _attn_case(TREES, [4096, 128, 1000, 129, 2047, 3001], seed=6)
    T = c["k"].shape[0]
    buf_k = torch.full((T, 4, *c["k"].shape[1:]), float("nan"), dtype=c["k"].dtype, device=DEV)
    buf_v = torch.full_like(buf_k, float("nan"))
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    kr, vr = c["k_cache"].clone(), c["v_cache"].clone()
    ta.write_tree_kv(kc, vc, c["k"], c["v"], c["cu"], c["slots"], c["lens"], stash=(buf_k[:, 2], buf_v[:, 2]))
    ta.write_tree_kv_ref(kr, vr, c["k"], c["v"], c["cu"], c["slots"], c["lens"])
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    assert torch.equal(buf_k[:, 2], c["k"]) and torch.equal(buf_v[:, 2], c["v"])
    for other in (0, 1, 3):
        assert torch.isnan(buf_k[:, other]).all() and torch.isnan(buf_v[:, other]).all()


def test_tree_attention_256_nodes_and_decode_batch():
    """The largest tree (256 nodes, a deep one) and a batch of 16 one-token decodes."""
    c = _attn_case([(256, "deep")], [777], seed=9, Lmax=2048)
    kc, vc = c["k_cache"], c["v_cache"]
    ta.write_tree_kv(kc, vc, c["k"], c["v"], c["cu"], c["slots"], c["lens"])
    got = ta.tree_attention(c["q"], kc, vc, c["parents"], c["cu"], c["slots"], c["lens"], c["max_nodes"], c["scale"])
    ref = ta.tree_attention_ref(c["q"], kc, vc, c["parents"], c["cu"], c["slots"], c["lens"], c["max_nodes"], c["scale"])
    torch.testing.assert_close(got.float(), ref.float(), **ATTN_TOL)
    for i in (0, 100, 255):
        torch.testing.assert_close(got[i].double(), _oracle(c, 0, i), **ATTN_TOL)

    lens = [128 + 97 * j for j in range(16)]
    d = _attn_case([(1, "single")] * 16, lens, seed=10, S=16, Lmax=2048)
    ta.write_tree_kv(d["k_cache"], d["v_cache"], d["k"], d["v"], d["cu"], d["slots"], d["lens"])
    args = (d["q"], d["k_cache"], d["v_cache"], d["parents"], d["cu"], d["slots"], d["lens"], 1, d["scale"])
    torch.testing.assert_close(ta.tree_attention(*args).float(), ta.tree_attention_ref(*args).float(), **ATTN_TOL)


def test_tree_attention_chains_model_size():
    """Prompt pieces (`chains=True`: causal masks, no walk of `parents`): a 512-token piece after a
    1000-token prefix and a 128-token one from an empty slot, against the reference and the oracle."""
    c = _attn_case([(512, "chain"), (128, "chain")], [1000, 0], seed=11, Lmax=2048)
    kc, vc = c["k_cache"], c["v_cache"]
    ta.write_tree_kv(kc, vc, c["k"], c["v"], c["cu"], c["slots"], c["lens"])
    args = (c["q"], kc, vc, c["parents"], c["cu"], c["slots"], c["lens"], c["max_nodes"], c["scale"])
    got = ta.tree_attention(*args, chains=True)
    torch.testing.assert_close(got.float(), ta.tree_attention_ref(*args).float(), **ATTN_TOL)
    torch.testing.assert_close(got, ta.tree_attention(*args), atol=0, rtol=0)
    for b, i in ((0, 0), (0, 300), (0, 511), (1, 0), (1, 127)):
        torch.testing.assert_close(got[int(c["cu"][b]) + i].double(), _oracle(c, b, i), **ATTN_TOL)


def test_kv_commit_then_decode_model_size():
    rng = random.Random(3)
    c = _attn_case([(64, "random"), (40, "deep"), (16, "chain")], [300, 2000, 64], seed=3, Lmax=2400)
    kc, vc = c["k_cache"], c["v_cache"]
    ta.write_tree_kv(kc, vc, c["k"], c["v"], c["cu"], c["slots"], c["lens"])
    tree_out = ta.tree_attention(c["q"], kc, vc, c["parents"], c["cu"], c["slots"], c["lens"], c["max_nodes"],
                                 c["scale"])
    branches = [random_branch(lst, rng) for lst in c["lists"]]
    K = max(len(p) for p in branches)
    path_nodes = torch.full((3, K), -1, dtype=torch.int32)
    for b, p in enumerate(branches):
        path_nodes[b, : len(p)] = torch.tensor(p)
    path_nodes = path_nodes.to(DEV)
    path_len = torch.tensor([len(p) for p in branches], dtype=torch.int32, device=DEV)
    kr, vr = kc.clone(), vc.clone()
    ta.kv_commit(kc, vc, c["slots"], c["lens"], path_nodes, path_len)
    ta.kv_commit_ref(kr, vr, c["slots"], c["lens"], path_nodes, path_len)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    # each accepted node, re-run as a one-token decode on the committed cache, sees the same context
    for b, p in enumerate(branches):
        for t in (0, len(p) - 1):
            row = int(c["cu"][b]) + p[t]
            L = c["lens"][b : b + 1] + t
            one = torch.tensor([-1], dtype=torch.int32, device=DEV)
            cu1 = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
            step = ta.tree_attention(c["q"][row : row + 1], kc, vc, one, cu1, c["slots"][b : b + 1], L, 1, c["scale"])
            torch.testing.assert_close(step[0].float(), tree_out[row].float(), **ATTN_TOL)
