"""Packed index tensors for one forward over many sequences (docs/internals.md, "Packed tree batches").

Every mode packs its tokens along one axis: prefill packs whole prompts, decode one token per
sequence (a one-node tree each), verify whole trees. All index data is built on the host and moved
in one transfer; lengths stay on the host so no step needs a device sync.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import ops


@dataclass
class Packed:
    """One packed batch of B sequences and T tokens (or tree nodes).

    tokens (T,) int64; parents (T,) int32 local (-1 for roots, chains for prompts); cu_seqlens (B+1,)
    int32; slot_idx (B,) int32; cache_lens (B,) int32 committed lengths; positions (T,) int64
    (committed length + depth); max_nodes the largest sequence/tree. `sizes`, `slots`, `lens` are the
    host copies of the per-sequence data.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    cu_seqlens: torch.Tensor
    slot_idx: torch.Tensor
    cache_lens: torch.Tensor
    positions: torch.Tensor
    max_nodes: int
    sizes: list[int]
    slots: list[int]
    lens: list[int]
    _ancestors: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def ancestors(self) -> torch.Tensor:
        """(T, W) int32 ancestor-or-self bits of every node (`kernels.tree_struct`), built on the device
        at the first call and then shared by every layer of the forward (no host sync, so it is
        captured with the rest of a CUDA graph)."""
        if self._ancestors is None:
            self._ancestors = ops.ancestor_bits(self.parents, self.cu_seqlens, self.max_nodes)
        return self._ancestors

    @property
    def num_seqs(self) -> int:
        return len(self.sizes)

    @property
    def num_tokens(self) -> int:
        return sum(self.sizes)

    def offsets(self) -> list[int]:
        out = [0]
        for n in self.sizes:
            out.append(out[-1] + n)
        return out


def _depths(parents: list[int]) -> list[int]:
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def pack(
    slots: list[int],
    lens: list[int],
    tokens: list[list[int]],
    parents: list[list[int]],
    device: torch.device,
    max_nodes: int | None = None,
) -> Packed:
    """Pack sequences/trees given per-sequence token and local parent lists (host ints)."""
    sizes = [len(t) for t in tokens]
    flat_tok = [t for seq in tokens for t in seq]
    flat_par = [p for seq in parents for p in seq]
    positions = [L + d for L, par in zip(lens, parents) for d in _depths(list(par))]
    cu = [0]
    for n in sizes:
        cu.append(cu[-1] + n)
    T, B = len(flat_tok), len(sizes)
    host = torch.tensor(flat_tok + positions + flat_par + cu + list(slots) + list(lens), dtype=torch.int64)
    dev = host.to(device, non_blocking=True) if torch.device(device).type == "cuda" else host
    parts = torch.split(dev, [T, T, T, B + 1, B, B])
    return Packed(
        tokens=parts[0],
        positions=parts[1],
        parents=parts[2].to(torch.int32),
        cu_seqlens=parts[3].to(torch.int32),
        slot_idx=parts[4].to(torch.int32),
        cache_lens=parts[5].to(torch.int32),
        max_nodes=max(sizes) if max_nodes is None else max_nodes,
        sizes=sizes,
        slots=list(slots),
        lens=list(lens),
    )


def pack_prompts(slots: list[int], lens: list[int], prompts: list[list[int]], device) -> Packed:
    return pack(slots, lens, prompts, [list(range(-1, len(p) - 1)) for p in prompts], device)


def pack_decode(slots: list[int], lens: list[int], tokens: list[int], device) -> Packed:
    return pack(slots, lens, [[t] for t in tokens], [[-1]] * len(tokens), device)


def pack_trees(slots: list[int], lens: list[int], trees, device, max_nodes: int | None = None) -> Packed:
    """`trees`: objects with `tokens` and `parents` sequences (treeserve.tree.TokenTree)."""
    return pack(slots, lens, [list(t.tokens) for t in trees], [list(t.parents) for t in trees], device, max_nodes)
