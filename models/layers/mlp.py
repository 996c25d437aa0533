"""Dense MLP blocks (gated SwiGLU-style or plain up/act/down) and the NemotronH mixture of experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from kernels import ops
from models.config import MLPSpec, MoESpec
from models.layers.linear import Linear

SILU = ("silu", "swish")  # transformers' ACT2FN names of F.silu


def gated_activation(gate_up: torch.Tensor, act_name: str, act) -> torch.Tensor:
    """gate_up (T, 2I) = gate | up -> act(gate) * up (T, I). SiLU runs as one fused pass
    (kernels/silu_mul.py), rounded where torch rounds; other activations as torch composes them."""
    if act_name in SILU:
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


class MLP(nn.Module):
    """`down(act(gate(x)) * up(x))` with gate|up fused in one projection, or `down(act(up(x)))`."""

    def __init__(self, spec: MLPSpec, d_model: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.spec = spec
        I = spec.intermediate
        kw = dict(dtype=dtype, device=device)
        if spec.gated:
            self.gate_up_proj = Linear(d_model, 2 * I, bias=spec.bias, **kw)
        else:
            self.up_proj = Linear(d_model, I, bias=spec.bias, **kw)
        self.down_proj = Linear(I, d_model, bias=spec.bias, **kw)
        self.act = ACT2FN[spec.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, d_model) -> (T, d_model)."""
        if self.spec.gated:
            return self.down_proj(gated_activation(self.gate_up_proj(x), self.spec.act, self.act))
        return self.down_proj(self.act(self.up_proj(x)))


class MoE(nn.Module):
    """Routed experts plus a shared expert (see `MoESpec` for the two router flavours).

    Experts run as a loop over the experts that received tokens: exact but data-dependent, so
    models with MoE blocks run eagerly (no CUDA graphs).
    """

    def __init__(self, spec: MoESpec, d_model: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.spec = spec
        E, I = spec.n_experts, spec.expert_intermediate
        hin = spec.latent_size or d_model
        kw = dict(dtype=dtype, device=device)
        up_rows = 2 * I if spec.gated else I
        self.router_weight = nn.Parameter(torch.empty(E, d_model, dtype=torch.float32, device=device))
        if spec.router == "sigmoid_grouped":
            self.router_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32, device=device))
        self.experts_up = nn.Parameter(torch.empty(E, up_rows, hin, **kw))
        self.experts_down = nn.Parameter(torch.empty(E, hin, I, **kw))
        shared = MLPSpec(spec.shared_intermediate, spec.act, gated=spec.gated, bias=spec.bias)
        self.shared = MLP(shared, d_model, dtype, device)
        if spec.latent_size is not None:
            self.fc1_latent = nn.Linear(d_model, spec.latent_size, bias=spec.bias, **kw)
            self.fc2_latent = nn.Linear(spec.latent_size, d_model, bias=spec.bias, **kw)
        self.act = ACT2FN[spec.act]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, d) -> top-k expert indices (T, k) and weights (T, k) fp32."""
        s = self.spec
        logits = F.linear(x.float(), self.router_weight.float())
        if s.router == "softmax_topk":
            top, idx = logits.topk(s.top_k, dim=-1)
            return idx, torch.softmax(top, dim=-1)
        scores = logits.sigmoid()
        choice = scores + self.router_bias
        T = x.shape[0]
        per_group = s.n_experts // s.n_group
        group_scores = choice.view(T, s.n_group, per_group).topk(2, dim=-1)[0].sum(-1)
        groups = torch.topk(group_scores, k=s.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0)
        expert_mask = group_mask[:, :, None].expand(T, s.n_group, per_group).reshape(T, s.n_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        idx = torch.topk(choice, k=s.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if s.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * s.routed_scaling

    def _expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        up = F.linear(h, self.experts_up[e])
        if self.spec.gated:
            return F.linear(gated_activation(up, self.spec.act, self.act), self.experts_down[e])
        return F.linear(self.act(up), self.experts_down[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = self.route(x)
        h = self.fc1_latent(x) if self.spec.latent_size is not None else x
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        for e in torch.unique(idx).tolist():
            tok, k = torch.where(idx == e)
            out.index_add_(0, tok, self._expert(e, h[tok]).float() * w[tok, k, None])
        out = out.to(h.dtype)
        if self.spec.latent_size is not None:
            out = self.fc2_latent(out)
        return out + self.shared(x)
