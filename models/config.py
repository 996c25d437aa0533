"""The normalised model description every architecture is mapped onto.

A hybrid model is a token embedding, a list of pre-norm residual *blocks* and a final norm plus LM
head. Each block is `h = h + mixer(rmsnorm(h))` with one of four mixers: a Mamba2 mixer, an
attention mixer, a dense MLP or a mixture of experts. Architectures whose decoder layer holds two
sublayers (Bamba: mixer then MLP) become two blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class MambaSpec:
    """A Mamba2 mixer. `norm_group_size` is the span of the gated RMSNorm (d_inner when ungrouped)."""

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
    kind: str = field(default="mamba", init=False)

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


MixerSpec = Union[MambaSpec, AttentionSpec, MLPSpec, MoESpec]


@dataclass(frozen=True)
class HybridConfig:
    """Architecture-independent description of a loaded checkpoint.

    Block outputs are scaled by `residual_multiplier` before the residual add, embeddings by
    `embedding_multiplier`, and logits divided by `logits_scaling` (GraniteMoeHybrid; 1 elsewhere).
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

    @property
    def kinds(self) -> list[str]:
        """Mixer kind of every block: "mamba", "attention", "mlp" or "moe"."""
        return [b.kind for b in self.blocks]

    def block_indices(self, kind: str) -> list[int]:
        return [i for i, b in enumerate(self.blocks) if b.kind == kind]

    @property
    def mamba_specs(self) -> list[MambaSpec]:
        return [b for b in self.blocks if isinstance(b, MambaSpec)]

    @property
    def attention_specs(self) -> list[AttentionSpec]:
        return [b for b in self.blocks if isinstance(b, AttentionSpec)]

    def describe(self) -> str:
        """One line per distinct run of blocks, for logs."""
        counts: dict[str, int] = {}
        for k in self.kinds:
            counts[k] = counts.get(k, 0) + 1
        parts = ", ".join(f"{n} {k}" for k, n in counts.items())
        return f"{self.model_type}: d_model {self.d_model}, vocab {self.vocab_size}, blocks: {parts}"
