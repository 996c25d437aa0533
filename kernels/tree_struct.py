"""Per-forward tree structure: every packed node's ancestors-or-self as a bit mask.

The ancestor relation is the same for every layer and head of one verification forward, so it is
built once (one small launch, no host sync, so it can sit inside a captured CUDA graph) and handed
to the layers' tree kernels, which then test bits instead of walking parent pointers.

Layout: `bits (T, W)` int32, `W = words_per_row(max_nodes)`. Bit `j % 32` of word `j // 32` in row
`t` is set iff local node `j` of t's own tree lies on the root-to-t path (t itself included). Words
are reinterpreted as unsigned: bit 31 is the sign bit. Columns past the tree's size are 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import release_next, wait_for_previous
from kernels.ssm_common import as_int32
from kernels.tree_index import block_nodes, packed_ancestor_mask, packed_rows


def words_per_row(max_nodes: int) -> int:
    """int32 words per node row: one bit per column of the padded node tile."""
    return max(1, block_nodes(max_nodes) // 32)


def new_bits(T: int, W: int, device) -> torch.Tensor:
    """Uninitialised output of `ancestor_bits` (one place, so tests can poison it)."""
    return torch.empty(T, W, dtype=torch.int32, device=device)


def ancestor_bits_ref(parents: torch.Tensor, cu_seqlens: torch.Tensor, max_nodes: int) -> torch.Tensor:
    """PyTorch twin of `ancestor_bits`: parents (T,) local, cu_seqlens (B+1,) -> bits (T, W) int32."""
    T = parents.numel()
    W = words_per_row(max_nodes)
    n = int(max_nodes)
    rows = packed_ancestor_mask(parents, cu_seqlens, n)  # (T, n) bool
    padded = torch.zeros(T, W * 32, dtype=torch.int64, device=parents.device)
    padded[:, :n] = rows.long()
    weights = torch.tensor([1 << k for k in range(32)], dtype=torch.int64, device=parents.device)
    words = (padded.view(T, W, 32) * weights).sum(dim=2)  # 0 .. 2**32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def ancestor_mask_from_bits(bits: torch.Tensor, cu_seqlens: torch.Tensor, max_nodes: int) -> torch.Tensor:
    """Inverse view of `bits`: (B, N, N) bool, the layout of `tree_index.ancestor_mask` (N = max_nodes)."""
    n = int(max_nodes)
    T = bits.shape[0]
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    rows = ((bits[:, :, None] >> shifts) & 1).reshape(T, -1)[:, :n].bool()  # (T, n)
    B = cu_seqlens.numel() - 1
    tree, local = packed_rows(cu_seqlens, T)
    mask = torch.zeros(B, n, n, dtype=torch.bool, device=bits.device)
    mask[tree, local] = rows
    return mask


@triton.jit
def _ancestor_bits_kernel(parents_ptr, cu_ptr, out_ptr, NPAD: tl.constexpr, W: tl.constexpr, PDL: tl.constexpr):
    """One program per tree: every row climbs its root path once, setting one bit per step."""
    release_next(PDL)
    wait_for_previous(PDL)  # every input below may come from the kernel before
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    rows = tl.arange(0, NPAD)
    row_ok = rows < n
    word = tl.arange(0, W)
    cur = tl.where(row_ok, rows, -1)  # current ancestor of each row, -1 once past the root
    bits = tl.zeros([NPAD, W], dtype=tl.int32)
    while tl.max(cur, axis=0) >= 0:
        live = cur >= 0
        here = live[:, None] & (word[None, :] == (cur // 32)[:, None])
        bits = tl.where(here, bits | (1 << (cur % 32))[:, None], bits)
        par = tl.load(parents_ptr + start + tl.maximum(cur, 0), mask=live, other=-1)
        # a parent must come before its child; anything else ends the walk, so it always terminates
        cur = tl.where(live & (par < cur), par, -1)
    tl.store(out_ptr + (start + rows)[:, None] * W + word[None, :], bits, mask=row_ok[:, None])


def ancestor_bits(parents: torch.Tensor, cu_seqlens: torch.Tensor, max_nodes: int) -> torch.Tensor:
    """Triton `ancestor_bits`: parents (T,) int32 local (-1 for roots), cu_seqlens (B+1,) int32 ->
    bits (T, W) int32 (module docstring). One launch; no host sync (shapes come from the arguments)."""
    T = parents.numel()
    W = words_per_row(max_nodes)
    out = new_bits(T, W, parents.device)
    nb = cu_seqlens.numel() - 1
    if T == 0 or nb == 0:
        return out
    npad = block_nodes(max_nodes)
    _ancestor_bits_kernel[(nb,)](
        as_int32(parents), as_int32(cu_seqlens), out, NPAD=npad, W=W, **pdl.launch_options(out.device),
        num_warps=4 if npad <= 64 else 8,
    )
    return out
