"""NemotronH (`model_type: nemotron_h`): pre-norm residual blocks, each a Mamba2 mixer, attention,
an MLP or a mixture of experts, by the config's `layers_block_type` (or legacy pattern string).

As transformers defines it: attention has no position encoding and no biases; MLPs are non-gated
(`relu2` by default); the gated RMSNorm works by groups of d_inner / n_groups; Mamba2 layers clamp
dt to `(time_step_min, inf)`; the LM head is never tied. Published checkpoints use the `backbone.`
prefix and one tensor per expert, transformers' own saves `model.` and merged experts.
"""
from __future__ import annotations

from models.arch import common
from models.config import AttentionSpec, HybridConfig, MambaSpec, MLPSpec, MoESpec
from models.errors import CheckpointError

MODEL_TYPES = ("nemotron_h",)


def _mamba(hf, path: str) -> MambaSpec:
    common.require_silu(hf.mamba_hidden_act, "Mamba2 conv", path)
    d_inner = hf.mamba_num_heads * hf.mamba_head_dim
    if d_inner % hf.n_groups:
        raise CheckpointError(f"n_groups {hf.n_groups} does not divide d_inner {d_inner}", path=path)
    return MambaSpec(
        n_heads=hf.mamba_num_heads,
        head_dim=hf.mamba_head_dim,
        d_state=hf.ssm_state_size,
        n_groups=hf.n_groups,
        d_conv=hf.conv_kernel,
        conv_bias=bool(hf.use_conv_bias),
        proj_bias=bool(hf.use_bias),
        norm_group_size=d_inner // hf.n_groups,
        norm_eps=hf.layer_norm_epsilon,
        dt_limit=(float(hf.time_step_min), float("inf")),
        chunk_size=hf.chunk_size,
    )


def _attention(hf) -> AttentionSpec:
    return common.attention_spec(hf, bias=False)


def _moe(hf) -> MoESpec:
    return MoESpec(
        n_experts=hf.n_routed_experts,
        top_k=hf.num_experts_per_tok,
        expert_intermediate=hf.moe_intermediate_size,
        shared_intermediate=hf.moe_shared_expert_intermediate_size,
        act=hf.mlp_hidden_act,
        bias=bool(hf.mlp_bias),
        n_group=hf.n_group,
        topk_group=hf.topk_group,
        norm_topk_prob=bool(hf.norm_topk_prob),
        routed_scaling=float(hf.routed_scaling_factor),
        latent_size=hf.moe_latent_size,
    )


def normalise(hf, path: str) -> HybridConfig:
    blocks = []
    for i, kind in enumerate(hf.layers_block_type):
        if kind == "linear_attention":
            blocks.append(_mamba(hf, path))
        elif kind == "full_attention":
            blocks.append(_attention(hf))
        elif kind == "mlp":
            blocks.append(MLPSpec(hf.intermediate_size, hf.mlp_hidden_act, gated=False, bias=bool(hf.mlp_bias)))
        elif kind == "moe":
            blocks.append(_moe(hf))
        else:
            raise CheckpointError(f"layer {i} has unsupported block type {kind!r}", path=path)
    return common.hybrid_config(hf, "nemotron_h", blocks, hf.layer_norm_epsilon, tie_embeddings=False)


def checkpoint_key(key: str) -> str:
    return common.rename_prefixes(key, [("backbone.", "model.")])


def weight_map(cfg: HybridConfig, available) -> common.WeightMap:
    out: common.WeightMap = {}
    for i, spec in enumerate(cfg.blocks):
        ckpt = f"model.layers.{i}"
        out[f"blocks.{i}.norm.weight"] = common.Source.one(f"{ckpt}.norm.weight", (cfg.d_model,))
        target = f"blocks.{i}.mixer"
        if isinstance(spec, MambaSpec):
            common.mamba_mixer(out, target, f"{ckpt}.mixer", spec, cfg.d_model)
        elif isinstance(spec, AttentionSpec):
            common.attention(out, target, f"{ckpt}.mixer", spec, cfg.d_model)
        elif isinstance(spec, MLPSpec):
            common.mlp(out, target, f"{ckpt}.mixer", spec, cfg.d_model)
        else:
            common.moe(out, target, f"{ckpt}.mixer", spec, cfg.d_model, available)
    common.embeddings(out, "model.embeddings.weight", "model.norm_f.weight", "lm_head.weight", cfg.vocab_size, cfg.d_model)
    return out
