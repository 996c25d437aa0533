"""Named model sizes and their training settings.

Targets are NemotronH hybrids (``layers``: ``M`` Mamba2, ``*`` attention, ``-`` MLP, one block per
character); drafters are plain Mamba2. Every preset takes its vocabulary size from the tokenizer,
so a target and its drafter always share one vocabulary. All head dims and state sizes are powers
of two, ``n_groups`` divides the head count, and word embeddings are untied (each checkpoint stores
``lm_head.weight`` explicitly).

| preset | params (vocab 4096) | use |
|---|---|---|
| tiny-target / tiny-drafter | ~0.15 M / ~0.12 M (vocab 512) | CPU tests, seconds |
| demo-target / demo-drafter | ~4.9 M / ~1.4 M | embedded default pair, ≤ 16 MiB together in fp16 |
| medium-target / medium-drafter | ~132 M / ~8.8 M | GPU benchmark |
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

EOT_ID = 0  # the tokenizer's only special token


@dataclass(frozen=True)
class TrainSettings:
    seq_len: int = 512
    batch_size: int = 32  # sequences per optimiser step
    micro_batch: int = 0  # sequences per forward/backward; 0 = whole batch
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    val_tokens: int = 256 * 1024  # evaluated at the end, fixed windows of the held-out split


@dataclass(frozen=True)
class Preset:
    name: str
    kind: str  # "target" (NemotronH) or "drafter" (Mamba2)
    arch: dict = field(default_factory=dict)
    train: TrainSettings = TrainSettings()

    def build_config(self, vocab_size: int):
        """A transformers config for this preset with the given vocabulary size."""
        if self.kind == "target":
            return _nemotron_h_config(vocab_size, **self.arch)
        return _mamba2_config(vocab_size, **self.arch)


_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp"}


def _nemotron_h_config(vocab_size: int, *, layers: str, d_model: int, mamba_heads: int, mamba_headdim: int,
                       d_state: int, n_groups: int, attn_heads: int, kv_heads: int, attn_headdim: int,
                       mlp_dim: int, chunk_size: int, max_len: int = 4096):
    from transformers import NemotronHConfig

    if set(layers) - set(_PATTERN):
        raise ValueError(f"layer pattern {layers!r}: use M (Mamba2), * (attention), - (MLP)")
    return NemotronHConfig(
        vocab_size=vocab_size,
        hidden_size=d_model,
        hybrid_override_pattern=layers,
        mamba_num_heads=mamba_heads,
        mamba_head_dim=mamba_headdim,
        ssm_state_size=d_state,
        n_groups=n_groups,
        conv_kernel=4,
        expand=mamba_heads * mamba_headdim // d_model,
        chunk_size=chunk_size,
        num_attention_heads=attn_heads,
        num_key_value_heads=kv_heads,
        head_dim=attn_headdim,
        intermediate_size=mlp_dim,
        mlp_hidden_act="relu2",
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        use_mamba_kernels=False,
        initializer_range=0.02,
        pad_token_id=EOT_ID,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
    )


def _mamba2_config(vocab_size: int, *, layers: int, d_model: int, heads: int, headdim: int, d_state: int,
                   n_groups: int, chunk_size: int):
    from transformers import Mamba2Config

    if heads * headdim != 2 * d_model:
        raise ValueError("Mamba2 drafter presets use expand=2: heads * headdim must be 2 * d_model")
    return Mamba2Config(
        vocab_size=vocab_size,
        hidden_size=d_model,
        num_hidden_layers=layers,
        num_heads=heads,
        head_dim=headdim,
        state_size=d_state,
        n_groups=n_groups,
        expand=2,
        conv_kernel=4,
        chunk_size=chunk_size,
        tie_word_embeddings=False,
        initializer_range=0.02,
        residual_in_fp32=True,
        pad_token_id=EOT_ID,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "tiny-target", "target",
            dict(layers="M*M-", d_model=64, mamba_heads=4, mamba_headdim=32, d_state=16, n_groups=2,
                 attn_heads=2, kv_heads=1, attn_headdim=32, mlp_dim=128, chunk_size=16),
            TrainSettings(seq_len=64, batch_size=8, lr=3e-3, warmup_steps=2, val_tokens=2048),
        ),
        Preset(
            "tiny-drafter", "drafter",
            dict(layers=2, d_model=64, heads=4, headdim=32, d_state=16, n_groups=1, chunk_size=16),
            TrainSettings(seq_len=64, batch_size=8, lr=3e-3, warmup_steps=2, val_tokens=2048),
        ),
        Preset(
            "demo-target", "target",
            dict(layers="M-M*M-M", d_model=256, mamba_heads=8, mamba_headdim=64, d_state=64, n_groups=2,
                 attn_heads=4, kv_heads=2, attn_headdim=64, mlp_dim=768, chunk_size=64),
            TrainSettings(seq_len=512, batch_size=64, lr=2e-3, warmup_steps=100),
        ),
        Preset(
            "demo-drafter", "drafter",
            dict(layers=3, d_model=128, heads=8, headdim=32, d_state=32, n_groups=1, chunk_size=64),
            TrainSettings(seq_len=512, batch_size=64, lr=3e-3, warmup_steps=100),
        ),
        Preset(
            "medium-target", "target",
            dict(layers="M-M-M*-M-M-M-M*-M-M-", d_model=1024, mamba_heads=32, mamba_headdim=64, d_state=128,
                 n_groups=4, attn_heads=8, kv_heads=2, attn_headdim=128, mlp_dim=2816, chunk_size=128),
            TrainSettings(seq_len=1024, batch_size=32, micro_batch=8, lr=1e-3, warmup_steps=200),
        ),
        Preset(
            "medium-drafter", "drafter",
            dict(layers=6, d_model=384, heads=12, headdim=64, d_state=64, n_groups=1, chunk_size=128),
            TrainSettings(seq_len=1024, batch_size=32, lr=2e-3, warmup_steps=200),
        ),
    ]
}


def get_preset(name: str, **train_overrides) -> Preset:
    """Look up a preset; keyword arguments replace fields of its ``TrainSettings`` (None = keep)."""
    try:
        preset = PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
    overrides = {k: v for k, v in train_overrides.items() if v is not None}
    return replace(preset, train=replace(preset.train, **overrides)) if overrides else preset
