"""Index helpers for packed tree batches (see docs/internals.md, "Packed tree batches").

All functions are plain PyTorch on the tensors' own device; kernels and reference twins share them.
"""
from __future__ import annotations

import torch


def block_nodes(max_nodes: int) -> int:
    """Tile size for trees of up to `max_nodes` nodes: next power of two, at least 16."""
    return max(16, 1 << max(0, int(max_nodes) - 1).bit_length())


def tree_sizes(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(B,) number of nodes of each packed tree."""
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def packed_rows(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T,) tree index and (T,) local node index of every packed node (no host sync)."""
    sizes = tree_sizes(cu_seqlens)
    tree = torch.repeat_interleave(torch.arange(sizes.numel(), device=cu_seqlens.device), sizes, output_size=total)
    local = torch.arange(total, device=cu_seqlens.device) - cu_seqlens[:-1].long()[tree]
    return tree, local


def ancestor_mask(parents: torch.Tensor, cu_seqlens: torch.Tensor, max_nodes: int) -> torch.Tensor:
    """Ancestor-or-self masks, padded: (B, N, N) bool with `M[b, i, j]` iff local node j lies on the
    root-to-i path of tree b (N = max_nodes; rows/cols past a tree's size are False).

    Built level by level: row i = row parent(i) plus i itself, valid because parent(i) < i.
    """
    B = cu_seqlens.numel() - 1
    N = int(max_nodes)
    dev = parents.device
    sizes = tree_sizes(cu_seqlens)
    local = torch.full((B, N), -2, dtype=torch.long, device=dev)
    idx = torch.arange(N, device=dev)
    valid = idx[None, :] < sizes[:, None]
    rows = cu_seqlens[:-1].long()[:, None] + idx[None, :]
    rows = torch.where(valid, rows, torch.zeros_like(rows))
    local = torch.where(valid, parents.long()[rows], local)
    mask = torch.zeros(B, N, N, dtype=torch.bool, device=dev)
    eye = torch.eye(N, dtype=torch.bool, device=dev)
    for i in range(N):
        p = local[:, i]
        has_parent = p >= 0
        inherited = torch.where(
            has_parent[:, None], mask[torch.arange(B, device=dev), p.clamp(min=0)], torch.zeros_like(mask[:, 0])
        )
        mask[:, i] = (inherited | eye[i][None, :]) & valid[:, i : i + 1]
    return mask


def packed_ancestor_mask(parents: torch.Tensor, cu_seqlens: torch.Tensor, max_nodes: int) -> torch.Tensor:
    """(T, N) bool: for packed node t, which local nodes of its own tree are its ancestors-or-self."""
    tree, local = packed_rows(cu_seqlens, parents.numel())
    return ancestor_mask(parents, cu_seqlens, max_nodes)[tree, local]


def depths(parents: torch.Tensor, cu_seqlens: torch.Tensor, max_nodes: int) -> torch.Tensor:
    """(T,) int64 depth of each packed node (root = 0)."""
    return packed_ancestor_mask(parents, cu_seqlens, max_nodes).sum(dim=1) - 1
