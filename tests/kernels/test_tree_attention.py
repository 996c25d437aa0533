"""Tree attention and its cache writes: Triton (interpreted) vs reference vs a float64 oracle in which
every node runs ordinary causal attention over [committed prefix | its root-to-node path]."""
from __future__ import annotations

import math
import random

import pytest
import torch

from kernels import tree_attention as ta
from kernels.rope import apply_rope, rope_cos_sin
from tests.kernels.interpret_compat import install as _fix_interpreter
from tests.kernels.tree_cases import KINDS, packed_batch, path_to, random_branch

_fix_interpreter()

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


class Case:
    """A packed batch of trees over a random cache; tree K/V not yet written."""

    def __init__(self, kinds_sizes, Hq, Hkv, Dh, lens, dtype, seed, S=6, Lmax=None):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.parents, self.cu, self.max_nodes, self.lists = packed_batch(kinds_sizes, rng)
        self.T = int(self.cu[-1])
        self.B = len(self.lists)
        self.slots = torch.tensor(rng.sample(range(S), self.B), dtype=torch.int32)
        self.lens = torch.tensor(lens, dtype=torch.int32)
        Lmax = Lmax or max(lens) + self.max_nodes + 3
        self.k_cache = torch.randn(S, Lmax, Hkv, Dh, generator=gen).to(dtype)
        self.v_cache = torch.randn(S, Lmax, Hkv, Dh, generator=gen).to(dtype)
        self.q = torch.randn(self.T, Hq, Dh, generator=gen).to(dtype)
        self.k = torch.randn(self.T, Hkv, Dh, generator=gen).to(dtype)
        self.v = torch.randn(self.T, Hkv, Dh, generator=gen).to(dtype)
        self.scale = 1.0 / math.sqrt(Dh)

    def caches(self):
        return self.k_cache.clone(), self.v_cache.clone()

    def oracle(self, b: int, i: int) -> torch.Tensor:
        """(Hq, Dh) float64 output of local node i of tree b."""
        r0, L, s = int(self.cu[b]), int(self.lens[b]), int(self.slots[b])
        path = r0 + torch.tensor(path_to(self.lists[b], i))
        k = torch.cat([self.k_cache[s, :L], self.k[path]]).double()  # (L + depth + 1, Hkv, Dh)
        v = torch.cat([self.v_cache[s, :L], self.v[path]]).double()
        Hq, Hkv = self.q.shape[1], k.shape[1]
        kv_of = torch.arange(Hq) // (Hq // Hkv)  # query head h reads kv head h // group
        scores = torch.einsum("hd,khd->hk", self.q[r0 + i].double(), k[:, kv_of]) * self.scale
        return torch.einsum("hk,khd->hd", torch.softmax(scores, dim=1), v[:, kv_of])


MIXED = [(1, "single"), (5, "chain"), (6, "star"), (9, "deep"), (7, "random"), (8, "bushy")]


def _attend(case, impl, **kw):
    kc, vc = case.caches()
    write = ta.write_tree_kv if impl == "triton" else ta.write_tree_kv_ref
    attend = ta.tree_attention if impl == "triton" else ta.tree_attention_ref
    write(kc, vc, case.k, case.v, case.cu, case.slots, case.lens)
    out = torch.full_like(case.q, float("nan"))
    got = attend(case.q, kc, vc, case.parents, case.cu, case.slots, case.lens, case.max_nodes, case.scale,
                 out=out, **kw)
    assert got is out
    return got, kc, vc


@pytest.mark.parametrize(
    "dtype,Hq,Hkv,Dh,num_splits",
    [
        (torch.float32, 2, 2, 16, 1),  # GQA ratio 1
        (torch.float16, 2, 2, 16, 3),
        (torch.float32, 4, 2, 32, 3),  # ratio 2
        (torch.float16, 4, 2, 32, 1),
        (torch.float32, 8, 2, 64, 2),  # ratio 4
        (torch.float16, 8, 2, 64, 1),
        (torch.float16, 6, 2, 24, 3),  # ratio 3 (padded head group), head dim not a power of two
    ],
)
def test_tree_attention_matches_oracle(dtype, Hq, Hkv, Dh, num_splits):
    lens = [0, 37, 1, 16, 50, 5]  # empty prefix, ragged blocks, exact block
    case = Case(MIXED, Hq, Hkv, Dh, lens, dtype, seed=Hq * 10 + Dh)
    got, _, _ = _attend(case, "triton", num_splits=num_splits, block_kv=16)
    ref, _, _ = _attend(case, "reference")
    assert not torch.isnan(got).any()
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    for b, lst in enumerate(case.lists):
        for i in range(len(lst)):
            want = case.oracle(b, i)
            torch.testing.assert_close(got[int(case.cu[b]) + i].double(), want, atol=2 * tol, rtol=2 * tol)
            torch.testing.assert_close(ref[int(case.cu[b]) + i].double(), want, atol=2 * tol, rtol=2 * tol)


@pytest.mark.parametrize("kind", KINDS)
def test_large_trees_every_kind(kind):
    """40 nodes: several query tiles and several tree key blocks, default splitting."""
    case = Case([(40, kind), (3, "chain")], 4, 1, 16, [21, 3], torch.float32, seed=len(kind))
    got, _, _ = _attend(case, "triton")
    ref, _, _ = _attend(case, "reference")
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    for i in sorted({0, len(case.lists[0]) // 2, len(case.lists[0]) - 1}):
        torch.testing.assert_close(got[i].double(), case.oracle(0, i), atol=4e-5, rtol=4e-5)


@pytest.mark.parametrize("sizes,lens", [((1,), (0,)), ((40, 3, 17), (21, 0, 5)), ((70,), (33,))])
def test_chains_mask_causally_without_the_walk(sizes, lens):
    """`chains=True` (prompt pieces): the same outputs as the walk of `parents` over chain trees,
    across query tiles and tree key blocks, with and without a prefix."""
    case = Case([(n, "chain") for n in sizes], 8, 2, 32, list(lens), torch.float32, seed=sum(sizes))
    walked, _, _ = _attend(case, "triton", block_kv=16)
    chained, _, _ = _attend(case, "triton", block_kv=16, chains=True)
    ref, _, _ = _attend(case, "reference", chains=True)
    assert not torch.isnan(chained).any()
    torch.testing.assert_close(chained, walked, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chained, ref, atol=2e-5, rtol=2e-5)
    last = len(case.lists[0]) - 1
    torch.testing.assert_close(chained[last].double(), case.oracle(0, last), atol=4e-5, rtol=4e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_tree_kv_bit_identical(dtype):
    case = Case(MIXED, 4, 2, 32, [0, 3, 9, 1, 2, 30], dtype, seed=7, S=9)
    kc, vc = case.caches()
    kr, vr = case.caches()
    ta.write_tree_kv(kc, vc, case.k, case.v, case.cu, case.slots, case.lens)
    ta.write_tree_kv_ref(kr, vr, case.k, case.v, case.cu, case.slots, case.lens)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    written = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for b, lst in enumerate(case.lists):
        s, L, r0 = int(case.slots[b]), int(case.lens[b]), int(case.cu[b])
        assert torch.equal(kc[s, L : L + len(lst)], case.k[r0 : r0 + len(lst)])
        assert torch.equal(vc[s, L : L + len(lst)], case.v[r0 : r0 + len(lst)])
        written[s, L : L + len(lst)] = True
    assert torch.equal(kc[~written], case.k_cache[~written]) and torch.equal(vc[~written], case.v_cache[~written])


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("pad", [0, 5])
def test_write_tree_kv_fills_the_stash(impl, pad):
    """With a stash (rows of a wider (T, layers, Hkv, Dh) buffer, as a verify passes it) every tree row
    lands there unchanged, padding rows and the other layers' columns stay as they were (NaN), and
    the cache gets exactly what it gets without a stash."""
    case = Case(MIXED, 4, 2, 32, [0, 3, 9, 1, 2, 30], torch.float16, seed=13, S=9)
    gen = torch.Generator().manual_seed(pad)
    k = torch.cat([case.k, torch.randn(pad, *case.k.shape[1:], generator=gen).to(case.k.dtype)])
    v = torch.cat([case.v, torch.randn(pad, *case.v.shape[1:], generator=gen).to(case.v.dtype)])
    T, real = k.shape[0], int(case.cu[-1])
    buf_k = torch.full((T, 3, *k.shape[1:]), float("nan"), dtype=k.dtype)
    buf_v = torch.full_like(buf_k, float("nan"))
    write = ta.write_tree_kv if impl == "triton" else ta.write_tree_kv_ref
    kc, vc = case.caches()
    write(kc, vc, k, v, case.cu, case.slots, case.lens, stash=(buf_k[:, 1], buf_v[:, 1]))
    kr, vr = case.caches()
    ta.write_tree_kv_ref(kr, vr, k, v, case.cu, case.slots, case.lens)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    assert torch.equal(buf_k[:real, 1], k[:real]) and torch.equal(buf_v[:real, 1], v[:real])
    assert torch.isnan(buf_k[real:]).all() and torch.isnan(buf_v[real:]).all()
    for other in (0, 2):
        assert torch.isnan(buf_k[:, other]).all() and torch.isnan(buf_v[:, other]).all()


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_write_tree_kv_rejects_a_stash_that_does_not_fit(impl):
    case = Case(MIXED, 4, 2, 16, [0, 3, 9, 1, 2, 30], torch.float32, seed=3, S=9)
    write = ta.write_tree_kv if impl == "triton" else ta.write_tree_kv_ref
    kc, vc = case.caches()
    short = torch.empty(case.k.shape[0] - 1, *case.k.shape[1:])
    with pytest.raises(ValueError, match="does not fit"):
        write(kc, vc, case.k, case.v, case.cu, case.slots, case.lens, stash=(short, short))


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("pad", [1, 37])
def test_write_tree_kv_ignores_rows_past_the_last_tree(impl, pad):
    """A commit graph passes a fixed number of rows: those past cu[-1] must change nothing (the last
    tree would otherwise write them past its path, even past its slot's capacity)."""
    case = Case(MIXED, 4, 2, 16, [0, 3, 9, 1, 2, 30], torch.float32, seed=11, S=9)
    gen = torch.Generator().manual_seed(pad)
    k = torch.cat([case.k, torch.randn(pad, *case.k.shape[1:], generator=gen)])
    v = torch.cat([case.v, torch.randn(pad, *case.v.shape[1:], generator=gen)])
    write = ta.write_tree_kv if impl == "triton" else ta.write_tree_kv_ref
    kc, vc = case.caches()
    write(kc, vc, k, v, case.cu, case.slots, case.lens)
    kr, vr = case.caches()
    ta.write_tree_kv_ref(kr, vr, case.k, case.v, case.cu, case.slots, case.lens)  # no padding
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_kv_commit_then_decode_equals_sequential(impl):
    """Commit an accepted branch, then decode the bonus token: the cache holds exactly what feeding the
    accepted tokens one at a time writes, and every output matches the sequential run."""
    write = ta.write_tree_kv if impl == "triton" else ta.write_tree_kv_ref
    attend = ta.tree_attention if impl == "triton" else ta.tree_attention_ref
    commit = ta.kv_commit if impl == "triton" else ta.kv_commit_ref
    rng = random.Random(11)
    case = Case([(8, "random"), (1, "single"), (7, "deep")], 4, 2, 16, [5, 0, 33],
                torch.float32, seed=11, S=7, Lmax=64)
    kc, vc = case.caches()
    write(kc, vc, case.k, case.v, case.cu, case.slots, case.lens)
    tree_out = attend(case.q, kc, vc, case.parents, case.cu, case.slots, case.lens, case.max_nodes, case.scale)
    branches = [random_branch(lst, rng) for lst in case.lists]
    K = max(len(p) for p in branches) + 1
    path_nodes = torch.full((case.B, K), -1, dtype=torch.int32)
    for b, p in enumerate(branches):
        path_nodes[b, : len(p)] = torch.tensor(p)
    path_len = torch.tensor([len(p) for p in branches], dtype=torch.int32)
    commit(kc, vc, case.slots, case.lens, path_nodes, path_len)

    ks, vs = case.caches()  # sequential: one single-node tree per accepted token
    one = torch.tensor([-1], dtype=torch.int32)
    cu1 = torch.tensor([0, 1], dtype=torch.int32)
    for b, p in enumerate(branches):
        slot = case.slots[b : b + 1]
        r0 = int(case.cu[b])
        for t, node in enumerate(p):
            L = case.lens[b : b + 1] + t
            row = slice(r0 + node, r0 + node + 1)
            write(ks, vs, case.k[row], case.v[row], cu1, slot, L)
            step = attend(case.q[row], ks, vs, one, cu1, slot, L, 1, case.scale)
            torch.testing.assert_close(step[0], tree_out[r0 + node], atol=2e-5, rtol=2e-5)
        s, end = int(case.slots[b]), int(case.lens[b]) + len(p)
        assert torch.equal(kc[s, :end], ks[s, :end]) and torch.equal(vc[s, :end], vs[s, :end])

    # decode the bonus token of every sequence on the committed cache
    new_lens = case.lens + path_len
    gen = torch.Generator().manual_seed(12)
    qb = torch.randn(case.B, 4, 16, generator=gen)
    kb = torch.randn(case.B, 2, 16, generator=gen)
    vb = torch.randn(case.B, 2, 16, generator=gen)
    cuB = torch.arange(case.B + 1, dtype=torch.int32)
    rootsB = torch.full((case.B,), -1, dtype=torch.int32)
    write(kc, vc, kb, vb, cuB, case.slots, new_lens)
    write(ks, vs, kb, vb, cuB, case.slots, new_lens)
    dec = attend(qb, kc, vc, rootsB, cuB, case.slots, new_lens, 1, case.scale)
    dec_seq = ta.tree_attention_ref(qb, ks, vs, rootsB, cuB, case.slots, new_lens, 1, case.scale)
    torch.testing.assert_close(dec, dec_seq, atol=2e-5, rtol=2e-5)
    untouched = [s for s in range(kc.shape[0]) if s not in case.slots.tolist()]
    assert torch.equal(kc[untouched], case.k_cache[untouched]) and torch.equal(vc[untouched], case.v_cache[untouched])


def test_kv_commit_matches_reference_bitwise():
    case = Case([(12, "chain"), (7, "star"), (9, "deep")], 2, 2, 32, [4, 40, 0], torch.float16, seed=13, S=5)
    kc, vc = case.caches()
    ta.write_tree_kv_ref(kc, vc, case.k, case.v, case.cu, case.slots, case.lens)
    kr, vr = kc.clone(), vc.clone()
    path_nodes = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 6, -1, -1, -1, -1, -1], [0, 1, 2, -1, -1, -1, -1]],
                              dtype=torch.int32)
    deep = case.lists[2]
    chain_to_last = path_to(deep, len(deep) - 1)[:7]
    path_nodes[2] = -1
    path_nodes[2, : len(chain_to_last)] = torch.tensor(chain_to_last)
    path_len = torch.tensor([7, 2, len(chain_to_last)], dtype=torch.int32)
    ta.kv_commit(kc, vc, case.slots, case.lens, path_nodes, path_len)
    ta.kv_commit_ref(kr, vr, case.slots, case.lens, path_nodes, path_len)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def test_rope_matches_transformers_convention():
    """rotate_half RoPE: pairs (d, d + R/2), positions offset + depth, partial rotary passes the tail."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=gen)
    pos = torch.tensor([7, 8, 8, 9, 12])
    cos, sin = rope_cos_sin(pos, 8, 10000.0, torch.float32)
    y = apply_rope(x, cos, sin)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).double() / 8))
    for t in range(5):
        ang = pos[t].double() * inv
        for d in range(4):
            a, b = x[t, :, d].double(), x[t, :, d + 4].double()
            torch.testing.assert_close(y[t, :, d].double(), a * ang[d].cos() - b * ang[d].sin(), atol=1e-5, rtol=0)
            torch.testing.assert_close(y[t, :, d + 4].double(), b * ang[d].cos() + a * ang[d].sin(), atol=1e-5, rtol=0)
    cos4, sin4 = rope_cos_sin(pos, 4, 10000.0, torch.float32)
    y4 = apply_rope(x, cos4, sin4)
    assert torch.equal(y4[..., 4:], x[..., 4:])
    torch.testing.assert_close(y4[..., :4], apply_rope(x[..., :4], cos4, sin4))
    # relative positions: q·k after RoPE depends on the position difference only
    q, k = x[0, 0], x[1, 1]
    def dot(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor([pq]), 8, 10000.0, torch.float32)
        ck, sk = rope_cos_sin(torch.tensor([pk]), 8, 10000.0, torch.float32)
        return (apply_rope(q[None, None], cq, sq) * apply_rope(k[None, None], ck, sk)).sum()
    torch.testing.assert_close(dot(10, 3), dot(107, 100), atol=1e-4, rtol=1e-4)


def test_rope_bit_identical_to_transformers_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=500000.0)
    gen = torch.Generator().manual_seed(1)
    pos = torch.tensor([3, 4, 4, 9, 130])
    q = torch.randn(1, 4, 5, 16, generator=gen)
    k = torch.randn(1, 2, 5, 16, generator=gen)
    cos_hf, sin_hf = LlamaRotaryEmbedding(cfg)(q, pos[None])
    cos, sin = rope_cos_sin(pos, 16, 500000.0, torch.float32)
    assert torch.equal(cos, cos_hf[0]) and torch.equal(sin, sin_hf[0])
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    # ours is (T, H, Dh); transformers' is (B, H, T, Dh)
    assert torch.equal(apply_rope(q[0].transpose(0, 1), cos, sin), q_hf[0].transpose(0, 1))
    assert torch.equal(apply_rope(k[0].transpose(0, 1), cos, sin), k_hf[0].transpose(0, 1))


def test_compiles_for_sm90():
    """The attention kernels, launched as on the GPU (same tiles and warps), compile for an H100:
    bf16 decode-sized tiles with prefix splits and the merge, bf16 tree-sized tiles, fp32, the
    cache writes. bf16 kernels must not spill registers."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from tests.kernels.sm90 import compile_sm90, launch_spec, record_launches

    specs = []
    cases = [(torch.bfloat16, [(1, "single"), (1, "single")], 2), (torch.bfloat16, [(20, "random"), (5, "chain")], 1),
             (torch.float32, [(20, "random"), (5, "chain")], 1)]
    for dtype, trees, splits in cases:
        case = Case(trees, 32, 8, 128, [20, 3], dtype, seed=1, S=2)
        cfg = ta.attention_config(case.max_nodes, 4, dtype, on_gpu=True)
        kc, vc = case.caches()
        with record_launches(ta._tree_attn_kernel) as a, record_launches(ta._merge_splits_kernel) as m, \
                record_launches(ta._write_kv_kernel) as w, record_launches(ta._kv_commit_kernel) as c:
            ta.write_tree_kv(kc, vc, case.k, case.v, case.cu, case.slots, case.lens)
            ta.tree_attention(case.q, kc, vc, case.parents, case.cu, case.slots, case.lens, case.max_nodes,
                              case.scale, num_splits=splits, block_kv=cfg["BLOCK_KV"])
            ta.kv_commit(kc, vc, case.slots, case.lens, torch.tensor([[0, 1], [0, 2]], dtype=torch.int32),
                         torch.tensor([1, 1], dtype=torch.int32))
        assert a[0][1]["BLOCK_M"] == cfg["BLOCK_M"]
        # fp32 (ieee dots) may spill: it is the exactness path, not the fast one
        specs.append((launch_spec(ta._tree_attn_kernel, *a[0], num_warps=cfg["num_warps"]), dtype != torch.float32))
        if m:
            specs.append((launch_spec(ta._merge_splits_kernel, *m[0]), True))
        if trees[0][0] == 1:
            specs += [(launch_spec(ta._write_kv_kernel, *w[0]), True),
                      (launch_spec(ta._kv_commit_kernel, *c[0], num_warps=1), True)]
    results = compile_sm90([spec for spec, _ in specs])
    for (spec, no_spills), result in zip(specs, results):
        assert result["ok"], (spec["name"], result["error"])
        if no_spills:
            assert result["spill_bytes"] == 0, (spec["name"], result)
