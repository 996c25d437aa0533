"""Zamba2 (`model_type: zamba2`): Mamba2 layers, some of which ("hybrid" in `layers_block_type`) also
run a transformer over the residual stream and the token embeddings and add its output to their
Mamba2 input: one block per layer, `MambaSpec` or `SharedAttentionSpec`.

As transformers defines it (modeling_zamba2.py):
- every layer is a pre-norm residual Mamba2 block (`input_layernorm`, `rms_norm_eps`). A hybrid layer
  first runs shared transformer block number (k mod `num_mem_blocks`), k counting hybrid layers from
  0: RMSNorm over h | e (2 * hidden_size wide), attention, RMSNorm, gated MLP, no residual adds; then
  its own bias-free `linear`; the result is added to the Mamba2 input before its norm, not to the
  residual stream;
- the attention reads 2 * hidden_size features; its heads are `attention_head_dim` = 2 * hidden_size /
  num_attention_heads wide, its softmax scale (head_dim / 2) ** -0.5; no biases; RoPE over the whole
  head when `use_mem_rope` ("default" only);
- the MLP is `act(gate) * up` from one fused `gate_up_proj` (gate rows first), `hidden_act` (GELU by
  default), biases by `add_bias_linear`;
- low-rank adapters: per hybrid layer, one on the MLP's gate_up_proj (always) and, with
  `use_shared_attention_adapter`, one on each of q, k and v; each is linear(up) after linear(down),
  rank `adapter_rank`, no bias, reading the projection's own input. They live in the shared block's
  `*_adapter_list.{k}` entries;
- the Mamba2 mixer: in_proj / out_proj biases by `add_bias_linear`, a conv bias always (transformers
  ignores `use_conv_bias`), SiLU in the conv, a gated RMSNorm by `mamba_ngroups` groups with eps
  1e-5 (not `rms_norm_eps`), dt clamped below at `time_step_min` (`time_step_max` and
  `time_step_floor` only shape the initialisation; transformers' cached one-token step skips the
  clamp its full forward applies, every mode here applies it), `mamba_headdim` = mamba_expand *
  hidden_size / n_mamba_heads;
- tied embeddings by default; no embedding or logit multipliers.
`use_mem_eff_path` and `use_mamba_kernels` only choose transformers' kernels (same results);
`use_long_context` is refused: transformers warns that it rescales rope_theta for it but only
lengthens `max_position_embeddings`, so what such a checkpoint expects is unclear.

The shared blocks' weights are folded per hybrid layer at load (W + up @ down for every adapter, in
fp32, before the cast), and each hybrid layer becomes a block with its own dense copy. What that
costs and buys:
- memory: one transformer per hybrid layer instead of `num_mem_blocks` of them. At the 2.7B layout
  (transformers' default config: hidden 2560, 9 hybrid layers in 54) a block is about 170M
  parameters (q, k, v 5120 square, o, a 10240-wide MLP): with 2 shared blocks 2.65B parameters
  become 3.82B (+44%, +2.3 GB in bf16); with 1, 2.48B become 3.82B (+54%). The K/V cache
  is the same either way: a hybrid layer's attention sees its own input, so transformers keeps one
  cache per layer as well.
- speed: nothing lost. A decode step streams each hybrid layer's transformer weights from memory
  anyway (a shared block is far larger than any cache, so reusing it saves no reads), and it skips
  up to four adapter pairs (eight thin projections) per layer. The kernels, the state layout, verify,
  commit and CUDA graphs need nothing new.
"""
from __future__ import annotations

from models.arch import common
from models.config import AttentionSpec, HybridConfig, MambaSpec, MLPSpec, SharedAttentionSpec
from models.errors import CheckpointError

MODEL_TYPES = ("zamba2",)

MAMBA_NORM_EPS = 1e-5  # transformers fixes the gated norm's eps, whatever rms_norm_eps says
ADAPTED_ATTENTION = ("q", "k", "v")


def _mamba(hf, path: str) -> MambaSpec:
    d_inner = int(hf.mamba_expand * hf.hidden_size)
    H, G = int(hf.n_mamba_heads), int(hf.mamba_ngroups)
    if d_inner % H:
        raise CheckpointError(
            f"n_mamba_heads {H} does not divide the Mamba2 inner size (mamba_expand * hidden_size: {d_inner})",
            path=path,
        )
    if H % G:
        raise CheckpointError(f"mamba_ngroups {G} does not divide n_mamba_heads {H}", path=path)
    return MambaSpec(
        n_heads=H,
        head_dim=d_inner // H,
        d_state=int(hf.mamba_d_state),
        n_groups=G,
        d_conv=int(hf.mamba_d_conv),
        conv_bias=True,
        proj_bias=bool(hf.add_bias_linear),
        norm_group_size=d_inner // G,
        norm_eps=MAMBA_NORM_EPS,
        dt_limit=(float(hf.time_step_min), float("inf")),
        chunk_size=int(hf.chunk_size),
    )


def _attention(hf, path: str) -> AttentionSpec:
    width = 2 * hf.hidden_size  # the stream and the embeddings side by side
    heads, kv_heads = int(hf.num_attention_heads), int(hf.num_key_value_heads)
    if width % heads:
        raise CheckpointError(f"num_attention_heads {heads} does not divide 2 * hidden_size ({width})", path=path)
    if heads % kv_heads:
        raise CheckpointError(f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}", path=path)
    if hf.use_shared_attention_adapter and kv_heads != heads:
        # the k and v adapters write 2 * hidden_size columns, which only fit without grouped K/V
        raise CheckpointError(
            f"use_shared_attention_adapter with num_key_value_heads {kv_heads} != num_attention_heads {heads} "
            "is not supported (transformers cannot run it either)",
            path=path,
        )
    head_dim = width // heads
    rotary = head_dim if hf.use_mem_rope else 0
    theta = common.rope_parameters(hf, "Zamba2", path)["rope_theta"] if rotary else 10000.0
    return AttentionSpec(heads, kv_heads, head_dim, qkv_bias=False, out_bias=False, rotary_dim=rotary,
                         rope_theta=theta, scale=(head_dim / 2) ** -0.5)


def normalise(hf, path: str) -> HybridConfig:
    if hf.use_long_context:
        raise CheckpointError("use_long_context is not supported for Zamba2", path=path)
    if int(hf.num_mem_blocks) < 1:
        raise CheckpointError(f"num_mem_blocks {hf.num_mem_blocks} (Zamba2 needs at least 1)", path=path)
    mamba = _mamba(hf, path)
    shared = None
    blocks = []
    for i, kind in enumerate(hf.layers_block_type):
        if kind == "linear_attention":
            blocks.append(mamba)
        elif kind == "hybrid":
            if shared is None:
                mlp = MLPSpec(int(hf.intermediate_size), hf.hidden_act, gated=True, bias=bool(hf.add_bias_linear))
                shared = SharedAttentionSpec(mamba, _attention(hf, path), mlp)
            blocks.append(shared)
        else:
            raise CheckpointError(
                f"layer {i} has unsupported block type {kind!r} (Zamba2 layers are 'mamba' or 'hybrid')", path=path
            )
    adapted = ("gate_up",) + (ADAPTED_ATTENTION if hf.use_shared_attention_adapter else ())
    return common.hybrid_config(
        hf, "zamba2", blocks, hf.rms_norm_eps,
        load_layout=(
            ("mem_blocks", int(hf.num_mem_blocks)),
            ("adapter_rank", int(hf.adapter_rank)),
            ("adapted", adapted),
        ),
    )


def checkpoint_key(key: str) -> str:
    return key


def _transformer_sources(cfg: HybridConfig, available) -> list[str]:
    """Checkpoint prefix of each hybrid layer's transformer weights, in hybrid-layer order.

    With tied weights transformers saves each shared block once, under the first hybrid layer that
    uses it; an in-memory state dict repeats it under every user. With `tie_word_embeddings` false
    transformers 5.17 ties none of its weights, shared blocks included: every hybrid layer then has a
    block of its own, saved under its own name. So: a layer's own copy where the checkpoint has one,
    else the first copy of its shared block."""
    mem = cfg.layout("mem_blocks")
    users = [f"model.layers.{b}.shared_transformer" for b, s in enumerate(cfg.blocks) if isinstance(s, SharedAttentionSpec)]

    def held(prefix: str) -> bool:
        return available(f"{prefix}.self_attn.q_proj.weight")

    out = []
    for k, own in enumerate(users):
        sharing = users[k % mem :: mem]
        out.append(own if held(own) else next((u for u in sharing if held(u)), sharing[0]))
    return out


def _shared_transformer(out: common.WeightMap, target: str, holder: str, k: int, spec: SharedAttentionSpec,
                        cfg: HybridConfig) -> None:
    """Hybrid layer number k's transformer from the block stored under `holder`, adapters folded in."""
    d, a, m = cfg.d_model, spec.attention, spec.mlp
    rank, adapted = cfg.layout("adapter_rank"), cfg.layout("adapted")

    def adapter(lists: str, name: str):
        if name not in adapted:
            return None
        return common.LowRank(f"{holder}.{lists}.{k}.1.weight", f"{holder}.{lists}.{k}.0.weight", rank)

    out[f"{target}.input_norm_weight"] = common.Source.one(f"{holder}.input_layernorm.weight", (2 * d,))
    common.attention(out, f"{target}.attention", f"{holder}.self_attn", a, d, d_in=2 * d)
    qkv = f"{target}.attention.qkv_proj.weight"
    out[qkv] = out[qkv].adapted(adapter(f"self_attn.linear_{p}_adapter_list", p) for p in ADAPTED_ATTENTION)
    out[f"{target}.mlp_norm_weight"] = common.Source.one(f"{holder}.pre_ff_layernorm.weight", (d,))
    ff = f"{holder}.feed_forward"
    common.linear(out, f"{target}.mlp.gate_up_proj", f"{ff}.gate_up_proj", 2 * m.intermediate, d, m.bias)
    gate_up = f"{target}.mlp.gate_up_proj.weight"
    out[gate_up] = out[gate_up].adapted([adapter("feed_forward.gate_up_proj_adapter_list", "gate_up")])
    common.linear(out, f"{target}.mlp.down_proj", f"{ff}.down_proj", d, m.intermediate, m.bias)


def weight_map(cfg: HybridConfig, available) -> common.WeightMap:
    out: common.WeightMap = {}
    d = cfg.d_model
    sources = _transformer_sources(cfg, available)
    k = 0  # hybrid layers so far
    for b, spec in enumerate(cfg.blocks):
        layer = f"model.layers.{b}"
        target = f"blocks.{b}"
        if isinstance(spec, SharedAttentionSpec):
            mamba_layer = f"{layer}.mamba_decoder"
            _shared_transformer(out, f"{target}.shared", sources[k], k, spec, cfg)
            common.linear(out, f"{target}.shared.proj", f"{layer}.linear", d, d, False)
            k += 1
            spec = spec.mamba
        else:
            mamba_layer = layer
        out[f"{target}.norm.weight"] = common.Source.one(f"{mamba_layer}.input_layernorm.weight", (d,))
        common.mamba_mixer(out, f"{target}.mixer", f"{mamba_layer}.mamba", spec, d)
    lm_head = None if cfg.tie_embeddings else "lm_head.weight"
    common.embeddings(out, "model.embed_tokens.weight", "model.final_layernorm.weight", lm_head, cfg.vocab_size, d)
    return out
