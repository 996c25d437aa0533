"""Loading: normalised configs, tokenizer, published-name aliases, and clear errors for bad checkpoints."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import CheckpointError, HybridLM
from tests.checkpoints import make_tokenizer
from tests.models.hf_zoo import FALCON, ZAMBA, hf_logits, random_prompt


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _tensors(path):
    (f,) = list(path.glob("*.safetensors"))
    return f, load_file(str(f))


def test_normalised_layer_lists(saved):
    lm = HybridLM.from_pretrained(saved("nemotron_h")[0])
    assert lm.config.kinds == ["mamba", "attention", "mlp", "mamba", "moe"]
    m = lm.config.blocks[0]
    assert (m.norm_group_size, m.dt_limit[0]) == (m.d_inner // 2, 0.001)
    assert lm.config.blocks[1].rotary_dim == 0
    lm = HybridLM.from_pretrained(saved("bamba")[0])
    assert lm.config.kinds == ["mamba", "mlp", "attention", "mlp"] * 2
    attn = lm.config.blocks[2]
    assert attn.rotary_dim == attn.head_dim // 2 and attn.qkv_bias
    assert lm.config.blocks[0].norm_group_size == lm.config.blocks[0].d_inner
    lm = HybridLM.from_pretrained(saved("mamba2_tied")[0])
    assert lm.config.tie_embeddings and not hasattr(lm, "lm_head")
    assert lm.tokenizer is None


def test_tokenizer_is_loaded_when_present(saved, tmp_path):
    d = _copy(saved("mamba2")[0], tmp_path / "ckpt")
    make_tokenizer(d, vocab_size=300)
    lm = HybridLM.from_pretrained(d)
    assert lm.tokenizer is not None
    assert lm.tokenizer.decode(lm.tokenizer("def add")["input_ids"]) == "def add"


def _prefill_error(path, model, prompt) -> float:
    lm = HybridLM.from_pretrained(path)
    s = lm.pool.alloc()
    return (lm.prefill([s], [prompt])[0] - hf_logits(model, prompt)[-1]).abs().max().item()


@pytest.mark.parametrize("arch", ["nemotron_h", "granitemoehybrid", "bamba", "falcon_h1", "zamba2"])
def test_in_memory_names_load_the_same(saved, tmp_path, arch):
    """`save_pretrained` writes the published names (NemotronH `backbone.` and one tensor per
    expert, Granite `input_linear`/`output_linear`/`router.layer`, each Zamba2 shared block once); a
    checkpoint holding transformers' in-memory names (`model.`, merged experts, a Zamba2 shared block
    repeated under every layer that uses it) must load the same."""
    path, model = saved(arch)
    d = _copy(path, tmp_path / arch)
    f, published = _tensors(d)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if arch not in ("bamba", "falcon_h1"):
        assert set(state) != set(published)
    f.unlink()
    save_file(state, str(d / "model.safetensors"))
    assert _prefill_error(d, model, random_prompt(random.Random(0), 8)) < 1e-4


def test_mamba2_embedding_alias(saved, tmp_path):
    path, model = saved("mamba2")
    d = _copy(path, tmp_path / "m2")
    f, state = _tensors(d)
    state = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in state.items()}
    assert "backbone.embedding.weight" in state
    save_file(state, str(f))
    assert _prefill_error(d, model, random_prompt(random.Random(0), 8)) < 1e-4


def test_granite_layout(saved):
    lm = HybridLM.from_pretrained(saved("granitemoehybrid")[0])
    assert lm.config.kinds == ["mamba", "moe", "attention", "moe"] * 2
    assert (lm.config.embedding_multiplier, lm.config.residual_multiplier, lm.config.logits_scaling) == (2.0, 0.5, 1.5)
    assert lm.config.blocks[2].softmax_scale == 0.2 and lm.config.blocks[2].rotary_dim == 8


def test_missing_tensor_is_named(saved, tmp_path):
    d = _copy(saved("bamba")[0], tmp_path / "ckpt")
    f, state = _tensors(d)
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(f))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        HybridLM.from_pretrained(d)


def test_wrong_shape_is_named(saved, tmp_path):
    d = _copy(saved("mamba2")[0], tmp_path / "ckpt")
    f, state = _tensors(d)
    name = "backbone.layers.0.mixer.A_log"
    state[name] = torch.zeros(state[name].numel() + 1)
    save_file(state, str(f))
    with pytest.raises(CheckpointError, match=r"shape \(5,\).*\(4,\).*model\.safetensors.*A_log") as e:
        HybridLM.from_pretrained(d)
    assert e.value.tensor == name and e.value.path.endswith("model.safetensors")


def test_unsupported_model_type(saved, tmp_path):
    d = _copy(saved("mamba2")[0], tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"unsupported model_type 'llama'.*bamba, falcon_h1, granitemoehybrid, mamba2, nemotron_h, zamba2.*config\.json"):
        HybridLM.from_pretrained(d)


def test_directory_without_config_or_weights(saved, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        HybridLM.from_pretrained(tmp_path)
    d = _copy(saved("mamba2")[0], tmp_path / "ckpt")
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        HybridLM.from_pretrained(d)


def test_unsupported_activation(saved, tmp_path):
    d = _copy(saved("nemotron_h")[0], tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["mamba_hidden_act"] = "gelu"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="activation 'gelu'"):
        HybridLM.from_pretrained(d)


@pytest.mark.parametrize("arch", ["bamba", "nemotron_h", "falcon_h1", "falcon_h1_norm", "zamba2"])
def test_random_weights_from_a_config(arch):
    from tests.models.hf_zoo import _config

    lm = HybridLM.from_config(_config(arch), seed=3)
    s = lm.pool.alloc()
    out = lm.prefill([s], [[1, 2, 3, 4]])
    out = torch.cat([out, lm.decode([s], [5])])
    assert torch.isfinite(out).all() and out.std() > 0


def test_falcon_h1_layout(saved):
    lm = HybridLM.from_pretrained(saved("falcon_h1")[0])
    cfg = lm.config
    assert cfg.kinds == ["parallel", "mlp"] * 2
    # one state index per half, in block order
    assert [(b, sub.kind, i) for b, sub, i in cfg.state_layers] == [
        (0, "mamba", 0), (0, "attention", 0), (2, "mamba", 1), (2, "attention", 1)
    ]
    assert (lm.pool.n_mamba, lm.pool.n_attn) == (2, 2)
    assert [m.layer for m in lm._mambas] == [0, 1] and lm.blocks[2].mixer.attention.layer == 1
    m, a = cfg.blocks[0].mamba, cfg.blocks[0].attention
    assert (m.gate_norm, m.n_groups, m.proj_bias, m.out_proj_bias) == ("none", 1, True, True)
    assert lm.blocks[0].mixer.mamba.norm_weight is None
    assert a.rotary_dim == a.head_dim == 8 and a.qkv_bias and a.out_bias
    # untied: both multipliers are folded into their weights, nothing is left for run time
    assert (cfg.embedding_multiplier, cfg.logits_scaling, cfg.tie_embeddings) == (1.0, 1.0, False)
    for arch, gate_norm, group in (("falcon_h1_norm", "gated", 32), ("falcon_h1_norm_first", "norm_before_gate", 32)):
        lm = HybridLM.from_pretrained(saved(arch)[0])
        m = lm.config.blocks[0].mamba
        assert (m.gate_norm, m.n_groups, m.norm_group_size) == (gate_norm, 2, group)
    # tied: the shared tensor takes lm_head_multiplier, the embedding the rest at run time
    lm = HybridLM.from_pretrained(saved("falcon_h1_norm")[0])
    assert lm.config.tie_embeddings and not hasattr(lm, "lm_head")
    assert lm.config.embedding_multiplier == pytest.approx(0.9 / 1.8)
    assert lm.config.blocks[0].attention.rope_theta == 500.0


@pytest.mark.parametrize("arch", FALCON)
def test_every_falcon_multiplier_is_folded(saved, arch):
    """The zoo's multipliers are all different from 1, and each one matters: leaving any of them out
    of the weights puts the logits off transformers' (so the parity tests check every fold)."""
    import dataclasses

    from models.loading import SafetensorsDir, read_config

    path, model = saved(arch)
    prompt = random_prompt(random.Random(0), 8)
    ref = hf_logits(model, prompt)[-1]
    arch_mod, cfg, _ = read_config(path)
    assert _prefill_error(path, model, prompt) < 1e-4
    for i, (name, value) in enumerate(cfg.load_scales):
        values = value if isinstance(value, tuple) else (value,)
        for j in range(len(values)):
            if values[j] == 1.0:
                assert name == "embedding" and cfg.tie_embeddings  # tied: scaled at run time instead
                continue
            plain = list(values)
            plain[j] = 1.0
            scales = list(cfg.load_scales)
            scales[i] = (name, tuple(plain) if isinstance(value, tuple) else 1.0)
            lm = HybridLM(dataclasses.replace(cfg, load_scales=tuple(scales)))
            lm.load_from(SafetensorsDir(path, arch_mod.checkpoint_key), arch_mod)
            s = lm.pool.alloc()
            err = (lm.prefill([s], [prompt])[0] - ref).abs().max().item()
            assert err > 1e-3, f"{name}[{j}] left out changes nothing ({err:.3g})"


def _edited(saved, tmp_path, arch, **fields):
    d = _copy(saved(arch)[0], tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "RoPE type 'linear'"),
        (dict(hidden_act="gelu"), "activation 'gelu'"),
        (dict(mamba_n_groups=3), "mamba_n_groups 3 does not divide mamba_n_heads 4"),
        (dict(mamba_d_ssm=48), "mamba_d_ssm|mamba_d_head|dimensions"),
        (dict(ssm_multipliers=[1.0, 1.0, 1.0]), "ssm_multipliers has 3 values"),
    ],
)
def test_unsupported_falcon_h1_configs(saved, tmp_path, fields, message):
    with pytest.raises(CheckpointError, match=message):
        HybridLM.from_pretrained(_edited(saved, tmp_path, "falcon_h1", **fields))


def test_zamba2_layout(saved):
    from models.arch.zamba2 import _transformer_sources
    from models.loading import SafetensorsDir

    lm = HybridLM.from_pretrained(saved("zamba2")[0])
    cfg = lm.config
    assert cfg.kinds == ["mamba", "shared_attention", "mamba", "shared_attention", "shared_attention"]
    # a shared-attention block's attention runs before its Mamba2 mixer; both kinds count in block order
    assert [(b, sub.kind, i) for b, sub, i in cfg.state_layers] == [
        (0, "mamba", 0), (1, "attention", 0), (1, "mamba", 1), (2, "mamba", 2), (3, "attention", 1),
        (3, "mamba", 3), (4, "attention", 2), (4, "mamba", 4),
    ]
    assert (lm.pool.n_mamba, lm.pool.n_attn) == (5, 3)
    spec = cfg.blocks[1]
    a, m, mlp = spec.attention, spec.mamba, spec.mlp
    assert (a.n_heads, a.n_kv_heads, a.head_dim, a.rotary_dim, a.rope_theta) == (4, 4, 16, 16, 500.0)
    assert a.softmax_scale == pytest.approx(8**-0.5)  # (head_dim / 2) ** -0.5
    assert lm.blocks[1].shared.attention.qkv_proj.weight.shape == (3 * 64, 64)
    assert (m.n_groups, m.norm_group_size, m.norm_eps, m.dt_limit, m.proj_bias, m.conv_bias) == (
        2, 32, 1e-5, (0.001, float("inf")), True, True)
    assert (mlp.act, mlp.gated, mlp.bias) == ("gelu", True, True)
    assert cfg.tie_embeddings and not hasattr(lm, "lm_head")
    # two shared blocks used in turn by three hybrid layers, each stored once under its first user
    path = saved("zamba2")[0]
    available = SafetensorsDir(path, lambda k: k).__contains__
    assert _transformer_sources(cfg, available) == [f"model.layers.{i}.shared_transformer" for i in (1, 3, 1)]
    # untied, transformers ties no shared block either: every hybrid layer keeps its own
    lm = HybridLM.from_pretrained(saved("zamba2_plain")[0])
    cfg = lm.config
    assert cfg.kinds == ["shared_attention", "mamba"] * 2 + ["shared_attention"]
    assert not cfg.tie_embeddings and hasattr(lm, "lm_head")
    available = SafetensorsDir(saved("zamba2_plain")[0], lambda k: k).__contains__
    assert _transformer_sources(cfg, available) == [f"model.layers.{i}.shared_transformer" for i in (0, 2, 4)]
    a, m = cfg.blocks[0].attention, cfg.blocks[0].mamba
    assert (a.n_kv_heads, a.rotary_dim, m.norm_group_size, m.proj_bias) == (2, 0, 64, False)
    assert lm.blocks[0].mixer.defers_norm and cfg.layout("adapted") == ("gate_up",)


@pytest.mark.parametrize("arch", ZAMBA)
def test_every_zamba2_adapter_is_folded(saved, arch):
    """Each hybrid layer's adapters (gate_up always; q, k, v with `use_shared_attention_adapter`) are
    folded into its weights, and each one matters: leaving any out puts the logits off transformers'."""
    import dataclasses
    from types import SimpleNamespace

    from models.loading import SafetensorsDir, read_config

    path, model = saved(arch)
    prompt = random_prompt(random.Random(0), 8)
    ref = hf_logits(model, prompt)[-1]
    arch_mod, cfg, _ = read_config(path)
    assert _prefill_error(path, model, prompt) < 1e-4
    source = SafetensorsDir(path, arch_mod.checkpoint_key)
    full = arch_mod.weight_map(cfg, source.__contains__)
    adapted = [(t, i) for t, src in full.items() for i, a in enumerate(src.adapters) if a is not None]
    per_layer = 4 if arch == "zamba2" else 1
    assert len(adapted) == per_layer * sum(k == "shared_attention" for k in cfg.kinds)
    for target, i in adapted:
        adapters = list(full[target].adapters)
        adapters[i] = None
        wmap = dict(full, **{target: dataclasses.replace(full[target], adapters=tuple(adapters))})
        lm = HybridLM(cfg)
        lm.load_from(source, SimpleNamespace(weight_map=lambda *_, w=wmap: w))
        s = lm.pool.alloc()
        err = (lm.prefill([s], [prompt])[0] - ref).abs().max().item()
        assert err > 1e-3, f"{target} part {i}: its adapter left out changes nothing ({err:.3g})"


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(use_long_context=True), "use_long_context"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "RoPE type 'linear'"),
        (dict(num_key_value_heads=2), "use_shared_attention_adapter with num_key_value_heads 2"),
        (dict(mamba_ngroups=3), "mamba_ngroups 3 does not divide n_mamba_heads 4"),
        (dict(n_mamba_heads=3), "n_mamba_heads 3 does not divide"),
        (dict(num_attention_heads=3), "num_attention_heads 3 does not divide 2 \\* hidden_size"),
        (dict(layers_block_type=["mamba", "attention", "mamba", "hybrid", "hybrid"]), "layer 1 has unsupported block type"),
    ],
)
def test_unsupported_zamba2_configs(saved, tmp_path, fields, message):
    with pytest.raises(CheckpointError, match=message):
        HybridLM.from_pretrained(_edited(saved, tmp_path, "zamba2", **fields))
