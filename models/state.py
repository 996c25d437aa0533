"""Per-sequence model state, in fixed slots: SSM and conv states of every Mamba2 block, K/V of every
attention block, and the committed length.

Layouts are slot-major with the layers side by side, so one slot's whole state is one contiguous
block (fork is one copy per tensor) and a commit can treat all layers as extra heads of one big
layer (one kernel call for every Mamba2 block, one for every attention block):

    ssm   (S + 1, n_mamba, H, P, N)        fp32
    conv  (S + 1, n_mamba, conv_dim, W)     model dtype: rings of the last W raw conv inputs, the
                                            input at position p in column p mod W (kernels/conv_tree.py)
    k, v  (S + 1, capacity, n_attn, Hkv, Dh) model dtype

Slot S (one past the last) is scratch: padded rows of captured CUDA graphs point there. The KV
capacity is `max_len` plus headroom for the tree nodes (and graph padding) placed after the
committed prefix during verification.
"""
from __future__ import annotations

import torch

from models.config import AttentionSpec, HybridConfig, MambaSpec
from models.errors import CheckpointError, SequenceTooLong, SlotsExhausted


def _uniform(specs, what: str):
    if not specs:
        return None
    first = specs[0]
    if any(s != first for s in specs[1:]):
        raise CheckpointError(f"{what} blocks of different shapes are not supported")
    return first


class StatePool:
    """Fixed pool of `max_slots` sequence states on one device."""

    def __init__(
        self,
        config: HybridConfig,
        max_slots: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        tree_headroom: int = 128,
    ):
        self.max_slots = int(max_slots)
        self.max_len = int(max_len)
        self.capacity = self.max_len + int(tree_headroom)
        self.device = torch.device(device)
        self.mamba: MambaSpec | None = _uniform(config.mamba_specs, "Mamba2")
        self.attention: AttentionSpec | None = _uniform(config.attention_specs, "attention")
        self.n_mamba = len(config.mamba_specs)
        self.n_attn = len(config.attention_specs)
        S = self.max_slots + 1
        m, a = self.mamba, self.attention
        if m is not None:
            self.ssm = torch.zeros(S, self.n_mamba, m.n_heads, m.head_dim, m.d_state, dtype=torch.float32, device=device)
            self.conv = torch.zeros(S, self.n_mamba, m.conv_dim, m.d_conv, dtype=dtype, device=device)
        if a is not None:
            shape = (S, self.capacity, self.n_attn, a.n_kv_heads, a.head_dim)
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(self.max_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._lengths = [0] * S
        self._versions = [0] * S
        self._in_use = [False] * S

    # ---- slots ---------------------------------------------------------------------------
    @property
    def scratch_slot(self) -> int:
        return self.max_slots

    def alloc(self) -> int:
        """A free slot with an empty state (length 0). Raises SlotsExhausted when none is left."""
        if not self._free:
            raise SlotsExhausted(f"all {self.max_slots} state slots are in use")
        slot = self._free.pop()
        self._in_use[slot] = True
        self._lengths[slot] = 0
        self._bump(slot)
        if self.n_mamba:
            # a reused slot still holds its last sequence's states, and every mode reads them from
            # length 0 on: a prefill continues them (zeros continue exactly like no state), as do a
            # decode or verify of an empty sequence (K/V are read only up to the slot's length, so
            # they need nothing)
            self.ssm[slot].zero_()
            self.conv[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        self.check(slot)
        self._in_use[slot] = False
        self._lengths[slot] = 0
        self._bump(slot)
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        """dst takes src's whole state and length (both must be allocated)."""
        self.check(src)
        self.check(dst)
        if src == dst:
            return
        n = self._lengths[src]
        if self.n_mamba:
            self.ssm[dst].copy_(self.ssm[src])
            self.conv[dst].copy_(self.conv[src])
        if self.n_attn and n:
            self.k[dst, :n].copy_(self.k[src, :n])
            self.v[dst, :n].copy_(self.v[src, :n])
        self._lengths[dst] = n
        self._bump(dst)

    def length(self, slot: int) -> int:
        """Committed length: tokens the slot's state has consumed."""
        self.check(slot)
        return self._lengths[slot]

    def version(self, slot: int) -> int:
        """Changes whenever the slot's state does; pending verifications remember it."""
        return self._versions[slot]

    def in_use(self) -> list[int]:
        return [s for s in range(self.max_slots) if self._in_use[s]]

    def check(self, slot: int) -> None:
        if not (0 <= slot < self.max_slots) or not self._in_use[slot]:
            raise ValueError(f"slot {slot} is not allocated")

    def check_room(self, slot: int, extra: int, what: str) -> None:
        """Raise SequenceTooLong unless `extra` more tokens fit after the slot's committed length."""
        L = self._lengths[slot]
        if L + extra > self.max_len:
            raise SequenceTooLong(
                f"{what}: slot {slot} holds {L} tokens, {extra} more would exceed max_len {self.max_len}"
            )

    def advance(self, slot: int, n: int) -> None:
        self._lengths[slot] += n
        self._bump(slot)

    def _bump(self, slot: int) -> None:
        self._versions[slot] += 1

    def spoil(self, slot: int) -> None:
        """A call that changes `slot`'s state failed partway: its state is unspecified, and no
        handle taken before (a pending verify) may be committed onto it (StaleHandle)."""
        self._bump(slot)

    # ---- per-layer views --------------------------------------------------------------------
    def ssm_layer(self, i: int) -> torch.Tensor:
        """(S + 1, H, P, N) view of the i-th Mamba2 block's states."""
        return self.ssm[:, i]

    def conv_layer(self, i: int) -> torch.Tensor:
        """(S + 1, conv_dim, W) view of the i-th Mamba2 block's conv rings."""
        return self.conv[:, i]

    def kv_layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(S + 1, capacity, Hkv, Dh) views of the i-th attention block's cache."""
        return self.k[:, :, i], self.v[:, :, i]

    # ---- all layers as one (commit) ---------------------------------------------------------
    def kv_folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(S + 1, capacity, n_attn * Hkv, Dh) each."""
        a = self.attention
        shape = (self.k.shape[0], self.capacity, self.n_attn * a.n_kv_heads, a.head_dim)
        return self.k.view(shape), self.v.view(shape)

    def nbytes_per_slot(self) -> int:
        total = 0
        for name in ("ssm", "conv", "k", "v"):
            t = getattr(self, name, None)
            if t is not None:
                total += t[0].numel() * t.element_size()
        return total
