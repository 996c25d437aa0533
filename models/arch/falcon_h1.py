"""FalconH1 (`model_type: falcon_h1`): every decoder layer is a parallel block (one input RMSNorm,
then a Mamba2 mixer and a Llama attention on the same normed input, their outputs summed) and a
SwiGLU MLP block, each pre-norm residual: two blocks per layer, `ParallelSpec` then `MLPSpec`.

As transformers defines it (modeling_falcon_h1.py):
- in_proj's bias is `mamba_proj_bias`, out_proj's is `projectors_bias`; attention biases
  `attention_bias`, MLP biases `mlp_bias`; d_inner is `mamba_d_ssm` (or `mamba_expand * hidden_size`);
- without `mamba_rms_norm` (the published checkpoints) there is no gated norm: y * silu(z); with it a
  norm over `mamba_n_groups` groups, before the gate when `mamba_norm_before_gate`, after otherwise;
- full-width RoPE ("default" only; the default rope ignores `partial_rotary_factor`, as here);
- `hidden_act` is both the MLP's and the conv's activation (SiLU only).

Its muP multipliers are folded into the weights at load time, in fp32, so the forward pays nothing
for them (where transformers applies each one, and what it becomes here):
- embedding_multiplier (embeddings out) and lm_head_multiplier (logits): rows of the embedding and
  of the LM head. With tied embeddings one tensor serves both: it takes lm_head_multiplier, and the
  embedding is scaled at run time by embedding_multiplier / lm_head_multiplier;
- ssm_in_multiplier (the mixer's input): all of in_proj's weight (not its bias); ssm_multipliers
  (in_proj's output, per segment z | x | B | C | dt): in_proj's rows, weight and bias;
  ssm_out_multiplier (the mixer's output): out_proj, weight and bias;
- attention_in_multiplier (attention's input): q/k/v weights; key_multiplier (k_proj's output, before
  RoPE, which is linear): k rows, weight and bias; attention_out_multiplier (attention's output):
  o_proj, weight and bias;
- mlp_multipliers (gate_proj's output before the activation; down_proj's output): the gate rows of
  the fused gate|up projection, and down_proj, weight and bias.

`mamba_use_mlp` and `attn_layer_indices`, found in some published config files, are ignored, as
transformers ignores them (every layer has both halves and the MLP).
"""
from __future__ import annotations

from models.arch import common
from models.config import HybridConfig, MambaSpec, MLPSpec, ParallelSpec
from models.errors import CheckpointError

MODEL_TYPES = ("falcon_h1",)


def _num(value, default: float = 1.0) -> float:
    return default if value is None else float(value)


def _multipliers(hf, name: str, n: int, path: str) -> tuple[float, ...]:
    values = getattr(hf, name, None)
    values = [1.0] * n if values is None else list(values)
    if len(values) != n:
        raise CheckpointError(f"{name} has {len(values)} values, FalconH1 has {n}", path=path)
    return tuple(float(v) for v in values)


def _mamba(hf, path: str) -> MambaSpec:
    d_inner = int(hf.mamba_expand * hf.hidden_size) if hf.mamba_d_ssm is None else int(hf.mamba_d_ssm)
    H, P, G = int(hf.mamba_n_heads), int(hf.mamba_d_head), int(hf.mamba_n_groups)
    if H * P != d_inner:
        raise CheckpointError(
            f"mamba_n_heads * mamba_d_head ({H * P}) != the Mamba2 inner size "
            f"(mamba_d_ssm, or mamba_expand * hidden_size: {d_inner})",
            path=path,
        )
    if H % G or d_inner % G:
        raise CheckpointError(f"mamba_n_groups {G} does not divide mamba_n_heads {H}", path=path)
    if not hf.mamba_rms_norm:
        gate_norm = "none"
    else:
        gate_norm = "norm_before_gate" if hf.mamba_norm_before_gate else "gated"
    return MambaSpec(
        n_heads=H,
        head_dim=P,
        d_state=int(hf.mamba_d_state),
        n_groups=G,
        d_conv=int(hf.mamba_d_conv),
        conv_bias=bool(hf.mamba_conv_bias),
        proj_bias=bool(hf.mamba_proj_bias),
        out_bias=bool(hf.projectors_bias),
        norm_group_size=d_inner // G,
        norm_eps=float(hf.rms_norm_eps),
        dt_limit=tuple(float(v) for v in (hf.time_step_limit or (0.0, float("inf")))),
        chunk_size=int(hf.mamba_chunk_size),
        gate_norm=gate_norm,
    )


def normalise(hf, path: str) -> HybridConfig:
    common.require_silu(hf.hidden_act, "FalconH1", path)
    for i, kind in enumerate(hf.layers_block_type):
        if kind != "hybrid":
            raise CheckpointError(f"layer {i} has unsupported block type {kind!r} (FalconH1 layers are 'hybrid')", path=path)
    mamba = _mamba(hf, path)
    attn = common.attention_spec(hf, common.head_dim(hf), common.rope_parameters(hf, "FalconH1", path)["rope_theta"])
    mlp = MLPSpec(hf.intermediate_size, hf.hidden_act, gated=True, bias=bool(hf.mlp_bias))
    blocks = [ParallelSpec(mamba, attn), mlp] * hf.num_hidden_layers
    tied = bool(hf.tie_word_embeddings)
    emb, head = _num(hf.embedding_multiplier), _num(hf.lm_head_multiplier)
    if tied and head == 0.0:
        raise CheckpointError("lm_head_multiplier 0 with tied embeddings is not supported", path=path)
    scales = (
        ("embedding", 1.0 if tied else emb),
        ("lm_head", head),
        ("ssm_in", _num(hf.ssm_in_multiplier)),
        ("ssm_out", _num(hf.ssm_out_multiplier)),
        ("ssm_segments", _multipliers(hf, "ssm_multipliers", 5, path)),
        ("attention_in", _num(hf.attention_in_multiplier)),
        ("attention_out", _num(hf.attention_out_multiplier)),
        ("key", _num(hf.key_multiplier)),
        ("mlp", _multipliers(hf, "mlp_multipliers", 2, path)),
    )
    return common.hybrid_config(
        hf, "falcon_h1", blocks, hf.rms_norm_eps,
        tie_embeddings=tied,
        # tied: the shared tensor carries lm_head_multiplier, so the embedding is rescaled at run time
        embedding_multiplier=emb / head if tied else 1.0,
        load_scales=scales,
    )


def checkpoint_key(key: str) -> str:
    return key


def weight_map(cfg: HybridConfig, available) -> common.WeightMap:
    out: common.WeightMap = {}
    d = cfg.d_model
    k = cfg.load_scale
    for b, spec in enumerate(cfg.blocks):
        layer = f"model.layers.{b // 2}"
        target = f"blocks.{b}.mixer"
        if isinstance(spec, ParallelSpec):
            out[f"blocks.{b}.norm.weight"] = common.Source.one(f"{layer}.input_layernorm.weight", (d,))
            m, a = spec.mamba, spec.attention
            common.mamba_mixer(out, f"{target}.mamba", f"{layer}.mamba", m, d)
            common.scale_linear(out, f"{target}.mamba.in_proj", k("ssm_in"), bias=False)
            gn = m.n_groups * m.d_state
            sizes = (m.d_inner, m.d_inner, gn, gn, m.n_heads)  # z | x | B | C | dt
            common.scale_linear(out, f"{target}.mamba.in_proj", tuple(zip(sizes, k("ssm_segments"))))
            common.scale_linear(out, f"{target}.mamba.out_proj", k("ssm_out"))
            common.attention(out, f"{target}.attention", f"{layer}.self_attn", a, d)
            q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
            common.scale_linear(out, f"{target}.attention.qkv_proj", k("attention_in"), bias=False)
            common.scale_linear(out, f"{target}.attention.qkv_proj", ((q, 1.0), (kv, k("key")), (kv, 1.0)))
            common.scale_linear(out, f"{target}.attention.o_proj", k("attention_out"))
        else:
            out[f"blocks.{b}.norm.weight"] = common.Source.one(f"{layer}.pre_ff_layernorm.weight", (d,))
            common.mlp(out, target, f"{layer}.feed_forward", spec, d)
            gate, down = k("mlp")
            I = spec.intermediate
            common.scale_linear(out, f"{target}.gate_up_proj", ((I, gate), (I, 1.0)))
            common.scale_linear(out, f"{target}.down_proj", down)
    lm_head = None if cfg.tie_embeddings else "lm_head.weight"
    common.embeddings(out, "model.embed_tokens.weight", "model.final_layernorm.weight", lm_head, cfg.vocab_size, d)
    if cfg.tie_embeddings:
        out["embed.weight"] = out["embed.weight"].scaled(k("lm_head"))
    else:
        out["embed.weight"] = out["embed.weight"].scaled(k("embedding"))
        out["lm_head.weight"] = out["lm_head.weight"].scaled(k("lm_head"))
    return out
