"""Mamba2 (`model_type: mamba2`): a stack of pre-norm Mamba2 blocks, as transformers defines it.

Details that matter for exact outputs: the gated RMSNorm spans the whole d_inner (transformers
ignores `n_groups` there), the residual stream is fp32 when `residual_in_fp32`, and published
checkpoints may name the embedding `backbone.embedding`.
"""
from __future__ import annotations

from models.arch import common
from models.config import HybridConfig, MambaSpec
from models.errors import CheckpointError

MODEL_TYPES = ("mamba2",)


def normalise(hf, path: str) -> HybridConfig:
    d_inner = int(hf.expand * hf.hidden_size)
    if d_inner != hf.num_heads * hf.head_dim:
        raise CheckpointError(
            f"expand * hidden_size ({d_inner}) != num_heads * head_dim ({hf.num_heads * hf.head_dim})", path=path
        )
    common.require_silu(hf.hidden_act, "Mamba2 conv", path)
    spec = MambaSpec(
        n_heads=hf.num_heads,
        head_dim=hf.head_dim,
        d_state=hf.state_size,
        n_groups=hf.n_groups,
        d_conv=hf.conv_kernel,
        conv_bias=bool(hf.use_conv_bias),
        proj_bias=bool(hf.use_bias),
        norm_group_size=d_inner,
        norm_eps=hf.layer_norm_epsilon,
        dt_limit=tuple(float(v) for v in hf.time_step_limit),
        chunk_size=hf.chunk_size,
    )
    return common.hybrid_config(
        hf, "mamba2", (spec,) * hf.num_hidden_layers, hf.layer_norm_epsilon,
        residual_in_fp32=bool(hf.residual_in_fp32),
    )


def checkpoint_key(key: str) -> str:
    return common.rename_prefixes(key, [("backbone.embedding.", "backbone.embeddings.")])


def weight_map(cfg: HybridConfig, available) -> common.WeightMap:
    out: common.WeightMap = {}
    for i, spec in enumerate(cfg.blocks):
        out[f"blocks.{i}.norm.weight"] = common.Source.one(f"backbone.layers.{i}.norm.weight", (cfg.d_model,))
        common.mamba_mixer(out, f"blocks.{i}.mixer", f"backbone.layers.{i}.mixer", spec, cfg.d_model)
    lm_head = None if cfg.tie_embeddings else "lm_head.weight"
    common.embeddings(out, "backbone.embeddings.weight", "backbone.norm_f.weight", lm_head, cfg.vocab_size, cfg.d_model)
    return out
