"""GraniteMoeHybrid (`model_type: granitemoehybrid`, Granite 4.0 hybrid): each decoder layer is a
Mamba2 mixer or an attention (by `layer_types`), then a mixture of experts plus a shared gated MLP
(just the shared MLP when `num_local_experts` is 0): two blocks per layer.

As transformers defines it: embeddings times `embedding_multiplier`, every sublayer output times
`residual_multiplier` before the residual add, attention scale `attention_multiplier`, logits
divided by `logits_scaling`, RoPE only when `position_embedding_type == "rope"`, softmax over the
top-k router logits, an ungrouped gated RMSNorm and the conv activation from `hidden_act`. Its RoPE
rotates the whole head: transformers' Granite never reads `partial_rotary_factor`, which a config
may still carry.
Published checkpoints name the experts `input_linear` / `output_linear` and the router `router.layer`.
"""
from __future__ import annotations

from models.arch import common
from models.arch.bamba import mamba_spec
from models.config import HybridConfig, MambaSpec, MLPSpec, MoESpec

MODEL_TYPES = ("granitemoehybrid",)


def normalise(hf, path: str) -> HybridConfig:
    common.require_silu(hf.hidden_act, "GraniteMoeHybrid", path)
    mamba = mamba_spec(hf, path)
    if hf.position_embedding_type == "rope":
        rotary_dim, theta = common.head_dim(hf), common.rope_parameters(hf, "GraniteMoeHybrid", path)["rope_theta"]
    else:
        rotary_dim, theta = 0, 10000.0
    attn = common.attention_spec(hf, rotary_dim, theta, scale=float(hf.attention_multiplier))
    if hf.num_local_experts > 0:
        ffn = MoESpec(
            n_experts=hf.num_local_experts,
            top_k=hf.num_experts_per_tok,
            expert_intermediate=hf.intermediate_size,
            shared_intermediate=hf.shared_intermediate_size,
            act=hf.hidden_act,
            bias=False,
            router="softmax_topk",
        )
    else:
        ffn = MLPSpec(hf.shared_intermediate_size, hf.hidden_act, gated=True, bias=False)
    blocks = []
    for kind in hf.layers_block_type:
        blocks += [mamba if kind == "linear_attention" else attn, ffn]
    return common.hybrid_config(
        hf, "granitemoehybrid", blocks, hf.rms_norm_eps,
        embedding_multiplier=float(hf.embedding_multiplier),
        residual_multiplier=float(hf.residual_multiplier),
        logits_scaling=float(hf.logits_scaling),
    )


_PUBLISHED = (
    (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
    (".block_sparse_moe.router.layer.weight", ".block_sparse_moe.router.weight"),
)


def checkpoint_key(key: str) -> str:
    for old, new in _PUBLISHED:
        if key.endswith(old):
            return key[: -len(old)] + new
    return key


def weight_map(cfg: HybridConfig, available) -> common.WeightMap:
    out: common.WeightMap = {}
    d = cfg.d_model
    for b, spec in enumerate(cfg.blocks):
        layer = f"model.layers.{b // 2}"
        target = f"blocks.{b}.mixer"
        if b % 2 == 0:
            out[f"blocks.{b}.norm.weight"] = common.Source.one(f"{layer}.input_layernorm.weight", (d,))
            if isinstance(spec, MambaSpec):
                common.mamba_mixer(out, target, f"{layer}.mamba", spec, d)
            else:
                common.attention(out, target, f"{layer}.self_attn", spec, d)
            continue
        out[f"blocks.{b}.norm.weight"] = common.Source.one(f"{layer}.post_attention_layernorm.weight", (d,))
        shared = f"{target}.shared" if isinstance(spec, MoESpec) else target
        S = spec.shared_intermediate if isinstance(spec, MoESpec) else spec.intermediate
        common.linear(out, f"{shared}.gate_up_proj", f"{layer}.shared_mlp.input_linear", 2 * S, d, False)
        common.linear(out, f"{shared}.down_proj", f"{layer}.shared_mlp.output_linear", d, S, False)
        if isinstance(spec, MoESpec):
            E, I = spec.n_experts, spec.expert_intermediate
            moe = f"{layer}.block_sparse_moe"
            out[f"{target}.router_weight"] = common.Source.one(f"{moe}.router.weight", (E, d))
            out[f"{target}.experts_up"] = common.Source.one(f"{moe}.experts.gate_up_proj", (E, 2 * I, d))
            out[f"{target}.experts_down"] = common.Source.one(f"{moe}.experts.down_proj", (E, d, I))
    lm_head = None if cfg.tie_embeddings else "lm_head.weight"
    common.embeddings(out, "model.embed_tokens.weight", "model.norm.weight", lm_head, cfg.vocab_size, d)
    return out
