"""A few optimiser steps on the tiny presets: loss goes down, checkpoints load back, card is written."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from models.training.presets import get_preset
from models.training.train import lr_at, train

from .conftest import TINY_VOCAB


@pytest.fixture(scope="module", params=["tiny-target", "tiny-drafter"])
def trained(request, small_corpus, small_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "ckpt"
    record = train(get_preset(request.param), small_corpus, small_tokenizer, out, minutes=5.0, max_steps=40,
                   seed=0, log_every_s=1e9)
    return request.param, out, record


def test_training_loss_goes_down(trained):
    _, _, record = trained
    assert record["training"]["steps"] == 40 and record["training"]["stop_reason"] == "steps"
    assert record["training"]["first_loss"] == pytest.approx(math.log(TINY_VOCAB), abs=0.6)
    assert record["final_train_loss"] < record["training"]["first_loss"] - 1.0
    assert record["valid_loss"] < record["training"]["first_loss"] - 0.8
    assert record["valid_ppl"] == pytest.approx(math.exp(record["valid_loss"]))


def test_checkpoint_loads_with_transformers(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, out, record = trained
    arch = {"tiny-target": "NemotronHForCausalLM", "tiny-drafter": "Mamba2ForCausalLM"}[name]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert "lm_head.weight" in f.keys()
    assert dtypes == {"F16"}
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(model).__name__ == arch
    assert sum(p.numel() for p in model.parameters()) == record["model"]["parameters"]
    assert model.config.vocab_size == TINY_VOCAB and model.config.eos_token_id == 0
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == TINY_VOCAB
    # the saved fp16 weights reproduce the trained model's held-out quality
    ids = tok("def main():\n    return 0\n", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], TINY_VOCAB) and torch.isfinite(logits).all()


def test_card_and_record(trained, small_corpus):
    name, out, record = trained
    card = (out / "card.md").read_text()
    manifest = json.loads((small_corpus / "manifest.json").read_text())
    assert name in card and manifest["corpus_sha256"] in card
    assert f"{record['valid_loss']:.4f}" in card and "tokens seen" in card and "wall time" in card
    saved = json.loads((out / "training.json").read_text())
    assert saved["training"]["tokens_seen"] == 40 * record["training"]["batch_size"] * record["training"]["seq_len"]
    assert saved["checkpoint_bytes"] > 0


def test_seeded_runs_repeat(small_corpus, small_tokenizer, tmp_path):
    recs = [train(get_preset("tiny-drafter"), small_corpus, small_tokenizer, tmp_path / str(i), minutes=5.0,
                  max_steps=3, seed=7, log_every_s=1e9) for i in range(2)]
    assert recs[0]["valid_loss"] == recs[1]["valid_loss"]
    assert recs[0]["final_train_loss"] == recs[1]["final_train_loss"]


def test_lr_schedule_shape():
    s = get_preset("demo-target").train
    assert lr_at(0, 0.0, s) == pytest.approx(s.lr / s.warmup_steps)
    assert lr_at(s.warmup_steps, 0.0, s) == pytest.approx(s.lr)
    assert lr_at(10**6, 0.5, s) == pytest.approx(s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) / 2))
    assert lr_at(10**6, 1.0, s) == pytest.approx(s.lr * s.min_lr_ratio)


def test_sample_generates_text(trained):
    from models.training.sample import generate

    _, out, _ = trained
    text = generate(str(out), "def ", max_new_tokens=8)
    assert text.startswith("def ") and len(text) > 4


def test_demo_pair_fits_the_size_budget():
    from transformers import AutoModelForCausalLM

    total = 0
    for name in ("demo-target", "demo-drafter"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(get_preset(name).build_config(4096))
        total += 2 * sum(p.numel() for p in model.parameters())  # fp16
    assert total + 2 * 400_000 <= 16 * 2**20  # plus two tokenizer copies
