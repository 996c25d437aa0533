"""What a verification keeps for its commit, and the commit itself.

A `VerifyStash` holds, for every packed node of one verify call, the inputs a commit needs
(design §4): per Mamba2 block the raw conv inputs, x, B and the raw dt; per attention block the
node's K and V (after RoPE). Layers sit side by side, so a commit gathers each accepted path once
for all layers and advances every block's state with one kernel call per state kind.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kernels import ops
from models.errors import StaleHandle
from models.state import StatePool


class VerifyStash:
    """Per-node commit inputs of one verify call: `T` packed rows.

    xbc_dt (T, n_mamba, conv_dim + H): a layer's raw conv inputs | raw dt; xB (T, n_mamba,
    d_inner + G*N): its x | B; k, v (T, n_attn, Hkv, Dh). All in the model dtype. Each pair sits side
    by side as in a layer's in_proj output (z | xBC | dt) and conv output (x | B | C), so a Mamba2
    layer stashes with two copies, not four (each copy is a launch, and a verify runs them for every
    layer); the commit splits the columns.
    """

    def __init__(self, pool: StatePool, T: int, dtype: torch.dtype):
        dev = pool.device
        self.rows = T
        m, a = pool.mamba, pool.attention
        if pool.n_mamba:
            Lm = pool.n_mamba
            self.xbc_dt = torch.empty(T, Lm, m.conv_dim + m.n_heads, dtype=dtype, device=dev)
            self.xB = torch.empty(T, Lm, m.d_inner + m.n_groups * m.d_state, dtype=dtype, device=dev)
        if pool.n_attn:
            self.k = torch.empty(T, pool.n_attn, a.n_kv_heads, a.head_dim, dtype=dtype, device=dev)
            self.v = torch.empty_like(self.k)

    def put_mamba(self, layer: int, xbc_dt, xB) -> None:
        """Mamba2 block number `layer`: xbc_dt (T, conv_dim + H) = in_proj's xBC | dt columns,
        xB (T, d_inner + G*N) = the conv output's x | B columns."""
        T = xbc_dt.shape[0]
        ops.copy_rows_pair(self.xbc_dt[:T, layer], xbc_dt, self.xB[:T, layer], xB)  # one launch

    def put_attention(self, layer: int, k, v) -> None:
        """k, v (T, Hkv, Dh) of attention block number `layer`."""
        T = k.shape[0]
        self.k[:T, layer].copy_(k)
        self.v[:T, layer].copy_(v)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in ("xbc_dt", "xB", "k", "v") if n in self.__dict__}

    def attach(self, pendings) -> None:
        """Told which handles refer to it (graph stashes track them; a private stash needs not)."""

    def own_copies(self, rows: int) -> None:
        """Replace the buffers by private copies of their first `rows` rows (they may be buffers a
        CUDA graph will overwrite)."""
        for name, t in self.tensors().items():
            setattr(self, name, t[:rows].clone())
        self.rows = rows


@dataclass(eq=False)
class Pending:
    """Opaque commit handle for one verified tree."""

    slot: int
    version: int
    length: int
    parents: tuple[int, ...]
    stash: VerifyStash
    row0: int
    consumed: bool = field(default=False)


@dataclass
class VerifyResult:
    """`logits (T, V)` fp32 packed over the batch (None when a `reduce` callable was given, whose
    result is `output`), `offsets` (B + 1 ints: tree b owns rows offsets[b]:offsets[b+1]) and one
    commit handle per tree in `pending`."""

    logits: torch.Tensor | None
    offsets: list[int]
    pending: list[Pending]
    output: Any = None


def check_path(pending: Pending, path: Sequence[int]) -> list[int]:
    path = [int(p) for p in path]
    par = pending.parents
    ok = bool(path) and path[0] == 0 and all(0 < path[k] < len(par) and par[path[k]] == path[k - 1] for k in range(1, len(path)))
    if not ok:
        raise ValueError(f"path {path} is not a root-down branch of the verified tree (slot {pending.slot})")
    return path


def commit(
    pool: StatePool,
    items: Sequence[tuple[Pending, Sequence[int]]],
    A_all: torch.Tensor | None,
    dt_bias_all: torch.Tensor | None,
    dt_limit,
) -> None:
    """Advance each pending slot by its accepted path (node indices from the root down one branch).

    Raises StaleHandle if a slot changed since its verification (already committed, decoded,
    prefilled, forked into or freed), ValueError for a malformed path or a slot named twice.
    Every item is checked before any state changes: a call applies all its commits or none.
    """
    if not items:
        return
    seen: set[int] = set()
    paths = []
    for pending, path in items:
        if pending.consumed or pool.version(pending.slot) != pending.version:
            raise StaleHandle(f"slot {pending.slot} changed since this tree was verified")
        if pending.slot in seen:
            raise ValueError(f"slot {pending.slot} appears twice in one commit")
        seen.add(pending.slot)
        paths.append(check_path(pending, path))
    dev = pool.device
    Bn = len(items)
    K = max(len(p) for p in paths)
    slots = [p.slot for p, _ in items]
    lens = [p.length for p, _ in items]
    plen = [len(p) for p in paths]
    # rows of each item's stash: the path padded to K steps (Mamba2), and the bare path (attention)
    padded = [[p.row0 + i for i in path] + [p.row0 + path[-1]] * (K - len(path)) for (p, _), path in zip(items, paths)]
    on_path = [[p.row0 + i for i in path] for (p, _), path in zip(items, paths)]
    cu = [0]
    for n in plen:
        cu.append(cu[-1] + n)
    flat_pad = [r for rs in padded for r in rs]
    flat_path = [r for rs in on_path for r in rs]
    host = torch.tensor(slots + lens + plen + cu + flat_pad + flat_path, dtype=torch.int64)
    meta = host.to(dev)
    split = torch.split(meta, [Bn, Bn, Bn, Bn + 1, len(flat_pad), len(flat_path)])
    slot_idx, cache_lens, path_len, cu_paths = (t.to(torch.int32) for t in split[:4])
    pad_idx, path_idx = split[4], split[5]

    stashes = [p.stash for p, _ in items]
    same = all(s is stashes[0] for s in stashes)

    def gather(name: str, flat_idx: torch.Tensor, rows: list[list[int]], cols=slice(None)) -> torch.Tensor:
        """Stash rows of buffer `name` (its columns `cols`), item after item -> (sum of len(rows[b]), ...)."""
        if same:
            return getattr(stashes[0], name)[..., cols][flat_idx]
        parts = [getattr(st, name)[..., cols][torch.tensor(rs, dtype=torch.int64).to(dev)]
                 for st, rs in zip(stashes, rows)]
        return torch.cat(parts, 0)

    if pool.n_mamba:
        m, Lm = pool.mamba, pool.n_mamba
        x = gather("xB", pad_idx, padded, slice(None, m.d_inner)).view(Bn, K, Lm * m.n_heads, m.head_dim)
        Bp = gather("xB", pad_idx, padded, slice(m.d_inner, None)).view(Bn, K, Lm * m.n_groups, m.d_state)
        xbc = gather("xbc_dt", pad_idx, padded, slice(None, m.conv_dim)).view(Bn, K, Lm * m.conv_dim)
        dt = gather("xbc_dt", pad_idx, padded, slice(m.conv_dim, None)).view(Bn, K, Lm * m.n_heads)
        ops.ssm_state_commit(pool.ssm_folded(), slot_idx, x, dt, Bp, path_len, A_all, dt_bias_all, dt_limit)
        ops.conv_state_commit(pool.conv_folded(), slot_idx, xbc, path_len)
    if pool.n_attn:
        a, La = pool.attention, pool.n_attn
        k = gather("k", path_idx, on_path).view(-1, La * a.n_kv_heads, a.head_dim)
        v = gather("v", path_idx, on_path).view(-1, La * a.n_kv_heads, a.head_dim)
        kf, vf = pool.kv_folded()
        ops.write_tree_kv(kf, vf, k, v, cu_paths, slot_idx, cache_lens)
    for (pending, _), n in zip(items, plen):
        pending.consumed = True
        pool.advance(pending.slot, n)

