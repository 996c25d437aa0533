"""Attention of tree nodes over a contiguous per-slot KV cache, and the cache writes around it.

Cache layout: `k_cache, v_cache (S, Lmax, Hkv, Dh)`. A sequence in slot s with committed length L
keeps its prefix at `cache[s, :L]`; during verification its tree's K/V sit at `cache[s, L:L+n]`
(node i at `L + i`). Node i attends to the whole prefix and to its ancestors-or-self among the tree
entries, which is ordinary causal attention over `[prefix | root-to-i path]`. Query head h reads
kv head `h // (Hq // Hkv)`; K/V are never repeated per query head.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import release_next, wait_for_previous
from kernels.tree_index import ancestor_mask, packed_rows, tree_sizes


# --------------------------------------------------------------------------------------------
# PyTorch reference twins
# --------------------------------------------------------------------------------------------


def write_tree_kv_ref(k_cache, v_cache, k, v, cu_seqlens, slot_idx, cache_lens, *, stash=None):
    """In place: node i of tree b goes to `cache[slot_idx[b], cache_lens[b] + i]`.

    k_cache, v_cache (S, Lmax, Hkv, Dh); k, v (T, Hkv, Dh) with T >= cu_seqlens[-1]: rows past the
    last tree are padding and are not written (a CUDA graph's commit has a fixed row count).
    `stash = (k_rows, v_rows)`, each (T, Hkv, Dh) with the head dimension contiguous, also receives
    every tree row as it is (what a later commit of the path needs): a verify keeps its K/V there
    without a copy launch of its own.
    """
    T = int(cu_seqlens[-1])
    if stash is not None:
        _check_kv_stash(k, stash)
        stash[0][:T] = k[:T].to(stash[0].dtype)
        stash[1][:T] = v[:T].to(stash[1].dtype)
    tree, local = packed_rows(cu_seqlens, T)
    slot = slot_idx.long()[tree]
    pos = cache_lens.long()[tree] + local
    k_cache[slot, pos] = k[:T].to(k_cache.dtype)
    v_cache[slot, pos] = v[:T].to(v_cache.dtype)


def _check_kv_stash(k, stash) -> None:
    if len(stash) != 2 or any(t.shape != k.shape or t.stride(-1) != 1 for t in stash):
        shapes = [tuple(t.shape) for t in stash]
        raise ValueError(f"K/V stash {shapes} does not fit K/V rows {tuple(k.shape)} (head dimension contiguous)")


def tree_attention_ref(q, k_cache, v_cache, parents, cu_seqlens, slot_idx, cache_lens, max_nodes, scale,
                       *, out=None, chains: bool = False, **_tuning):
    """q (T, Hq, Dh) -> (T, Hq, Dh) in q's dtype; softmax in fp32.

    Tree K/V must already be in the cache (`write_tree_kv`). `out` receives the result when given.
    `chains=True` promises that every tree is a chain (node i's parent is i - 1, a prompt piece):
    the Triton version then masks causally instead of walking `parents`; this one reads `parents`
    either way. The Triton version's tuning keywords are accepted and ignored.
    """
    T, Hq, Dh = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    out = torch.empty_like(q) if out is None else out
    masks = ancestor_mask(parents, cu_seqlens, max_nodes)  # (B, N, N)
    sizes = tree_sizes(cu_seqlens).tolist()
    starts = cu_seqlens[:-1].tolist()
    lens = cache_lens.tolist()
    slots = slot_idx.tolist()
    for b, (n, r0, L, s) in enumerate(zip(sizes, starts, lens, slots)):
        if n == 0:
            continue
        k = k_cache[s, : L + n].float().transpose(0, 1)  # (Hkv, L+n, Dh)
        v = v_cache[s, : L + n].float().transpose(0, 1)
        qb = q[r0 : r0 + n].float().transpose(0, 1).reshape(Hkv, group, n, Dh)
        scores = torch.einsum("hgnd,hkd->hgnk", qb, k) * scale
        allowed = torch.cat([torch.ones(n, L, dtype=torch.bool, device=q.device), masks[b, :n, :n]], dim=1)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        ob = torch.einsum("hgnk,hkd->hgnd", probs, v).reshape(Hq, n, Dh).transpose(0, 1)
        out[r0 : r0 + n] = ob.to(q.dtype)
    return out


def kv_commit_ref(k_cache, v_cache, slot_idx, cache_lens, path_nodes, path_len):
    """In place: `cache[slot, L + t] = cache[slot, L + path_nodes[b, t]]` for t < path_len[b].

    path_nodes (B, K) int32 local node indices (padding -1), path_len (B,) int32. Entries past
    `L + path_len` are left as they are (they are reused by the next tree).
    """
    Bn, K = path_nodes.shape
    t = torch.arange(K, device=path_nodes.device)[None, :].expand(Bn, K)
    keep = t < path_len.long()[:, None]
    slot = slot_idx.long()[:, None].expand(Bn, K)[keep]
    base = cache_lens.long()[:, None].expand(Bn, K)[keep]
    src = base + path_nodes.long()[keep]
    dst = base + t[keep]
    for cache in (k_cache, v_cache):
        cache[slot, dst] = cache[slot, src].clone()  # gather first: sources and targets may overlap


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
#
# Tree attention grid: (query tile, tree x kv head, prefix split). A program owns BLOCK_M query rows
# = BLOCK_T nodes x GROUP_P query heads of one kv head, so every K/V tile it loads serves the whole
# head group (GQA without repeating K/V). It runs a flash-style online softmax over its share of the
# prefix; the last split also covers the tree entries. The ancestor mask of a tile is never stored:
# tree key blocks are visited from the highest index down while every row walks its own root path
# through `parents`, marking the ancestors that fall inside the current block. Since ancestors have
# smaller indices than their descendants, the walk is resumed, not restarted, from block to block,
# so a tile costs depth + #blocks parent gathers in all, for any tree shape and size. A prompt piece
# (CHAIN) skips the walk: there node j is an ancestor-or-self of node i exactly when j <= i, and the
# walk of a 512-node chain is 512 dependent gathers per tile.
# With more than one split the partial (max, sum, accumulator) triples go to an fp32 workspace and a
# second kernel merges them (flash-decoding), which keeps the GPU busy when B x Hkv is small.


@triton.jit(do_not_specialize=["T", "num_splits"])  # sizes that change per call: one compile serves them all
def _tree_attn_kernel(
    q_ptr, k_ptr, v_ptr, parents_ptr, cu_ptr, slot_ptr, lens_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr,
    qk_scale, T, Hkv, num_splits,
    stride_qt, stride_qh,
    stride_ks, stride_kl, stride_kh,
    stride_vs, stride_vl, stride_vh,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, DH: tl.constexpr, BLOCK_DH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_KV: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    CHAIN: tl.constexpr, PDL: tl.constexpr,
):
    release_next(PDL)
    wait_for_previous(PDL)  # every input below may come from the kernel before
    BLOCK_T: tl.constexpr = BLOCK_M // GROUP_P
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    split = tl.program_id(2)
    b = bh // Hkv
    kvh = bh % Hkv
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    L = tl.load(lens_ptr + b)
    slot = tl.load(slot_ptr + b).to(tl.int64)

    r = tl.arange(0, BLOCK_M)
    node = tile * BLOCK_T + r // GROUP_P
    head = kvh * GROUP + r % GROUP_P
    row_ok = (node < n) & (r % GROUP_P < GROUP)
    dd = tl.arange(0, BLOCK_DH)
    d_ok = dd < DH
    qrow = (start + node).to(tl.int64)
    q = tl.load(q_ptr + qrow[:, None] * stride_qt + head[:, None] * stride_qh + dd[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # finite start so a row that sees no key in a block gives exp2(-inf) = 0, never inf - inf
    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DH), tl.float32)
    k_base = k_ptr + slot * stride_ks + kvh * stride_kh
    v_base = v_ptr + slot * stride_vs + kvh * stride_vh
    kv = tl.arange(0, BLOCK_KV)

    # this split's share of the prefix, in whole blocks
    per_split = tl.cdiv(tl.cdiv(L, BLOCK_KV), num_splits) * BLOCK_KV
    lo = split * per_split
    hi = tl.minimum(lo + per_split, L)
    hi = tl.where(tile * BLOCK_T < n, hi, lo)  # tiles past a smaller tree's end have no rows: skip the prefix
    for kv0 in range(lo, hi, BLOCK_KV):
        cols = kv0 + kv
        c_ok = cols < hi
        kt = tl.load(k_base + cols[None, :].to(tl.int64) * stride_kl + dd[:, None],
                     mask=c_ok[None, :] & d_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = tl.where(c_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vl + dd[None, :],
                     mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new

    if split == num_splits - 1:
        cur = tl.where(row_ok, node, -1)  # walk position (local node), -1 past the root
        # tree keys past the tile's last node cannot be ancestors of its rows
        n_blocks = tl.cdiv(tl.minimum(n, (tile + 1) * BLOCK_T), BLOCK_KV)
        for i in range(0, n_blocks):
            j0 = (n_blocks - 1 - i) * BLOCK_KV
            cols = j0 + kv
            if CHAIN:
                hit = ((cols[None, :] <= node[:, None]) & row_ok[:, None]).to(tl.int32)
            else:
                hit = tl.zeros((BLOCK_M, BLOCK_KV), dtype=tl.int32)
                while tl.max(cur, 0) >= j0:
                    hit = tl.where(cur[:, None] == cols[None, :], 1, hit)
                    climb = cur >= j0
                    parent = tl.load(parents_ptr + start + tl.maximum(cur, 0), mask=climb, other=-1)
                    cur = tl.where(climb, parent, cur)
            c_ok = cols < n
            pos = (L + cols).to(tl.int64)
            kt = tl.load(k_base + pos[None, :] * stride_kl + dd[:, None], mask=c_ok[None, :] & d_ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, kt, input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = tl.where(hit != 0, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_base + pos[:, None] * stride_vl + dd[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + qrow[:, None] * stride_ot + head[:, None] * stride_oh + dd[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        ws_row = (split * T + qrow) * (Hkv * GROUP) + head  # workspace (num_splits, T, Hq, ...)
        tl.store(ws_acc_ptr + ws_row[:, None] * DH + dd[None, :], acc, mask=out_mask)
        tl.store(ws_ml_ptr + ws_row * 2, m_i, mask=row_ok)
        tl.store(ws_ml_ptr + ws_row * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["T", "num_splits"])
def _merge_splits_kernel(
    ws_acc_ptr, ws_ml_ptr, out_ptr, T, Hq, num_splits,
    stride_ot, stride_oh,
    DH: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DH: tl.constexpr,
    PDL: tl.constexpr,
):
    release_next(PDL)
    wait_for_previous(PDL)  # every input below may come from the kernel before
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    h_ok = h < Hq
    dd = tl.arange(0, BLOCK_DH)
    mask = h_ok[:, None] & (dd < DH)[None, :]
    m = tl.full((BLOCK_H,), -1.0e30, tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DH), tl.float32)
    for s in range(0, num_splits):
        row = (s * T + t) * Hq + h
        ms = tl.load(ws_ml_ptr + row * 2, mask=h_ok, other=-1.0e30)
        ls = tl.load(ws_ml_ptr + row * 2 + 1, mask=h_ok, other=0.0)
        a = tl.load(ws_acc_ptr + row[:, None] * DH + dd[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, ms)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(ms - m_new)
        l = l * alpha + ls * beta
        acc = acc * alpha[:, None] + a * beta[:, None]
        m = m_new
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + dd[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: small, so CPU tests exercise splitting
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def attention_config(max_nodes: int, group: int, dtype: torch.dtype, on_gpu: bool = True,
                     block_kv: int | None = None, num_warps: int | None = None, block_m: int | None = None) -> dict:
    """Tile shape of `tree_attention`: BLOCK_M query rows per program (nodes x padded head group),
    GROUP_P (head group padded to a power of two), BLOCK_KV keys per block, num_warps."""
    group_p = triton.next_power_of_2(group)
    rows = block_m or 64
    nodes = min(triton.next_power_of_2(max(int(max_nodes), 1)), max(1, rows // group_p))
    block_m = max(16, nodes * group_p)
    # fp32 tiles are twice the bytes and ieee dots need more registers: halve the key block.
    # The interpreter uses small blocks so CPU tests cross many block boundaries.
    default_kv = (32 if dtype == torch.float32 else 64) if on_gpu else 16
    return dict(BLOCK_M=block_m, GROUP_P=group_p, BLOCK_KV=block_kv or default_kv,
                num_warps=num_warps or (4 if block_m <= 16 else 8))


def attention_splits(batch: int, hkv: int, tiles: int, rows_per_head: int, lmax: int, sms: int) -> int:
    """How many ways to split the prefix (flash-decoding), chosen from shapes only (no host sync).

    Split until about two programs per SM, but keep >= ~256 cache entries per split at full length
    and keep the fp32 partials (rows x Dh per split) small next to the K/V they summarise.
    """
    base = batch * hkv * tiles
    if base >= sms:
        return 1
    want = triton.cdiv(2 * sms, base)
    return max(1, min(want, lmax // 256, lmax // (8 * rows_per_head), 32))


def tree_attention(q, k_cache, v_cache, parents, cu_seqlens, slot_idx, cache_lens, max_nodes, scale,
                   *, out=None, chains: bool = False, num_splits: int | None = None, block_kv: int | None = None,
                   num_warps: int | None = None, block_m: int | None = None):
    """Triton twin of `tree_attention_ref`. q (T, Hq, Dh) -> (T, Hq, Dh).

    `out` receives the result when given; `chains=True` promises chain trees (causal masks, no
    walk of `parents`). Keyword-only tuning knobs (defaults chosen from shapes):
    `num_splits` prefix splits, `block_kv` keys per block (power of two >= 16), `num_warps` per program,
    `block_m` query rows per program (power of two; nodes x padded head group, default up to 64).
    """
    T, Hq, Dh = q.shape
    S, Lmax, Hkv, _ = k_cache.shape
    if Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise TypeError("q, k_cache and v_cache must share a dtype")
    for t in (q, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("head dimension must be contiguous")
    group = Hq // Hkv
    B = cu_seqlens.numel() - 1
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError("out must be (T, Hq, Dh) with a contiguous head dimension")
    if T == 0 or B == 0:
        return out
    cfg = attention_config(max_nodes, group, q.dtype, q.is_cuda, block_kv, num_warps, block_m)
    BLOCK_M, GROUP_P, BLOCK_KV = cfg["BLOCK_M"], cfg["GROUP_P"], cfg["BLOCK_KV"]
    BLOCK_T = BLOCK_M // GROUP_P
    BLOCK_DH = max(16, triton.next_power_of_2(Dh))
    tiles = triton.cdiv(int(max_nodes), BLOCK_T)
    if num_splits is None:
        num_splits = attention_splits(B, Hkv, tiles, int(max_nodes) * group, Lmax, _sm_count(q.device))
    if num_splits > 1:
        ws_acc = torch.empty(num_splits, T, Hq, Dh, dtype=torch.float32, device=q.device)
        ws_ml = torch.empty(num_splits, T, Hq, 2, dtype=torch.float32, device=q.device)
    else:
        ws_acc = ws_ml = out
    grid = (tiles, B * Hkv, num_splits)
    with_pdl = pdl.launch_options(q.device)
    _tree_attn_kernel[grid](
        q, k_cache, v_cache, parents, cu_seqlens, slot_idx, cache_lens, out, ws_acc, ws_ml,
        float(scale) * math.log2(math.e), T, Hkv, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_P=GROUP_P, DH=Dh, BLOCK_DH=BLOCK_DH,
        BLOCK_M=BLOCK_M, BLOCK_KV=BLOCK_KV, SPLIT=num_splits > 1, IEEE=q.dtype == torch.float32,
        CHAIN=bool(chains), **with_pdl, num_warps=cfg["num_warps"],
    )
    if num_splits > 1:
        _merge_splits_kernel[(T,)](
            ws_acc, ws_ml, out, T, Hq, num_splits, out.stride(0), out.stride(1),
            DH=Dh, BLOCK_H=triton.next_power_of_2(Hq), BLOCK_DH=BLOCK_DH,
            **with_pdl, num_warps=4,
        )
    return out


@triton.jit(do_not_specialize=["T", "B"])  # sizes that change per call: one compile serves them all
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, cu_ptr, slot_ptr, lens_ptr, ks_ptr, vs_ptr, T, B,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcs, stride_kcl, stride_kch, stride_vcs, stride_vcl, stride_vch,
    stride_kst, stride_ksh, stride_vst, stride_vsh,
    DH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_DH: tl.constexpr,
    STASH: tl.constexpr, PDL: tl.constexpr,
):
    release_next(PDL)
    wait_for_previous(PDL)  # every input below may come from the kernel before
    tile = tl.program_id(0)
    h = tl.program_id(1)
    row = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = (row < T) & (row < tl.load(cu_ptr + B))  # rows past the last tree are padding
    # tree of each packed row: how many trees end at or before it
    bb = tl.arange(0, BLOCK_B)
    ends = tl.load(cu_ptr + 1 + bb, mask=bb < B, other=2147483647)
    tree = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), 1)
    tree = tl.minimum(tree, B - 1)
    start = tl.load(cu_ptr + tree)
    L = tl.load(lens_ptr + tree)
    slot = tl.load(slot_ptr + tree).to(tl.int64)
    dd = tl.arange(0, BLOCK_DH)
    mask = row_ok[:, None] & (dd < DH)[None, :]
    src = row.to(tl.int64)[:, None]
    dst = (L + row - start).to(tl.int64)[:, None]
    k = tl.load(k_ptr + src * stride_kt + h * stride_kh + dd[None, :], mask=mask)
    tl.store(kc_ptr + slot[:, None] * stride_kcs + dst * stride_kcl + h * stride_kch + dd[None, :],
             k.to(kc_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + src * stride_vt + h * stride_vh + dd[None, :], mask=mask)
    tl.store(vc_ptr + slot[:, None] * stride_vcs + dst * stride_vcl + h * stride_vch + dd[None, :],
             v.to(vc_ptr.dtype.element_ty), mask=mask)
    if STASH:
        tl.store(ks_ptr + src * stride_kst + h * stride_ksh + dd[None, :], k.to(ks_ptr.dtype.element_ty), mask=mask)
        tl.store(vs_ptr + src * stride_vst + h * stride_vsh + dd[None, :], v.to(vs_ptr.dtype.element_ty), mask=mask)


def write_tree_kv(k_cache, v_cache, k, v, cu_seqlens, slot_idx, cache_lens, *, stash=None):
    """Triton twin of `write_tree_kv_ref` (in place). One program per (packed row tile, kv head);
    each row finds its tree by counting the trees that end at or before it; rows past the last
    tree are not written. The stash, when given, is written by the same programs from the same
    loads."""
    T, Hkv, Dh = k.shape
    if stash is not None:
        _check_kv_stash(k, stash)
    B = cu_seqlens.numel() - 1
    if T == 0 or B == 0:
        return
    for t in (k, v, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("head dimension must be contiguous")
    ks, vs = stash if stash is not None else (k, v)
    BLOCK_T = min(32, triton.next_power_of_2(T))
    grid = (triton.cdiv(T, BLOCK_T), Hkv)
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, cu_seqlens, slot_idx, cache_lens, ks, vs, T, B,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
        DH=Dh, BLOCK_T=BLOCK_T, BLOCK_B=max(16, triton.next_power_of_2(B)), BLOCK_DH=triton.next_power_of_2(Dh),
        STASH=stash is not None, **pdl.launch_options(k.device), num_warps=4,
    )


@triton.jit
def _kv_commit_kernel(
    kc_ptr, vc_ptr, slot_ptr, lens_ptr, path_ptr, plen_ptr, K,
    stride_ps, stride_kcs, stride_kcl, stride_kch, stride_vcs, stride_vcl, stride_vch,
    DH: tl.constexpr, BLOCK_DH: tl.constexpr,
    PDL: tl.constexpr,
):
    release_next(PDL)
    wait_for_previous(PDL)  # every input below may come from the kernel before
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    L = tl.load(lens_ptr + b).to(tl.int64)
    plen = tl.load(plen_ptr + b)
    dd = tl.arange(0, BLOCK_DH)
    d_ok = dd < DH
    kbase = kc_ptr + slot * stride_kcs + h * stride_kch + dd
    vbase = vc_ptr + slot * stride_vcs + h * stride_vch + dd
    # In order: step t reads entry path[t] >= t and writes entry t. Entries read later are > t, so
    # nothing is read after it was overwritten; the barrier orders this step's reads before its writes
    # across all threads (an earlier step may have read the entry this step overwrites).
    for t in range(0, K):
        src = tl.load(path_ptr + b * stride_ps + t)
        move = (t < plen) & (src != t) & (src >= 0)
        m = d_ok & move
        kk = tl.load(kbase + (L + src) * stride_kcl, mask=m)
        vv = tl.load(vbase + (L + src) * stride_vcl, mask=m)
        tl.debug_barrier()
        tl.store(kbase + (L + t) * stride_kcl, kk, mask=m)
        tl.store(vbase + (L + t) * stride_vcl, vv, mask=m)


def kv_commit(k_cache, v_cache, slot_idx, cache_lens, path_nodes, path_len):
    """Triton twin of `kv_commit_ref` (in place). One program per (sequence, kv head) walks the path in order."""
    Bn, K = path_nodes.shape
    S, Lmax, Hkv, Dh = k_cache.shape
    if Bn == 0 or K == 0:
        return
    path_nodes = path_nodes.contiguous()
    _kv_commit_kernel[(Bn, Hkv)](
        k_cache, v_cache, slot_idx, cache_lens, path_nodes, path_len, K,
        path_nodes.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        DH=Dh, BLOCK_DH=triton.next_power_of_2(Dh), **pdl.launch_options(k_cache.device), num_warps=1,
    )
