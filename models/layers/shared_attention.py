"""The transformer of a shared-attention block (Zamba2's hybrid layer): what it adds to the block's
Mamba2 mixer input.

    x = rmsnorm(h | e)           (T, 2 * d_model): the residual stream and the token embeddings
    a = attention(x)             (T, d_model), over this block's own K/V cache
    t = proj(mlp(rmsnorm(a)))    (T, d_model)

No residual adds inside: the runtime adds t to h inside the block's norm (`HybridLM.hidden`). The
attention keeps its state like any other (its own index among the attention layers,
`HybridConfig.state_layers`), so verify stashes, commits, CUDA graphs and forks cover it unchanged.
The checkpoint's low-rank adapters are already folded into these weights (models/arch/zamba2.py).
"""
from __future__ import annotations

import torch
from torch import nn

from models.batch import Packed
from models.config import SharedAttentionSpec
from models.layers.attention import Attention
from models.layers.linear import Linear
from models.layers.mlp import MLP
from models.layers.norms import rms_norm
from models.state import StatePool


class SharedTransformer(nn.Module):
    def __init__(self, spec: SharedAttentionSpec, d_model: int, attention_layer: int, norm_eps: float,
                 dtype: torch.dtype, device=None):
        super().__init__()
        self.spec = spec
        self.eps = norm_eps
        self.dtype = dtype
        kw = dict(dtype=dtype, device=device)
        self.input_norm_weight = nn.Parameter(torch.ones(2 * d_model, **kw))
        self.attention = Attention(spec.attention, d_model, attention_layer, dtype, device, d_in=2 * d_model)
        self.mlp_norm_weight = nn.Parameter(torch.ones(d_model, **kw))
        self.mlp = MLP(spec.mlp, d_model, dtype, device)
        self.proj = Linear(d_model, d_model, bias=False, **kw)

    def prepare(self) -> None:
        self.attention.prepare()

    def _input(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """h, emb (T, d_model) -> rmsnorm(h | emb) (T, 2 * d_model)."""
        x = torch.cat([h.to(self.dtype), emb.to(self.dtype)], dim=-1)
        return rms_norm(x, self.input_norm_weight, self.eps, self.dtype)

    def _output(self, a: torch.Tensor) -> torch.Tensor:
        return self.proj(self.mlp(rms_norm(a, self.mlp_norm_weight, self.eps, self.dtype)))

    # ---- modes: h (T, d_model) residual stream, emb (T, d_model) embeddings -> t (T, d_model) ----------
    def prefill(self, h: torch.Tensor, emb: torch.Tensor, batch: Packed, pool: StatePool) -> torch.Tensor:
        return self._output(self.attention.prefill(self._input(h, emb), batch, pool))

    def prefill_chunk(self, h: torch.Tensor, emb: torch.Tensor, batch: Packed, pool: StatePool) -> torch.Tensor:
        return self._output(self.attention.prefill_chunk(self._input(h, emb), batch, pool))

    def decode(self, h: torch.Tensor, emb: torch.Tensor, batch: Packed, pool: StatePool) -> torch.Tensor:
        return self._output(self.attention.decode(self._input(h, emb), batch, pool))

    def verify(self, h: torch.Tensor, emb: torch.Tensor, batch: Packed, pool: StatePool, stash) -> torch.Tensor:
        return self._output(self.attention.verify(self._input(h, emb), batch, pool, stash))
