"""bench.step_breakdown's knockouts: each op's stand-in replaces the op on the path that runs (the
output changes and the stand-in counts its calls), ops a model lacks are reported as not reached,
and leaving the knockout restores the model exactly."""
from __future__ import annotations

import random

import pytest
import torch

from bench.step_breakdown import OPS, knocked_out, summarise
from models import HybridLM
from models.verify import VerifyStash
from tests.models.hf_zoo import make_model, random_prompt
from treeserve.tree import TokenTree


def _lm(arch: str) -> HybridLM:
    return HybridLM.from_hf_model(make_model(arch), dtype=torch.float32, max_slots=2, max_len=64)


def _outputs(lm: HybridLM) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode logits after a prompt, and verify logits of a 4-node tree after it (fresh slots)."""
    prompt = random_prompt(random.Random(0), 6)
    tree = TokenTree((3, 5, 7, 9), (-1, 0, 0, 1))
    a, b = lm.pool.alloc(), lm.pool.alloc()
    try:
        lm.prefill([a, b], [prompt, prompt])
        dec = lm.decode([a], [4])
        ver = lm.verify([b], [tree]).logits
        return dec.clone(), ver.clone()
    finally:
        lm.pool.free(a)
        lm.pool.free(b)


# op -> (the architecture that has it, which output it must change: 0 decode, 1 verify)
_REACHED = {
    "in_proj": ("mamba2", 1), "tree_conv": ("mamba2", 1), "tree_scan": ("mamba2", 1),
    "gated_norm": ("mamba2", 1), "out_proj": ("mamba2", 1), "decode_step": ("mamba2", 0),
    "add_norm": ("mamba2", 1), "lm_head": ("mamba2", 1), "attention": ("bamba", 1), "mlp": ("bamba", 1),
    "qkv_proj": ("bamba", 1), "tree_attention": ("bamba", 0), "o_proj": ("bamba", 1), "rope": ("bamba", 1),
    "write_kv": ("bamba", 0), "proj_conv": ("mamba2", 1), "few_rows_as_one": ("bamba", 1),
}
# ops only the Triton kernels run (interpreted here)
_TRITON_ONLY = {"proj_conv"}


def test_every_op_has_a_case():
    assert set(_REACHED) == set(OPS)


def _poison_stashes(monkeypatch) -> None:
    """Every verify's stash starts as NaN. A stand-in that writes nothing (the tree conv's leaves its
    output buffer as it was) then shows in the logits: without this, a fresh stash could get the very
    memory the run before freed, holding the values the real op wrote there, and the knocked-out
    verify would give the same logits."""
    init = VerifyStash.__init__

    def poisoned(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for t in vars(self).values():
            if isinstance(t, torch.Tensor):
                t.fill_(float("nan"))

    monkeypatch.setattr(VerifyStash, "__init__", poisoned)


@pytest.mark.parametrize("op", OPS)
def test_knockout_replaces_the_op_and_restores_it(monkeypatch, op):
    arch, which = _REACHED[op]
    if op in _TRITON_ONLY:
        from tests.kernels import interpret_compat

        interpret_compat.install()
        monkeypatch.setenv("TREESERVE_KERNELS", "triton")
    _poison_stashes(monkeypatch)
    with torch.no_grad():
        lm = _lm(arch)
        base = _outputs(lm)
        with knocked_out(lm, op) as calls:
            knocked = _outputs(lm)
        assert calls[0] > 0
        assert knocked[which].shape == base[which].shape
        assert not torch.equal(knocked[which], base[which])
        after = _outputs(lm)
    assert torch.equal(after[0], base[0]) and torch.equal(after[1], base[1])


def test_ops_a_model_lacks_are_not_reached():
    with torch.no_grad():
        lm = _lm("mamba2")
        for op in ("attention", "qkv_proj", "rope", "write_kv", "tree_attention", "o_proj", "mlp"):
            with knocked_out(lm, op) as calls:
                _outputs(lm)
            assert calls[0] == 0


def test_unknown_op():
    with pytest.raises(ValueError, match="unknown op"):
        with knocked_out(_lm("mamba2"), "softmax"):
            pass


def test_summary_is_base_minus_knocked_and_marks_unreached_ops():
    runs = [
        {"op": "base", "decode": 2.0, "verify_16": 3.0},
        {"op": "tree_scan", "decode": 2.0, "verify_16": 2.7, "stand_in_calls": 64},
        {"op": "base", "decode": 2.2, "verify_16": 3.2},
        {"op": "attention", "decode": 2.1, "verify_16": 3.1, "stand_in_calls": 0},
        {"op": "base", "decode": 2.1, "verify_16": 3.1},
    ]
    out = summarise(runs)
    assert out["base"] == {"decode": 2.1, "verify_16": 3.1}
    assert out["tree_scan"]["verify_16"] == pytest.approx(0.4)
    assert out["tree_scan"]["decode"] == pytest.approx(0.1)
    assert out["attention"] == {"decode": None, "verify_16": None}
