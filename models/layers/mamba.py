"""The Mamba2 mixer in its three modes, composed from `kernels.ops`.

in_proj -> z | xBC | dt; causal depthwise conv + SiLU over xBC; SSD scan over (x, dt, B, C);
y meets the gate z (`MambaSpec.gate_norm`: gated RMSNorm of y * silu(z), plain y * silu(z), or
RMSNorm of y then * silu(z)); out_proj. The mixer's state lives in the StatePool (index `layer` among
the Mamba2 blocks); verification leaves it untouched and records, per node, what a commit needs:
the raw conv inputs, x, B and the raw dt (into a VerifyStash).
"""
from __future__ import annotations

import torch
from torch import nn

from kernels import ops, proj_conv
from models.batch import Packed
from models.config import MambaSpec
from models.layers.linear import Linear
from models.layers.norms import RowScaled, gated_rms_norm, norm_before_gate, silu_gated
from models.state import StatePool

MAX_DECODE_ROWS = 4096  # largest decode batch (sequences per step)


class MambaMixer(nn.Module):
    def __init__(self, spec: MambaSpec, d_model: int, layer: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.spec = spec
        self.layer = layer
        kw = dict(dtype=dtype, device=device)
        self.in_proj = Linear(d_model, spec.in_proj_dim, bias=spec.proj_bias, **kw)
        self.conv_weight = nn.Parameter(torch.empty(spec.conv_dim, spec.d_conv, **kw))
        self.conv_bias = nn.Parameter(torch.empty(spec.conv_dim, **kw)) if spec.conv_bias else None
        f32 = dict(dtype=torch.float32, device=device)
        self.dt_bias = nn.Parameter(torch.empty(spec.n_heads, **f32))
        self.A_log = nn.Parameter(torch.empty(spec.n_heads, **f32))
        self.D = nn.Parameter(torch.empty(spec.n_heads, **f32))
        self.norm_weight = nn.Parameter(torch.empty(spec.d_inner, **kw)) if spec.has_norm else None
        self.out_proj = Linear(spec.d_inner, d_model, bias=spec.out_proj_bias, **kw)
        self.register_buffer("A", torch.empty(spec.n_heads, **f32), persistent=False)
        # the fused decode step's per-row arrival counters (left at zero by every launch)
        rows = torch.zeros(MAX_DECODE_ROWS, dtype=torch.int32, device=device)
        self.register_buffer("arrivals", rows, persistent=False)
        # a gated norm over the whole row, followed by a bias-free out_proj, is one factor per row
        # that decode and verify leave to the residual add after out_proj (kernels/mamba_decode.py,
        # kernels/ssd_tree.py); a container that adds this output to another (ParallelMixer) turns
        # it off
        self.defers_norm = (
            spec.gate_norm == "gated" and spec.norm_group_size == spec.d_inner and not spec.out_proj_bias
        )

    def prepare(self) -> None:
        """Derive constants once the weights are loaded."""
        with torch.no_grad():
            self.A.copy_(-torch.exp(self.A_log.float()))

    # ---- pieces -------------------------------------------------------------------------------
    def _project(self, h: torch.Tensor):
        """h (T, d_model) -> (zxbcdt (T, in_proj_dim), and its z, xBC, dt column views)."""
        return self._columns(self.in_proj(h))

    def _columns(self, zxbcdt: torch.Tensor):
        """in_proj's output (T, in_proj_dim) -> (it, and its z, xBC, dt column views)."""
        s = self.spec
        return (zxbcdt, *zxbcdt.split([s.d_inner, s.conv_dim, s.n_heads], dim=-1))

    def _finish(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        s = self.spec
        T = y.shape[0]
        y = y.reshape(T, s.d_inner)
        if s.gate_norm == "gated":
            g = gated_rms_norm(y, z, self.norm_weight, s.norm_group_size, s.norm_eps, z.dtype)
        elif s.gate_norm == "none":
            g = silu_gated(y, z, z.dtype)
        else:
            g = norm_before_gate(y, z, self.norm_weight, s.norm_group_size, s.norm_eps, z.dtype)
        return self.out_proj(g)

    # ---- modes --------------------------------------------------------------------------------
    def prefill(self, h: torch.Tensor, batch: Packed, pool: StatePool) -> torch.Tensor:
        """h (T, d_model) packed prompts -> (T, d_model); writes each slot's final conv and SSM state.

        The prefill kernels take one sequence each, so this loops over the prompts; everything
        around the scan runs on the packed batch. Each prompt's slot and committed length are read
        on the device (`batch.slot_idx`, `batch.cache_lens`), never from the host, so a graph of
        this program serves any slot at any length (`prefill_chunk`). A fresh slot's states are
        zeros (`StatePool.alloc`), which continue exactly like no state at all.
        """
        s = self.spec
        _, z, xbc, dt = self._project(h)
        ssm, conv = pool.ssm_layer(self.layer), pool.conv_layer(self.layer)
        ys = []
        start = 0
        for b, n in enumerate(batch.sizes):
            rows = slice(start, start + n)
            start += n
            slot = batch.slot_idx[b : b + 1]  # (1,) on the device: indexing with it gathers, assigning scatters
            conv_out, conv_state = ops.conv1d_prefill(
                xbc[rows], self.conv_weight, self.conv_bias, conv[slot][0], batch.cache_lens[b : b + 1]
            )
            conv[slot] = conv_state[None]
            x, B, C = s.split_conv(conv_out)
            y, final = ops.ssd_prefill(
                x, dt[rows], self.A, B, C, self.D, self.dt_bias, s.dt_limit, initial_state=ssm[slot][0],
            )  # the kernel's own chunk size: the result does not depend on it
            ssm[slot] = final[None]
            ys.append(y)
        return self._finish(torch.cat(ys, 0), z)

    def prefill_chunk(self, h: torch.Tensor, batch: Packed, pool: StatePool) -> torch.Tensor:
        """One prompt piece whose slot and committed length live on the device only (a prefill
        graph's): the prefill, which reads nothing else from the host."""
        return self.prefill(h, batch, pool)

    def decode(self, h: torch.Tensor, batch: Packed, pool: StatePool) -> torch.Tensor | RowScaled:
        """h (B, d_model), one token per sequence -> (B, d_model), or RowScaled((B, d_model), SumOfSquares)
        when the gated norm's scale is deferred; advances conv and SSM state.

        Everything between the projections (conv, state updates, SSM, gate and gated norm) is one
        fused step (kernels/mamba_decode.py) when the gate meets a gated norm or no norm; a norm
        before the gate runs the unfused kernels (`_decode_unfused`)."""
        s = self.spec
        if s.gate_norm == "norm_before_gate":
            return self._decode_unfused(h, batch, pool)
        state = (
            self.in_proj(h), pool.conv_layer(self.layer), pool.ssm_layer(self.layer), batch.slot_idx,
            batch.cache_lens, self.conv_weight, self.conv_bias, self.A, self.D, self.dt_bias, s.dt_limit,
        )
        if s.gate_norm == "none":
            return self.out_proj(ops.mamba_decode_step_gate_only(*state, arrivals=self.arrivals))
        common = (*state, self.norm_weight)
        if self.defers_norm:
            u, sums = ops.mamba_decode_step_deferred_norm(*common, s.norm_eps, arrivals=self.arrivals)
            return RowScaled(self.out_proj(u), sums)
        g = ops.mamba_decode_step(*common, s.norm_group_size, s.norm_eps, arrivals=self.arrivals)
        return self.out_proj(g)

    def _decode_unfused(self, h: torch.Tensor, batch: Packed, pool: StatePool) -> torch.Tensor:
        """Decode as a one-node tree per sequence (a norm before the gate): tree conv from the conv
        state, the conv state moved on by the new input, one chain step of the SSM state, then the
        norm, the gate and out_proj."""
        s = self.spec
        B = h.shape[0]
        _, z, xbc, dt = self._project(h)
        conv = pool.conv_layer(self.layer)
        conv_out = ops.tree_conv1d(
            xbc, self.conv_weight, self.conv_bias, conv, batch.parents, batch.cu_seqlens, batch.slot_idx,
            batch.cache_lens, batch.max_nodes,
        )
        # row b is the one step of sequence b (one node per tree: cu_seqlens[b] == b)
        ops.conv_state_commit(conv, batch.slot_idx, xbc, batch.cu_seqlens[:-1, None], torch.ones_like(batch.slot_idx),
                              batch.cache_lens)
        x, Bm, Cm = s.split_conv(conv_out)
        y = ops.ssm_chain_update(
            pool.ssm_layer(self.layer), batch.slot_idx, x[:, None], dt[:, None], self.A, Bm[:, None],
            Cm[:, None], self.D, self.dt_bias, s.dt_limit,
        ).reshape(B, s.d_inner)
        return self._finish(y, z)

    def verify(self, h: torch.Tensor, batch: Packed, pool: StatePool, stash) -> torch.Tensor | RowScaled:
        """h (T, d_model) packed tree nodes -> (T, d_model), or RowScaled((T, d_model), SumOfSquares) when
        the gated norm's scale is deferred (as in `decode`); state untouched, commit data stashed."""
        s = self.spec
        # the conv also keeps what a commit needs: xBC | dt as they came (adjacent in_proj columns),
        # and writes its output into the stash, where the scan below and a later commit read it
        raw, conv_out = stash.mamba_rows(self.layer, h.shape[0])
        conv = (self.conv_weight, self.conv_bias, pool.conv_layer(self.layer), batch.parents, batch.cu_seqlens,
                batch.slot_idx, batch.cache_lens, batch.max_nodes)
        if ops.runs_triton(h.device) and proj_conv.fits(h.shape[0]) and h.dtype == self.in_proj.weight.dtype:
            # a small tree: the conv in in_proj's epilogue, one launch (kernels/proj_conv.py)
            zxbcdt, _ = ops.project_tree_conv(h, self.in_proj.weight, self.in_proj.bias, s.d_inner, *conv, stash=raw,
                                              conv_out=conv_out)
            _, z, _, dt = self._columns(zxbcdt)
        else:
            zxbcdt, z, _, dt = self._project(h)
            ops.tree_conv1d(zxbcdt[:, s.d_inner:], *conv, out=conv_out, stash=raw)
        x, B, C = s.split_conv(conv_out)
        scan = (
            x, dt, self.A, B, C, self.D, self.dt_bias, pool.ssm_layer(self.layer),
            batch.parents, batch.cu_seqlens, batch.slot_idx, batch.max_nodes, s.dt_limit,
        )
        ancestors = batch.ancestors()  # built once per forward, shared by every Mamba layer
        if self.defers_norm:  # the gated norm, less its scale, in the scan's own epilogue
            u, sums = ops.tree_ssd_scan_deferred_norm(
                *scan, z.unflatten(-1, (s.n_heads, s.head_dim)), self.norm_weight, s.norm_eps, ancestors=ancestors,
            )
            return RowScaled(self.out_proj(u), sums)
        return self._finish(ops.tree_ssd_scan(*scan, ancestors=ancestors), z)
