"""The normalised model description every architecture is mapped onto.

A hybrid model is a token embedding, a list of pre-norm residual *blocks* and a final norm plus LM
head. Each block is `h = h + mixer(rmsnorm(h))` with one of five mixers: a Mamba2 mixer, an
attention mixer, a dense MLP, a mixture of experts, or a parallel mixer (a Mamba2 mixer and an
attention side by side on the same input, outputs summed: FalconH1). Architectures whose decoder
layer holds two sublayers (Bamba: mixer then MLP) become two blocks. One block kind bends the rule:
a shared-attention block (Zamba2) adds a transformer's output, computed from the residual stream and
the token embeddings, to its Mamba2 mixer's input before the norm (`SharedAttentionSpec`).

Stateful sublayers (every Mamba2 mixer and every attention, the halves of a parallel mixer and the
attention of a shared-attention block included) are numbered per kind in block order by
`HybridConfig.state_layers`: the index of a layer's state in the StatePool and its verify stash.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


GATE_NORMS = ("gated", "none", "norm_before_gate")


@dataclass(frozen=True)
class MambaSpec:
    """A Mamba2 mixer. `norm_group_size` is the span of the gated RMSNorm (d_inner when ungrouped).

    `gate_norm` says how the scan output y meets the gate z before out_proj:
    - "gated": w * rmsnorm(y * silu(z)) by groups (Mamba2, NemotronH, Bamba, Granite);
    - "none": y * silu(z), no norm and no norm weight (FalconH1 with `mamba_rms_norm` false);
    - "norm_before_gate": w * rmsnorm(y) * silu(z) by groups (FalconH1 `mamba_norm_before_gate`).
    `proj_bias` is in_proj's bias, and out_proj's unless `out_bias` says otherwise (FalconH1 has a
    flag for each).
    """

    n_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    d_conv: int
    conv_bias: bool
    proj_bias: bool
    norm_group_size: int
    norm_eps: float
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    chunk_size: int = 256
    gate_norm: str = "gated"
    out_bias: bool | None = None
    kind: str = field(default="mamba", init=False)

    def __post_init__(self):
        if self.gate_norm not in GATE_NORMS:
            raise ValueError(f"gate_norm {self.gate_norm!r} is not one of {GATE_NORMS}")

    @property
    def out_proj_bias(self) -> bool:
        return self.proj_bias if self.out_bias is None else self.out_bias

    @property
    def has_norm(self) -> bool:
        return self.gate_norm != "none"

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the conv: x, B and C."""
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def in_proj_dim(self) -> int:
        """Rows of the input projection, in order z | xBC | dt."""
        return self.d_inner + self.conv_dim + self.n_heads

    def split_conv(self, xbc):
        """Conv output (..., conv_dim) -> views x (..., H, P), B (..., G, N), C (..., G, N)."""
        gn = self.n_groups * self.d_state
        x, B, C = xbc.split([self.d_inner, gn, gn], dim=-1)
        groups = (self.n_groups, self.d_state)
        return x.unflatten(-1, (self.n_heads, self.head_dim)), B.unflatten(-1, groups), C.unflatten(-1, groups)


@dataclass(frozen=True)
class AttentionSpec:
    """Grouped-query attention; `rotary_dim` 0 means no position encoding (NemotronH)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    qkv_bias: bool
    out_bias: bool
    rotary_dim: int = 0
    rope_theta: float = 10000.0
    scale: float | None = None
    kind: str = field(default="attention", init=False)

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim**-0.5


@dataclass(frozen=True)
class MLPSpec:
    """`down(act(gate(x)) * up(x))` when gated, else `down(act(up(x)))`."""

    intermediate: int
    act: str
    gated: bool
    bias: bool
    kind: str = field(default="mlp", init=False)


@dataclass(frozen=True)
class MoESpec:
    """Routed experts plus one shared MLP expert, two flavours by `router`:

    - "sigmoid_grouped" (NemotronH): sigmoid scores, a correction bias used only for choosing,
      group-limited top-k, optional renormalisation and scaling; non-gated experts, optionally in
      a latent space; non-gated shared expert.
    - "softmax_topk" (GraniteMoeHybrid): softmax over the top-k router logits; gated experts and
      a gated shared expert.
    """

    n_experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int
    act: str
    bias: bool
    router: str = "sigmoid_grouped"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling: float = 1.0
    latent_size: int | None = None
    kind: str = field(default="moe", init=False)

    @property
    def gated(self) -> bool:
        return self.router == "softmax_topk"


@dataclass(frozen=True)
class ParallelSpec:
    """A Mamba2 mixer and an attention applied to the same normed input, outputs summed (FalconH1's
    first sublayer). Each half keeps its own state like a block of its own."""

    mamba: MambaSpec
    attention: AttentionSpec
    kind: str = field(default="parallel", init=False)


@dataclass(frozen=True)
class SharedAttentionSpec:
    """A Mamba2 block whose mixer input also receives a transformer's output (Zamba2's hybrid layer).

    The transformer reads the residual stream h and the token embeddings e side by side, (T, 2 * d_model),
    and has no residual adds of its own; its output joins the mixer's input inside the block's norm,
    never the residual stream:

        t = proj(mlp(rmsnorm(attention(rmsnorm(h | e)))))      (T, d_model)
        h = h + mamba(rmsnorm(h + t))

    `attention` reads 2 * d_model features and writes d_model; `mlp` works at d_model; proj is
    d_model -> d_model without bias. The block's own norm is the one before the mixer. In the
    checkpoint the transformer's weights are shared between blocks (plus per-block low-rank adapters);
    here every block holds its own folded copy (models/arch/zamba2.py says why), and its own K/V.
    """

    mamba: MambaSpec
    attention: AttentionSpec
    mlp: MLPSpec
    kind: str = field(default="shared_attention", init=False)


MixerSpec = Union[MambaSpec, AttentionSpec, MLPSpec, MoESpec, ParallelSpec, SharedAttentionSpec]
StatefulSpec = Union[MambaSpec, AttentionSpec]


def stateful_sublayers(spec: MixerSpec) -> tuple[StatefulSpec, ...]:
    """The sublayers of a block that keep per-sequence state, in a fixed order."""
    if isinstance(spec, (MambaSpec, AttentionSpec)):
        return (spec,)
    if isinstance(spec, ParallelSpec):
        return (spec.mamba, spec.attention)
    if isinstance(spec, SharedAttentionSpec):
        return (spec.attention, spec.mamba)  # the order they run in
    return ()


@dataclass(frozen=True)
class HybridConfig:
    """Architecture-independent description of a loaded checkpoint.

    Block outputs are scaled by `residual_multiplier` before the residual add, embeddings by
    `embedding_multiplier`, and logits divided by `logits_scaling` (GraniteMoeHybrid; 1 elsewhere).
    `load_scales` holds an architecture's factors that its weight map folds into the weights at load
    time (FalconH1's multipliers), as (name, value) pairs; `load_layout` what else its weight map must
    know of how the checkpoint stores the weights (Zamba2's shared blocks and adapters), likewise as
    pairs. The forward never reads either.
    """

    model_type: str
    vocab_size: int
    d_model: int
    blocks: tuple[MixerSpec, ...]
    norm_eps: float
    final_norm_eps: float
    tie_embeddings: bool
    residual_in_fp32: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    load_scales: tuple[tuple[str, object], ...] = ()
    load_layout: tuple[tuple[str, object], ...] = ()

    @property
    def kinds(self) -> list[str]:
        """Mixer kind of every block: "mamba", "attention", "mlp", "moe", "parallel" or
        "shared_attention"."""
        return [b.kind for b in self.blocks]

    def block_indices(self, kind: str) -> list[int]:
        return [i for i, b in enumerate(self.blocks) if b.kind == kind]

    @property
    def state_layers(self) -> list[tuple[int, StatefulSpec, int]]:
        """(block, sublayer spec, state index) of every stateful sublayer. The one place that numbers
        them: Mamba2 mixers and attentions each count from 0 in block order (within a block, in
        `stateful_sublayers` order)."""
        counts = {"mamba": 0, "attention": 0}
        out = []
        for b, spec in enumerate(self.blocks):
            for sub in stateful_sublayers(spec):
                out.append((b, sub, counts[sub.kind]))
                counts[sub.kind] += 1
        return out

    @property
    def mamba_specs(self) -> list[MambaSpec]:
        """Every Mamba2 mixer (inside parallel and shared-attention blocks too), in state-index order."""
        return [sub for _, sub, _ in self.state_layers if isinstance(sub, MambaSpec)]

    @property
    def attention_specs(self) -> list[AttentionSpec]:
        """Every attention (inside parallel and shared-attention blocks too), in state-index order."""
        return [sub for _, sub, _ in self.state_layers if isinstance(sub, AttentionSpec)]

    def load_scale(self, name: str, default=1.0):
        return dict(self.load_scales).get(name, default)

    def layout(self, name: str, default=None):
        return dict(self.load_layout).get(name, default)

    def describe(self) -> str:
        """One line per distinct run of blocks, for logs."""
        counts: dict[str, int] = {}
        for k in self.kinds:
            counts[k] = counts.get(k, 0) + 1
        parts = ", ".join(f"{n} {k}" for k, n in counts.items())
        return f"{self.model_type}: d_model {self.d_model}, vocab {self.vocab_size}, blocks: {parts}"
