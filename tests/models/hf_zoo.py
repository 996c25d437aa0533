"""Tiny random transformers models of every supported architecture, and transformers-side references.

Weights are transformers' own random init, except where noted: dt biases are drawn so that
softplus(dt) stays well above NemotronH's and Zamba2's dt floor (transformers' decode path ignores
dt limits while its prefill path applies them, so with an active clamp its two paths disagree with
each other), and NemotronH router correction biases are made non-zero so routing depends on them.
FalconH1 models get random projection biases (transformers starts them at zero), so that multipliers
folded into the wrong bias, or left out of one, show; and small skip weights D and larger conv
weights, so that the SSM state carries much of each Mamba2 output (with D = 1 the skip term
dominates, and a wrong B or C scale would hardly show). Zamba2 models get random biases too (where
`add_bias_linear` gives them any), so that each one's mapping shows.
"""
from __future__ import annotations

import random
from typing import Sequence

import torch

VOCAB = 96
ARCHS = ("mamba2", "nemotron_h", "bamba", "granitemoehybrid", "falcon_h1", "zamba2")
# the FalconH1 variants: no gated norm (as published), a gated norm by groups (tied embeddings),
# and a norm before the gate
FALCON = ("falcon_h1", "falcon_h1_norm", "falcon_h1_norm_first")
# the Zamba2 variants, both with two shared blocks used in turn by three hybrid layers: attention
# adapters, RoPE, grouped gated norm, biases, tied embeddings, a Mamba2 layer first; and no attention
# adapters, no RoPE, grouped K/V, an ungrouped gated norm (decode defers its scale), SiLU MLP, untied
# embeddings, a hybrid layer first
ZAMBA = ("zamba2", "zamba2_plain")

_ZAMBA_BASE = dict(
    hidden_size=32, num_hidden_layers=5, num_attention_heads=4, intermediate_size=48, mamba_d_state=8,
    mamba_d_conv=4, mamba_expand=2, n_mamba_heads=4, chunk_size=8, num_mem_blocks=2, adapter_rank=4,
    use_mamba_kernels=False, initializer_range=0.1,
)

_FALCON_BASE = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
    mamba_n_heads=4, mamba_d_ssm=64, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8,
    initializer_range=0.1,
)


# per architecture: (transformers config class name, its keyword arguments)
_SPECS = {
    "mamba2": ("Mamba2Config", dict(
        hidden_size=32, num_hidden_layers=3, num_heads=4, head_dim=16, state_size=8, n_groups=2,
        conv_kernel=4, expand=2, chunk_size=8, initializer_range=0.1,
    )),
    "mamba2_tied": ("Mamba2Config", dict(
        hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=1,
        conv_kernel=4, expand=2, chunk_size=8, tie_word_embeddings=True, use_conv_bias=False,
        use_bias=True, residual_in_fp32=False,
    )),
    "nemotron_h": ("NemotronHConfig", dict(
        hidden_size=32,
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention", "moe"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, conv_kernel=4, expand=2,
        chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        use_mamba_kernels=False, initializer_range=0.1,
    )),
    "nemotron_h_dense": ("NemotronHConfig", dict(
        hidden_size=32, layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, conv_kernel=4, expand=2,
        chunk_size=8, use_mamba_kernels=False, initializer_range=0.1,
    )),
    "bamba": ("BambaConfig", dict(
        hidden_size=32, num_hidden_layers=4, attn_layer_indices=[1, 3], num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, attention_bias=True, initializer_range=0.1,
    )),
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(
        hidden_size=32, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=16, shared_intermediate_size=24,
        num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, position_embedding_type="rope",
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=1.5,
        initializer_range=0.1,
    )),
    "falcon_h1": ("FalconH1Config", dict(
        _FALCON_BASE, mamba_n_groups=1, mamba_rms_norm=False, mamba_proj_bias=True, projectors_bias=True,
        attention_bias=True, mlp_bias=True,
        embedding_multiplier=1.7, lm_head_multiplier=0.6, ssm_in_multiplier=0.8, ssm_out_multiplier=1.3,
        ssm_multipliers=[0.7, 1.2, 0.9, 1.4, 0.6], attention_in_multiplier=1.1, attention_out_multiplier=0.75,
        key_multiplier=1.6, mlp_multipliers=[1.3, 0.8],
    )),
    "falcon_h1_norm": ("FalconH1Config", dict(
        _FALCON_BASE, mamba_n_groups=2, mamba_rms_norm=True, mamba_norm_before_gate=False,
        mamba_proj_bias=False, projectors_bias=True, attention_bias=False, mlp_bias=True,
        tie_word_embeddings=True, embedding_multiplier=0.9, lm_head_multiplier=1.8, ssm_in_multiplier=1.2,
        ssm_out_multiplier=0.7, ssm_multipliers=[1.3, 0.8, 1.1, 0.6, 1.5], attention_in_multiplier=0.9,
        attention_out_multiplier=1.4, key_multiplier=0.7, mlp_multipliers=[0.8, 1.25],
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )),
    "falcon_h1_norm_first": ("FalconH1Config", dict(
        _FALCON_BASE, mamba_n_groups=2, mamba_rms_norm=True, mamba_norm_before_gate=True,
        mamba_proj_bias=True, projectors_bias=False, attention_bias=True, mlp_bias=False,
        embedding_multiplier=1.3, lm_head_multiplier=0.8, ssm_in_multiplier=0.9, ssm_out_multiplier=1.2,
        ssm_multipliers=[1.1, 0.9, 1.3, 0.7, 1.2], attention_in_multiplier=1.2, attention_out_multiplier=0.8,
        key_multiplier=1.3, mlp_multipliers=[1.2, 0.9],
    )),
    "zamba2": ("Zamba2Config", dict(
        _ZAMBA_BASE, layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"], num_key_value_heads=4,
        mamba_ngroups=2, use_shared_attention_adapter=True, use_mem_rope=True, add_bias_linear=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )),
    "zamba2_plain": ("Zamba2Config", dict(
        _ZAMBA_BASE, layers_block_type=["hybrid", "mamba", "hybrid", "mamba", "hybrid"], num_key_value_heads=2,
        mamba_ngroups=1, use_shared_attention_adapter=False, use_mem_rope=False, add_bias_linear=False,
        hidden_act="silu", tie_word_embeddings=False,
    )),
}


def _config(arch: str, **overrides):
    import transformers

    cls_name, kwargs = _SPECS[arch]
    kw = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=0, eos_token_id=None)
    kw.update(kwargs)
    kw.update(overrides)
    return getattr(transformers, cls_name)(**kw)


def make_model(arch: str, seed: int = 0, **overrides):
    """A transformers model (fp32, eval) with random weights; `overrides` change config fields."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-1.5, 0.5, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif arch in FALCON + ZAMBA and name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif arch in FALCON and name.endswith("mamba.D"):
                p.copy_(torch.empty(p.shape).uniform_(-0.3, 0.3, generator=gen))
            elif arch in FALCON and name.endswith("conv1d.weight"):
                p.copy_(0.4 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.no_grad()
def hf_logits(model, ids: Sequence[int]) -> torch.Tensor:
    """(len(ids), V) fp32 logits of a full forward without cache."""
    x = torch.tensor([list(ids)], dtype=torch.long)
    return model(x, use_cache=False).logits[0].float()


@torch.no_grad()
def hf_greedy(model, prompt: Sequence[int], n: int) -> list[int]:
    """transformers' own greedy `generate` (with its cache), the n new tokens."""
    x = torch.tensor([list(prompt)], dtype=torch.long)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def random_prompt(rng: random.Random, n: int, vocab: int = VOCAB) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]
