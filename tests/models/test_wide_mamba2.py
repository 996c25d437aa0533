"""Mamba2 with the 2.7B checkpoint's mixer geometry (64-wide heads, 128 states, one group, the
checkpoint's chunk_size 256 above the prompt length, fp32 residual, transformers' default init) and
a prompt longer than our prefill kernel's chunk, against transformers: fp32 to within rounding, and
our bf16 error against an fp32 reference no worse than transformers' own bf16 error."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from models import HybridLM
from tests.models.hf_zoo import hf_logits, make_model, random_prompt

WIDE = dict(
    hidden_size=256, num_heads=8, head_dim=64, state_size=128, n_groups=1, expand=2, chunk_size=256,
    num_hidden_layers=2, tie_word_embeddings=False, residual_in_fp32=True,
)
PROMPT = 100  # > the prefill kernel's chunk (64) and < the checkpoint's chunk (256)


@pytest.fixture(scope="module")
def wide():
    """(transformers model fp32, prompt + one decoded token)."""
    model = make_model("mamba2", seed=3, **WIDE)
    return model, random_prompt(random.Random(7), PROMPT + 1)


def last_two(lm: HybridLM, ids) -> torch.Tensor:
    """(2, V): our logits at the prompt's last position (prefill) and at the decoded token."""
    slot = lm.pool.alloc()
    a = lm.prefill([slot], [ids[:-1]])[0]
    b = lm.decode([slot], [ids[-1]])[0]
    return torch.stack([a, b])


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm()).item()


def test_fp32_matches_transformers(wide):
    model, ids = wide
    lm = HybridLM.from_hf_model(model, max_slots=1, max_len=PROMPT + 8, cuda_graphs=False)
    assert lm.config.residual_in_fp32 and lm.config.mamba_specs[0].norm_group_size == 512
    err = (last_two(lm, ids) - hf_logits(model, ids)[-2:]).abs().max().item()
    assert err < 1e-4, f"max abs error {err:.3g}"


def test_bf16_error_is_rounding(wide):
    """Both bf16 runs measured against transformers fp32 on the very same (bf16) weights."""
    model, ids = wide
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    ref = hf_logits(copy.deepcopy(m16).float(), ids)[-2:]
    hf_err = rel(hf_logits(m16, ids)[-2:], ref)
    ours_err = rel(last_two(HybridLM.from_hf_model(m16, max_slots=1, max_len=PROMPT + 8, cuda_graphs=False), ids), ref)
    assert 0 < hf_err < 0.1, f"transformers bf16 vs fp32: {hf_err:.3g}"
    assert ours_err <= 3 * hf_err, f"ours bf16 {ours_err:.3g} vs transformers bf16 {hf_err:.3g}"
