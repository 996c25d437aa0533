"""A Mamba2 mixer and an attention side by side (FalconH1's first sublayer): both read the same normed
input and their outputs are summed. Each half keeps its own state (its own index among the Mamba2
layers and among the attention layers, `HybridConfig.state_layers`), so verification stashes,
commits, CUDA graphs and forks cover both without knowing they share a block.

FalconH1's per-half multipliers (input and output scales, the key scale, the in_proj segment scales)
are folded into the halves' weights at load (models/arch/falcon_h1.py): the sum here is plain.
"""
from __future__ import annotations

import torch
from torch import nn

from models.batch import Packed
from models.config import ParallelSpec
from models.layers.attention import Attention
from models.layers.mamba import MambaMixer
from models.state import StatePool


class ParallelMixer(nn.Module):
    def __init__(self, spec: ParallelSpec, d_model: int, mamba_layer: int, attention_layer: int,
                 dtype: torch.dtype, device=None):
        super().__init__()
        self.spec = spec
        self.mamba = MambaMixer(spec.mamba, d_model, mamba_layer, dtype, device)
        # the sum needs the Mamba2 output whole: no norm scale deferred to the residual add
        self.mamba.defers_norm = False
        self.attention = Attention(spec.attention, d_model, attention_layer, dtype, device)

    def prepare(self) -> None:
        self.mamba.prepare()
        self.attention.prepare()

    def prefill(self, h: torch.Tensor, batch: Packed, pool: StatePool) -> torch.Tensor:
        return self.mamba.prefill(h, batch, pool) + self.attention.prefill(h, batch, pool)

    def prefill_chunk(self, h: torch.Tensor, batch: Packed, pool: StatePool) -> torch.Tensor:
        return self.mamba.prefill_chunk(h, batch, pool) + self.attention.prefill_chunk(h, batch, pool)

    def decode(self, h: torch.Tensor, batch: Packed, pool: StatePool) -> torch.Tensor:
        return self.mamba.decode(h, batch, pool) + self.attention.decode(h, batch, pool)

    def verify(self, h: torch.Tensor, batch: Packed, pool: StatePool, stash) -> torch.Tensor:
        return self.mamba.verify(h, batch, pool, stash) + self.attention.verify(h, batch, pool, stash)
