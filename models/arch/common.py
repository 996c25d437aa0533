"""Weight-name pieces shared by the architecture modules.

A *source* says which checkpoint tensors make up one runtime parameter: their names, the shape
each must have, and how they combine (concatenated along dim 0, e.g. q|k|v into one projection, or
stacked, e.g. per-expert matrices into one (E, ...) tensor). The loader checks every shape.

A source may also carry row scales (`scaled`): factors an architecture folds into the weights at
load (FalconH1's multipliers), applied in fp32 before the parameter takes the model dtype; and
low-rank adapters (`adapted`): per checkpoint tensor W, a product up @ down added to it in fp32 before
the cast (Zamba2's per-layer adapters of its shared transformer blocks).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable

from models.config import AttentionSpec, HybridConfig, MambaSpec, MLPSpec, MoESpec
from models.errors import CheckpointError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class LowRank:
    """A low-rank addend of one (rows, cols) checkpoint matrix: tensors `up` (rows, rank) and `down`
    (rank, cols), whose product is added to it."""

    up: str
    down: str
    rank: int

    def shapes(self, shape: Shape) -> tuple[Shape, Shape]:
        rows, cols = shape
        return (rows, self.rank), (self.rank, cols)


@dataclass(frozen=True)
class Source:
    """Checkpoint tensors `names` (each of the matching shape in `shapes`) combined into one parameter."""

    names: tuple[str, ...]
    shapes: tuple[Shape, ...]
    stack: bool = False  # stack along a new dim 0 instead of concatenating along dim 0
    # row scales: (rows, factor) segments covering dim 0 in order; empty for none
    scale: tuple[tuple[int, float], ...] = ()
    # low-rank addends, one per entry of `names` (None: that tensor as stored); empty for none
    adapters: tuple[LowRank | None, ...] = ()

    @staticmethod
    def one(name: str, shape: Shape) -> "Source":
        return Source((name,), (tuple(shape),))

    @property
    def rows(self) -> int:
        return len(self.shapes) if self.stack else sum(s[0] for s in self.shapes)

    def scaled(self, segments) -> "Source":
        """This source with its rows also multiplied by `segments` ((rows, factor), ... in order,
        covering all rows; a plain number scales every row); composes with scales already set."""
        if isinstance(segments, (int, float)):
            segments = ((self.rows, float(segments)),)
        segments = tuple((int(n), float(f)) for n, f in segments)
        if sum(n for n, _ in segments) != self.rows:
            raise ValueError(f"row scales cover {sum(n for n, _ in segments)} rows, the source has {self.rows}")
        if all(f == 1.0 for _, f in segments):
            return self
        if self.scale:
            segments = _multiply(self.scale, segments)
        return replace(self, scale=segments)

    def adapted(self, adapters) -> "Source":
        """This source with `adapters[i]` (a LowRank or None) added to tensor `names[i]`, in fp32."""
        adapters = tuple(adapters)
        if len(adapters) != len(self.names):
            raise ValueError(f"{len(adapters)} adapters for {len(self.names)} tensors")
        if self.stack and any(adapters):
            raise ValueError("adapters of stacked tensors are not supported")
        return replace(self, adapters=adapters if any(adapters) else ())

    def row_factors(self):
        """(rows,) fp32 factors, or None without scales."""
        import torch

        if not self.scale:
            return None
        return torch.cat([torch.full((n,), f, dtype=torch.float32) for n, f in self.scale])


def _multiply(a, b):
    """Product of two segment lists over the same rows."""
    out, i, j = [], 0, 0
    a, b = [list(x) for x in a], [list(x) for x in b]
    while i < len(a) and j < len(b):
        n = min(a[i][0], b[j][0])
        if n:
            out.append((n, a[i][1] * b[j][1]))
        a[i][0] -= n
        b[j][0] -= n
        if a[i][0] == 0:
            i += 1
        if b[j][0] == 0:
            j += 1
    return tuple(out)


WeightMap = dict[str, Source]


def head_dim(hf) -> int:
    """Attention head width: the config's `head_dim`, else hidden_size / num_attention_heads."""
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def attention_spec(hf, rotary_dim: int = 0, rope_theta: float = 10000.0, bias: bool | None = None,
                   scale: float | None = None) -> AttentionSpec:
    """AttentionSpec from transformers' usual fields (num_attention_heads, num_key_value_heads, head_dim);
    `bias` None reads `attention_bias` (on the qkv and output projections alike)."""
    bias = bool(hf.attention_bias) if bias is None else bias
    return AttentionSpec(hf.num_attention_heads, hf.num_key_value_heads, head_dim(hf), qkv_bias=bias, out_bias=bias,
                         rotary_dim=rotary_dim, rope_theta=rope_theta, scale=scale)


def require_silu(act: str, what: str, path: str) -> None:
    if act != "silu":
        raise CheckpointError(f"{what} activation {act!r} is not supported (only 'silu')", path=path)


def scale_linear(out: WeightMap, target: str, segments, bias: bool = True) -> None:
    """Fold row scales into projection `target`'s weight and, when it has one and `bias`, its bias
    (an output scale multiplies both; an input scale only the weight: pass bias=False)."""
    out[f"{target}.weight"] = out[f"{target}.weight"].scaled(segments)
    if bias and f"{target}.bias" in out:
        out[f"{target}.bias"] = out[f"{target}.bias"].scaled(segments)


def linear(out: WeightMap, target: str, name: str, rows: int, cols: int, bias: bool) -> None:
    out[f"{target}.weight"] = Source.one(f"{name}.weight", (rows, cols))
    if bias:
        out[f"{target}.bias"] = Source.one(f"{name}.bias", (rows,))


def fused_linear(out: WeightMap, target: str, parts: list[tuple[str, int]], cols: int, bias: bool) -> None:
    """One runtime projection from several checkpoint projections (`parts`: name, rows) stacked by rows."""
    out[f"{target}.weight"] = Source(
        tuple(f"{n}.weight" for n, _ in parts), tuple((r, cols) for _, r in parts)
    )
    if bias:
        out[f"{target}.bias"] = Source(tuple(f"{n}.bias" for n, _ in parts), tuple((r,) for _, r in parts))


def mamba_mixer(out: WeightMap, target: str, ckpt: str, spec: MambaSpec, d_model: int) -> None:
    """Hugging Face Mamba2 mixer naming (Mamba2, NemotronH, Bamba, FalconH1, ...)."""
    linear(out, f"{target}.in_proj", f"{ckpt}.in_proj", spec.in_proj_dim, d_model, spec.proj_bias)
    out[f"{target}.conv_weight"] = Source.one(f"{ckpt}.conv1d.weight", (spec.conv_dim, 1, spec.d_conv))
    if spec.conv_bias:
        out[f"{target}.conv_bias"] = Source.one(f"{ckpt}.conv1d.bias", (spec.conv_dim,))
    for p in ("dt_bias", "A_log", "D"):
        out[f"{target}.{p}"] = Source.one(f"{ckpt}.{p}", (spec.n_heads,))
    if spec.has_norm:
        out[f"{target}.norm_weight"] = Source.one(f"{ckpt}.norm.weight", (spec.d_inner,))
    linear(out, f"{target}.out_proj", f"{ckpt}.out_proj", d_model, spec.d_inner, spec.out_proj_bias)


def attention(out: WeightMap, target: str, ckpt: str, spec: AttentionSpec, d_model: int, d_in: int | None = None) -> None:
    """Llama-style q/k/v/o naming, fused into one qkv projection at load; q/k/v read `d_in` features
    (default d_model), o_proj writes d_model."""
    q, kv = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    parts = [(f"{ckpt}.q_proj", q), (f"{ckpt}.k_proj", kv), (f"{ckpt}.v_proj", kv)]
    fused_linear(out, f"{target}.qkv_proj", parts, d_in or d_model, spec.qkv_bias)
    linear(out, f"{target}.o_proj", f"{ckpt}.o_proj", d_model, q, spec.out_bias)


def mlp(out: WeightMap, target: str, ckpt: str, spec: MLPSpec, d_model: int) -> None:
    """gate/up/down naming; gate and up are fused into one projection (gate rows first)."""
    I = spec.intermediate
    if spec.gated:
        parts = [(f"{ckpt}.gate_proj", I), (f"{ckpt}.up_proj", I)]
        fused_linear(out, f"{target}.gate_up_proj", parts, d_model, spec.bias)
    else:
        linear(out, f"{target}.up_proj", f"{ckpt}.up_proj", I, d_model, spec.bias)
    linear(out, f"{target}.down_proj", f"{ckpt}.down_proj", d_model, I, spec.bias)


def moe(out: WeightMap, target: str, ckpt: str, spec: MoESpec, d_model: int, available: Callable[[str], bool]) -> None:
    """NemotronH MoE naming. Experts may be stored merged (`experts.up_proj (E, I, H)`, as
    transformers saves them) or one tensor per expert (`experts.{e}.up_proj.weight`, as published)."""
    E, I = spec.n_experts, spec.expert_intermediate
    hin = spec.latent_size or d_model
    out[f"{target}.router_weight"] = Source.one(f"{ckpt}.gate.weight", (E, d_model))
    out[f"{target}.router_bias"] = Source.one(f"{ckpt}.gate.e_score_correction_bias", (E,))
    for proj, shape in (("up_proj", (I, hin)), ("down_proj", (hin, I))):
        merged = f"{ckpt}.experts.{proj}"
        if available(merged):
            out[f"{target}.experts_{proj.split('_')[0]}"] = Source.one(merged, (E, *shape))
        else:
            names = tuple(f"{ckpt}.experts.{e}.{proj}.weight" for e in range(E))
            out[f"{target}.experts_{proj.split('_')[0]}"] = Source(names, (shape,) * E, stack=True)
    shared = MLPSpec(spec.shared_intermediate, spec.act, gated=False, bias=spec.bias)
    mlp(out, f"{target}.shared", f"{ckpt}.shared_experts", shared, d_model)
    if spec.latent_size is not None:
        linear(out, f"{target}.fc1_latent", f"{ckpt}.fc1_latent_proj", spec.latent_size, d_model, spec.bias)
        linear(out, f"{target}.fc2_latent", f"{ckpt}.fc2_latent_proj", d_model, spec.latent_size, spec.bias)


def embeddings(out: WeightMap, embed: str, norm_f: str, lm_head: str | None, vocab: int, d_model: int) -> None:
    out["embed.weight"] = Source.one(embed, (vocab, d_model))
    out["norm_f.weight"] = Source.one(norm_f, (d_model,))
    if lm_head is not None:
        out["lm_head.weight"] = Source.one(lm_head, (vocab, d_model))


def rename_prefixes(key: str, renames: Iterable[tuple[str, str]]) -> str:
    """Apply the first matching prefix rename (published checkpoints vs transformers' own names)."""
    for old, new in renames:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def hybrid_config(hf, model_type: str, blocks, norm_eps: float, **fields) -> HybridConfig:
    """A HybridConfig with what every architecture reads the same way off its transformers config
    (vocabulary, width, special token ids, tied embeddings), `norm_eps` for every norm, and the
    architecture's own `fields` (which take precedence)."""
    frame = dict(
        model_type=model_type,
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        blocks=tuple(blocks),
        norm_eps=norm_eps,
        final_norm_eps=norm_eps,
        tie_embeddings=bool(hf.tie_word_embeddings),
        bos_token_id=hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
        pad_token_id=hf.pad_token_id,
    )
    return HybridConfig(**{**frame, **fields})


def rope_parameters(hf, model: str, path: str) -> dict:
    """The config's RoPE parameters, refused (CheckpointError naming `model`) unless its RoPE is the
    plain ("default") one: no architecture here implements rope scaling."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(
            f"RoPE type {rope_type!r} (rope scaling) is not supported for {model} (only 'default')", path=path
        )
    params["rope_theta"] = float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    return params
