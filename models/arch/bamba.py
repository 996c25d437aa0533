"""Bamba (`model_type: bamba`): each decoder layer is a Mamba2 mixer or a Llama attention (by
`attn_layer_indices`), then a SwiGLU MLP, each sublayer pre-norm residual, so two blocks per layer.

As transformers defines it: RoPE on the first half of each head (partial rotary 0.5), attention
and MLP biases by config, an ungrouped gated RMSNorm, one `rms_norm_eps` for every norm, and the
conv activation taken from `hidden_act`.
"""
from __future__ import annotations

from models.arch import common
from models.config import HybridConfig, MambaSpec, MLPSpec
from models.errors import CheckpointError

MODEL_TYPES = ("bamba",)


def _rope(hf, head_dim: int, path: str) -> tuple[int, float]:
    """(rotary_dim, rope_theta): Bamba rotates `partial_rotary_factor` of each head."""
    params = common.rope_parameters(hf, hf.model_type, path)
    factor = params.get("partial_rotary_factor", 1.0)
    return int(head_dim * factor), params["rope_theta"]


def mamba_spec(hf, path: str) -> MambaSpec:
    """The Mamba2 mixer of a config with Bamba's `mamba_*` fields (Bamba, GraniteMoeHybrid): the
    gated RMSNorm spans all of d_inner, as in transformers."""
    d_inner = int(hf.mamba_expand * hf.hidden_size)
    if d_inner != hf.mamba_n_heads * hf.mamba_d_head:
        raise CheckpointError(
            f"mamba_expand * hidden_size ({d_inner}) != mamba_n_heads * mamba_d_head "
            f"({hf.mamba_n_heads * hf.mamba_d_head})",
            path=path,
        )
    return MambaSpec(
        n_heads=hf.mamba_n_heads,
        head_dim=hf.mamba_d_head,
        d_state=hf.mamba_d_state,
        n_groups=hf.mamba_n_groups,
        d_conv=hf.mamba_d_conv,
        conv_bias=bool(hf.mamba_conv_bias),
        proj_bias=bool(hf.mamba_proj_bias),
        norm_group_size=d_inner,
        norm_eps=hf.rms_norm_eps,
        dt_limit=tuple(float(v) for v in (hf.time_step_limit or (0.0, float("inf")))),
        chunk_size=hf.mamba_chunk_size,
    )


def normalise(hf, path: str) -> HybridConfig:
    common.require_silu(hf.hidden_act, "Bamba", path)
    mamba = mamba_spec(hf, path)
    attn = common.attention_spec(hf, *_rope(hf, common.head_dim(hf), path))
    mlp = MLPSpec(hf.intermediate_size, hf.hidden_act, gated=True, bias=bool(hf.mlp_bias))
    blocks = []
    for kind in hf.layers_block_type:
        blocks += [mamba if kind == "linear_attention" else attn, mlp]
    return common.hybrid_config(hf, "bamba", blocks, hf.rms_norm_eps)


def checkpoint_key(key: str) -> str:
    return key


def weight_map(cfg: HybridConfig, available) -> common.WeightMap:
    out: common.WeightMap = {}
    for b, spec in enumerate(cfg.blocks):
        layer = f"model.layers.{b // 2}"
        target = f"blocks.{b}.mixer"
        if b % 2 == 0:
            out[f"blocks.{b}.norm.weight"] = common.Source.one(f"{layer}.input_layernorm.weight", (cfg.d_model,))
            if isinstance(spec, MambaSpec):
                common.mamba_mixer(out, target, f"{layer}.mamba", spec, cfg.d_model)
            else:
                common.attention(out, target, f"{layer}.self_attn", spec, cfg.d_model)
        else:
            out[f"blocks.{b}.norm.weight"] = common.Source.one(f"{layer}.pre_ff_layernorm.weight", (cfg.d_model,))
            common.mlp(out, target, f"{layer}.feed_forward", spec, cfg.d_model)
    lm_head = None if cfg.tie_embeddings else "lm_head.weight"
    common.embeddings(out, "model.embed_tokens.weight", "model.final_layernorm.weight", lm_head, cfg.vocab_size, cfg.d_model)
    return out
