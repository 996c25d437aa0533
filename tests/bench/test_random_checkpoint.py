"""`bench.random_checkpoint`: random-weight checkpoints that our runtime loads from disk, with a
tokenizer of another checkpoint, and the repeating preset whose greedy text comes round."""
from __future__ import annotations

import pathlib

import pytest
import torch
from safetensors.torch import load_file

from bench.random_checkpoint import DEFAULT, REPEATING, main, write_checkpoint
from models import HybridLM

DEMO_TARGET = pathlib.Path(__file__).resolve().parents[2] / "models" / "demo" / "target"


def greedy(lm: HybridLM, prompt: list[int], n: int) -> list[int]:
    slot = lm.pool.alloc()
    logits = lm.prefill([slot], [prompt])
    out = [int(logits[-1].argmax())]
    for _ in range(n - 1):
        out.append(int(lm.decode([slot], [out[-1]])[0].argmax()))
    return out


def stds(path: pathlib.Path) -> dict[str, float]:
    return {k: float(v.float().std()) for k, v in load_file(str(path / "model.safetensors")).items() if v.numel() > 1}


def test_a_checkpoint_with_another_checkpoints_tokenizer_loads_and_runs(tmp_path):
    from transformers import AutoTokenizer

    main(["--shape", "mamba2-tiny", "--out", str(tmp_path), "--tokenizer", str(DEMO_TARGET)])
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok("def f(x):")["input_ids"] == AutoTokenizer.from_pretrained(str(DEMO_TARGET))("def f(x):")["input_ids"]
    lm = HybridLM.from_pretrained(tmp_path, max_slots=1, max_len=64)
    assert lm.config.vocab_size == len(tok)
    assert lm.tokenizer is not None
    logits = lm.prefill([lm.pool.alloc()], [tok("def f(x):")["input_ids"]])
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()
    s = stds(tmp_path)
    assert s["backbone.embeddings.weight"] == pytest.approx(DEFAULT.embedding, rel=0.05)
    assert s["backbone.layers.0.mixer.out_proj.weight"] == pytest.approx(DEFAULT.residual, rel=0.05)
    assert s["backbone.layers.0.mixer.in_proj.weight"] == pytest.approx(DEFAULT.other, rel=0.05)


def test_a_tokenizer_directory_without_a_tokenizer_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(Exception):
        write_checkpoint("mamba2-tiny", tmp_path / "out", tokenizer=empty)


def test_the_repeating_weights_give_greedy_text_that_comes_round(tmp_path):
    write_checkpoint("mamba2-tiny", tmp_path, layers=2, init=REPEATING)
    s = stds(tmp_path)
    assert s["backbone.embeddings.weight"] == pytest.approx(REPEATING.embedding, rel=0.05)
    assert s["backbone.layers.1.mixer.out_proj.weight"] == pytest.approx(REPEATING.residual, rel=0.05)
    assert s["lm_head.weight"] == pytest.approx(REPEATING.other, rel=0.05)
    lm = HybridLM.from_pretrained(tmp_path, max_slots=1, max_len=1100)
    out = greedy(lm, [5, 17, 300, 42], 1000)
    # a cycle: the last tokens recur with a fixed period, within the 512-token vocabulary's reach
    tail = out[-200:]
    period = next(p for p in range(1, 200) if tail[p:] == tail[:-p])
    assert period < 200 and out[-period - 100:-period] == out[-100:]
