"""The runtime on the Triton kernels (interpreted on CPU): strided per-layer state views, the
all-layers-at-once commit, and every mode against transformers."""
from __future__ import annotations

import random

import pytest

from models import HybridLM
from tests.kernels import interpret_compat
from tests.models.hf_zoo import hf_logits, random_prompt
from tests.models.trees import random_tree


@pytest.mark.parametrize("arch", ["nemotron_h", "falcon_h1", "falcon_h1_norm_first", "zamba2"])
def test_all_modes_on_triton_kernels(saved, monkeypatch, arch):
    """FalconH1: parallel blocks, and Mamba2 decode through the unfused kernels (no gated norm,
    and a norm before the gate). Zamba2: shared-attention blocks (an attention over 2 * d_model
    inputs, the embeddings in every mode)."""
    interpret_compat.install()
    path, model = saved(arch)
    lm = HybridLM.from_pretrained(path, max_slots=2, max_len=40)
    monkeypatch.setenv("TREESERVE_KERNELS", "triton")
    rng = random.Random(9)
    seqs = [random_prompt(rng, 18), random_prompt(rng, 4)]
    slots = [lm.pool.alloc(), lm.pool.alloc()]

    def check(out, what):
        for b in range(2):
            err = (out[b] - hf_logits(model, seqs[b])[-1]).abs().max().item()
            assert err < 1e-4, f"{what} seq {b}: {err:.3g}"

    check(lm.prefill(slots, seqs), "prefill")
    seqs = [s + [t] for s, t in zip(seqs, (3, 4))]
    check(lm.decode(slots, [3, 4]), "decode")
    trees = [random_tree(rng, 5, 7, "random"), random_tree(rng, 6, 4, "chain")]
    res = lm.verify(slots, trees)
    for b, t in enumerate(trees):
        for leaf in t.leaves():
            branch = t.path_to(leaf)
            ref = hf_logits(model, seqs[b] + t.tokens_along(branch))
            for d, node in enumerate(branch):
                err = (res.logits[res.offsets[b] + node] - ref[len(seqs[b]) + d]).abs().max().item()
                assert err < 1e-4, f"verify tree {b} node {node}: {err:.3g}"
    paths = [t.path_to(t.size - 1) for t in trees]
    lm.commit([(res.pending[b], p) for b, p in enumerate(paths)])
    seqs = [s + t.tokens_along(p) + [7] for s, t, p in zip(seqs, trees, paths)]
    check(lm.decode(slots, [7, 7]), "decode after commit")


@pytest.mark.parametrize("arch", ["nemotron_h", "zamba2"])
def test_prompts_in_pieces_on_triton_kernels(saved, monkeypatch, arch):
    """Prompts through the graphs' programs (run eagerly here) on the Triton kernels: prefill chunks
    (the slot and start read on the device, the tree attention's chain mask) and chains, in two
    slots at different lengths, one of them reused, against transformers."""
    from models.graphs import GraphRunner

    interpret_compat.install()
    path, model = saved(arch)
    lm = HybridLM.from_pretrained(path, max_slots=2, max_len=40)
    lm.graphs = GraphRunner(lm, node_buckets=(1, 4, 8), capture=False, prefill_chunks=(5, 12))
    monkeypatch.setenv("TREESERVE_KERNELS", "triton")
    rng = random.Random(11)
    used = lm.pool.alloc()
    lm.prefill([used], [random_prompt(rng, 9)])  # then given back: its states must not leak
    lm.pool.free(used)
    slots = [lm.pool.alloc(), lm.pool.alloc()]
    seqs = [[], []]
    for lengths in ((14, 5), (3, 13)):  # chunks of 12 and 5 with chains after them, and chains alone
        prompts = [random_prompt(rng, n) for n in lengths]
        out = lm.prefill(slots, prompts)
        seqs = [s + p for s, p in zip(seqs, prompts)]
        for b in range(2):
            err = (out[b] - hf_logits(model, seqs[b])[-1]).abs().max().item()
            assert err < 1e-4, f"prompt {lengths[b]} in slot {slots[b]}: {err:.3g}"
    out = lm.decode(slots, [3, 4])
    for b, t in enumerate((3, 4)):
        assert (out[b] - hf_logits(model, seqs[b] + [t])[-1]).abs().max().item() < 1e-4
