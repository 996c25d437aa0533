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
from models.buckets import NODE_BUCKETS, bucket
from models.errors import StaleHandle
from models.state import StatePool


class VerifyStash:
    """Per-node commit inputs of one verify call: `T` packed rows.

    xbc_dt (T, n_mamba, conv_dim + H): a layer's raw conv inputs | raw dt, side by side as in its
    in_proj output (z | xBC | dt); xBC (T, n_mamba, conv_dim): its conv output x | B | C; k, v (T,
    n_attn, Hkv, Dh). All in the model dtype. The layer's tree conv writes both Mamba2 parts while it
    reads the one and computes the other: its output goes straight into xBC, where the layer's scan
    reads it, so nothing is written twice and no copy launch runs. The commit splits the columns.
    Likewise an attention layer's K/V write into the cache fills k and v from the same loads.
    """

    def __init__(self, pool: StatePool, T: int, dtype: torch.dtype):
        dev = pool.device
        self.rows = T
        m, a = pool.mamba, pool.attention
        if pool.n_mamba:
            Lm = pool.n_mamba
            self.xbc_dt = torch.empty(T, Lm, m.conv_dim + m.n_heads, dtype=dtype, device=dev)
            self.xBC = torch.empty(T, Lm, m.conv_dim, dtype=dtype, device=dev)
        if pool.n_attn:
            self.k = torch.empty(T, pool.n_attn, a.n_kv_heads, a.head_dim, dtype=dtype, device=dev)
            self.v = torch.empty_like(self.k)

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor], rows: int) -> "VerifyStash":
        """A stash over existing buffers (names as in `tensors()`), `rows` rows each."""
        stash = object.__new__(cls)
        for name, t in tensors.items():
            setattr(stash, name, t)
        stash.rows = rows
        return stash

    def mamba_rows(self, layer: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where Mamba2 block number `layer` keeps its first `T` rows: views (xbc_dt (T, conv_dim + H),
        xBC (T, conv_dim)), the tree conv's stash and its output."""
        return self.xbc_dt[:T, layer], self.xBC[:T, layer]

    def attention_rows(self, layer: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where attention block number `layer` keeps its first `T` rows: views (k (T, Hkv, Dh),
        v (T, Hkv, Dh)), which the block's K/V write into the cache fills as well."""
        return self.k[:T, layer], self.v[:T, layer]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in ("xbc_dt", "xBC", "k", "v") if n in self.__dict__}

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


def check_commit(pool: StatePool, items: Sequence[tuple[Pending, Sequence[int]]]) -> list[list[int]]:
    """Validate a commit before any state changes; returns each item's path as a list.

    Raises StaleHandle if a slot changed since its verification (already committed, decoded,
    prefilled, forked into or freed), ValueError for a malformed path or a slot named twice."""
    seen: set[int] = set()
    paths = []
    for pending, path in items:
        if pending.consumed or pool.version(pending.slot) != pending.version:
            raise StaleHandle(f"slot {pending.slot} changed since this tree was verified")
        if pending.slot in seen:
            raise ValueError(f"slot {pending.slot} appears twice in one commit")
        seen.add(pending.slot)
        paths.append(check_path(pending, path))
    return paths


def commit_meta(items: Sequence[tuple[Pending, Sequence[int]]], paths: list[list[int]], batch: int, steps: int,
                attn_rows: int, pad_slot: int) -> torch.Tensor:
    """The int64 host layout `run_commit` reads, for `batch` >= len(items) items of `steps` >=
    the longest path:

        slot_idx (batch) | cache_lens (batch) | path_len (batch) | cu_paths (batch + 1)
        | mamba_rows (batch * steps) | attn_rows

    Item b's Mamba2 rows are its path's stash rows padded to `steps` with its last one (the kernels
    stop at path_len); its attention rows are packed from cu_paths[b], then padded to `attn_rows`
    with row 0, which the KV write ignores (past cu_paths[-1]). Items past len(items) are no-ops on
    `pad_slot`: path length 0. An eager commit passes batch = len(items), steps = `eager_steps` of
    the longest path, attn_rows = the paths' total; a graph passes its bucket's sizes."""
    n = len(items)
    lens = [p.length for p, _ in items] + [0] * (batch - n)
    plen = [len(path) for path in paths] + [0] * (batch - n)
    cu = [0]
    for k in plen:
        cu.append(cu[-1] + k)
    mamba, attn = [], []
    for (p, _), path in zip(items, paths):
        mamba += [p.row0 + i for i in path] + [p.row0 + path[-1]] * (steps - len(path))
        attn += [p.row0 + i for i in path]
    mamba += [0] * (steps * (batch - n))
    attn += [0] * (attn_rows - len(attn))
    slots = [p.slot for p, _ in items] + [pad_slot] * (batch - n)
    return torch.tensor(slots + lens + plen + cu + mamba + attn, dtype=torch.int64)


def eager_steps(longest: int) -> int:
    """The path axis of an eager commit: the smallest path bucket of the graphs that holds the
    longest path (`models.buckets.NODE_BUCKETS`; past them the next power of two). The SSM commit
    kernel compiles a program per axis length (it unrolls up to 16 steps, masking those past an
    item's path_len, and loops beyond), so an eager commit runs a program that the warm-up or a
    graph's capture has compiled already."""
    return bucket(longest, NODE_BUCKETS) or 1 << (longest - 1).bit_length()


def run_commit(pool: StatePool, stash: VerifyStash, meta: torch.Tensor, batch: int, steps: int, attn_rows: int,
               A_all: torch.Tensor | None, dt_bias_all: torch.Tensor | None, dt_limit) -> None:
    """The device work of a commit laid out by `commit_meta` (on the device, in `meta`): advance
    every block's state, one kernel call per state kind; the Mamba2 kernels read their path inputs
    in place in the stash, through the row table. No host sync and no shape that depends on the
    values, so a CUDA graph can hold it. A_all and dt_bias_all are (n_mamba, H)."""
    split = torch.split(meta, [batch, batch, batch, batch + 1, batch * steps, attn_rows])
    slot_idx, cache_lens, path_len, cu_paths = (t.to(torch.int32) for t in split[:4])
    mamba_rows, attn_idx = split[4].view(batch, steps), split[5]
    if pool.n_mamba:
        m = pool.mamba
        x, Bp, _ = m.split_conv(stash.xBC)  # views (T, n_mamba, H, P) and (T, n_mamba, G, N)
        xbc, dt = stash.xbc_dt[..., : m.conv_dim], stash.xbc_dt[..., m.conv_dim :]
        ops.ssm_state_commit(pool.ssm, slot_idx, x, dt, Bp, mamba_rows, path_len, A_all, dt_bias_all, dt_limit)
        ops.conv_state_commit(pool.conv, slot_idx, xbc, mamba_rows, path_len, cache_lens)
    if pool.n_attn:
        a, La = pool.attention, pool.n_attn
        k = stash.k[attn_idx].view(-1, La * a.n_kv_heads, a.head_dim)
        v = stash.v[attn_idx].view(-1, La * a.n_kv_heads, a.head_dim)
        kf, vf = pool.kv_folded()
        ops.write_tree_kv(kf, vf, k, v, cu_paths, slot_idx, cache_lens)


def merged_stash(items: Sequence[tuple[Pending, Sequence[int]]]) -> tuple[VerifyStash, list[Pending]]:
    """Items whose handles come from different stashes: one stash holding each item's rows (its
    verified tree's) one after the other, and handles that point into it (for `commit_meta`)."""
    parts: dict[str, list[torch.Tensor]] = {}
    moved, row = [], 0
    for p, _ in items:
        n = len(p.parents)
        for name, t in p.stash.tensors().items():
            parts.setdefault(name, []).append(t[p.row0 : p.row0 + n])
        moved.append(Pending(p.slot, p.version, p.length, p.parents, p.stash, row))
        row += n
    return VerifyStash.of({name: torch.cat(ts, 0) for name, ts in parts.items()}, row), moved


def commit(
    pool: StatePool,
    items: Sequence[tuple[Pending, Sequence[int]]],
    A_all: torch.Tensor | None,
    dt_bias_all: torch.Tensor | None,
    dt_limit,
    graphs=None,
) -> None:
    """Advance each pending slot by its accepted path (node indices from the root down one branch).

    Raises StaleHandle if a slot changed since its verification (already committed, decoded,
    prefilled, forked into or freed), ValueError for a malformed path or a slot named twice.
    Every item is checked before any state changes: a call that raises those applies none. One
    that fails later (a device error midway) leaves the slots' states unspecified: their handles
    are consumed and the slots spoiled (`StatePool.spoil`), so a retry raises StaleHandle instead of
    applying a commit twice.
    `graphs` (a models.graphs.GraphRunner, or None): replays the commit as one CUDA graph where it
    can (see `GraphRunner.commit`); otherwise the same program runs eagerly.
    """
    if not items:
        return
    paths = check_commit(pool, items)
    try:
        if graphs is None or not graphs.commit(items, paths):
            stash, pendings = items[0][0].stash, list(items)
            if any(p.stash is not stash for p, _ in items):
                stash, moved = merged_stash(items)
                pendings = [(m, path) for m, (_, path) in zip(moved, items)]
            steps = eager_steps(max(len(p) for p in paths))
            attn_rows = sum(len(p) for p in paths)
            meta = commit_meta(pendings, paths, len(items), steps, attn_rows, pool.scratch_slot).to(pool.device)
            run_commit(pool, stash, meta, len(items), steps, attn_rows, A_all, dt_bias_all, dt_limit)
    except BaseException:
        for pending, _ in items:
            pending.consumed = True
            pool.spoil(pending.slot)
        raise
    for (pending, _), path in zip(items, paths):
        pending.consumed = True
        pool.advance(pending.slot, len(path))
