"""A verify forward builds the tree's ancestor bits once and hands the same tensor to every Mamba
layer's tree scan, eagerly and in the static-buffer program that CUDA graphs capture."""
from __future__ import annotations

import random

import pytest

from kernels import ops
from models import HybridLM
from models.graphs import GraphRunner
from tests.models.hf_zoo import random_prompt
from tests.models.trees import random_tree


def _spy(monkeypatch):
    """Count the builds; record the ancestors every tree scan receives (both scan variants: a layer
    whose gated norm is deferred runs `tree_ssd_scan_deferred_norm`)."""
    builds, seen = [], []
    build = ops.ancestor_bits

    def counting_build(*args, **kwargs):
        out = build(*args, **kwargs)
        builds.append(out)
        return out

    def recording(scan):
        def recording_scan(*args, **kwargs):
            seen.append(kwargs.get("ancestors"))
            return scan(*args, **kwargs)

        return recording_scan

    monkeypatch.setattr(ops, "ancestor_bits", counting_build)
    for name in ("tree_ssd_scan", "tree_ssd_scan_deferred_norm"):
        monkeypatch.setattr(ops, name, recording(getattr(ops, name)))
    return builds, seen


@pytest.mark.parametrize("arch", ["bamba", "falcon_h1", "zamba2"])
def test_one_build_per_verify_forward(saved, monkeypatch, arch):
    path, _ = saved(arch)  # two Mamba2 layers (FalconH1: the halves of two parallel blocks)
    rng = random.Random(3)
    for graphs in (False, True):
        lm = HybridLM.from_pretrained(path, max_slots=2, max_len=48)
        if graphs:
            lm.graphs = GraphRunner(lm, node_buckets=(8,), capture=False)
        slots = [lm.pool.alloc(), lm.pool.alloc()]
        lm.prefill(slots, [random_prompt(rng, 5), random_prompt(rng, 3)])
        n_mamba = len(lm._mambas)
        assert n_mamba >= 2
        if graphs:
            lm.graphs.capture_all()  # the capture-time forwards build their own bits; count the replay only
        builds, seen = _spy(monkeypatch)
        lm.verify(slots, [random_tree(rng, 4, 6, "random"), random_tree(rng, 5, 3, "chain")])
        assert len(builds) == 1, f"graphs={graphs}: {len(builds)} builds in one forward"
        assert len(seen) == n_mamba and all(a is builds[0] for a in seen)
        monkeypatch.undo()
