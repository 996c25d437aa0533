"""Grouped-query attention over the slot KV cache, composed from `kernels.ops` and `kernels.rope`.

Positions are committed length + depth (prompt index for prefill); RoPE (when the architecture has
it) is applied before K is written to the cache. Prefill attends causally with plain SDPA, one
prompt at a time; decode, verify and the prompt pieces of a prefill graph (`prefill_chunk`, a
chain tree) use the tree attention kernel on the packed batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from kernels import ops
from kernels.rope import rope_inv_freq
from models.batch import Packed
from models.config import AttentionSpec
from models.layers.linear import Linear
from models.state import StatePool

# SDPA's first choice for bf16 prompts on Hopper, cuDNN attention, builds a plan for every new
# (prompt, prefix) shape the first time it meets one: 46-588 ms per shape on an H100, where the call
# itself takes 0.1 ms (BENCHMARKS.md, thirtieth round). Flash and memory-efficient attention are
# compiled ahead of time; math is what is left (any device, any dtype). A lower-right causal mask
# (a prompt after a prefix) picks flash or memory-efficient attention by itself and falls back to
# SDPA with a materialised mask; `sdpa_kernel` keeps that fallback and the prefix-free prompts
# (plain causal SDPA) off cuDNN too. It sets process-wide flags, restored on exit: two threads
# prefilling at once could leave one running unrestricted for a moment, or the restriction in place
# after both. Each service makes its model calls one at a time, so this takes two models
# prefilling in separate threads of one process, and costs speed only.
PREFILL_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


class Attention(nn.Module):
    """(T, d_in) -> (T, d_model); `d_in` is d_model except where the attention reads more than the
    residual stream (a shared-attention block: the stream and the embeddings, 2 * d_model)."""

    def __init__(self, spec: AttentionSpec, d_model: int, layer: int, dtype: torch.dtype, device=None,
                 d_in: int | None = None):
        super().__init__()
        self.spec = spec
        self.layer = layer
        kw = dict(dtype=dtype, device=device)
        q, kv = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
        self.qkv_proj = Linear(d_in or d_model, q + 2 * kv, bias=spec.qkv_bias, **kw)
        self.o_proj = Linear(q, d_model, bias=spec.out_bias, **kw)
        if spec.rotary_dim:
            self.register_buffer("inv_freq", rope_inv_freq(spec.rotary_dim, spec.rope_theta, device), persistent=False)

    def prepare(self) -> None:
        if self.spec.rotary_dim:
            self.inv_freq.copy_(rope_inv_freq(self.spec.rotary_dim, self.spec.rope_theta, self.inv_freq.device))

    def _qkv(self, h: torch.Tensor, positions: torch.Tensor):
        s = self.spec
        T = h.shape[0]
        q_dim, kv_dim = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        q, k, v = self.qkv_proj(h).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.reshape(T, s.n_heads, s.head_dim)
        k = k.reshape(T, s.n_kv_heads, s.head_dim)
        v = v.reshape(T, s.n_kv_heads, s.head_dim)
        if s.rotary_dim:
            q, k = ops.rope_qk(q, k, positions, self.inv_freq)
        return q, k, v

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.reshape(o.shape[0], -1))

    # ---- modes --------------------------------------------------------------------------------
    def prefill(self, h: torch.Tensor, batch: Packed, pool: StatePool) -> torch.Tensor:
        """h (T, d_model) packed prompts -> (T, d_model); prompt K/V appended to each slot's cache."""
        s = self.spec
        q, k, v = self._qkv(h, batch.positions)
        k_cache, v_cache = pool.kv_layer(self.layer)
        ops.write_tree_kv(k_cache, v_cache, k, v, batch.cu_seqlens, batch.slot_idx, batch.cache_lens)
        outs = []
        start = 0
        with sdpa_kernel(list(PREFILL_BACKENDS)):
            for n, slot, L in zip(batch.sizes, batch.slots, batch.lens):
                qb = q[start : start + n].transpose(0, 1)[None]  # (1, Hq, n, Dh)
                start += n
                kb = k_cache[slot, : L + n].transpose(0, 1)[None]  # (1, Hkv, L+n, Dh)
                vb = v_cache[slot, : L + n].transpose(0, 1)[None]
                # query i sits at position L + i and sees keys 0 .. L + i: causal from the last key
                o = F.scaled_dot_product_attention(
                    qb, kb, vb, attn_mask=causal_lower_right(n, L + n), scale=s.softmax_scale,
                    enable_gqa=s.n_heads != s.n_kv_heads,
                )
                outs.append(o[0].transpose(0, 1))
        return self._out(torch.cat(outs, 0))

    def prefill_chunk(self, h: torch.Tensor, batch: Packed, pool: StatePool) -> torch.Tensor:
        """h (n, d_model) one prompt piece whose slot and committed length L live on the device only
        (a prefill graph's) -> (n, d_model): the piece is a chain tree (`batch.parents`), so the tree
        attention is causal attention over the prefix and the piece; its K/V land at L .. L+n-1."""
        return self._tree(h, batch, pool, stash=None, chains=True)

    def decode(self, h: torch.Tensor, batch: Packed, pool: StatePool) -> torch.Tensor:
        """h (B, d_model) -> (B, d_model); the token's K/V land at position L of its slot."""
        return self._tree(h, batch, pool, stash=None)

    def verify(self, h: torch.Tensor, batch: Packed, pool: StatePool, stash) -> torch.Tensor:
        """h (T, d_model) tree nodes -> (T, d_model). Tree K/V go to the scratch rows after each
        slot's committed prefix (the committed prefix is untouched) and into the stash for commit."""
        return self._tree(h, batch, pool, stash)

    def _tree(self, h, batch: Packed, pool: StatePool, stash, chains: bool = False) -> torch.Tensor:
        q, k, v = self._qkv(h, batch.positions)
        k_cache, v_cache = pool.kv_layer(self.layer)
        # a verify's K/V also go to its stash (what a commit writes back), from the same launch
        kept = stash.attention_rows(self.layer, h.shape[0]) if stash is not None else None
        ops.write_tree_kv(k_cache, v_cache, k, v, batch.cu_seqlens, batch.slot_idx, batch.cache_lens, stash=kept)
        o = ops.tree_attention(
            q, k_cache, v_cache, batch.parents, batch.cu_seqlens, batch.slot_idx, batch.cache_lens,
            batch.max_nodes, self.spec.softmax_scale, chains=chains,
        )
        return self._out(o)
