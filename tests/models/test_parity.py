"""Our runtime against transformers' own models (fp32, CPU, reference kernels): prefill, decode,
verification of every node of random trees, and commit followed by decode."""
from __future__ import annotations

import random

import pytest
import torch

from models import HybridLM
from tests.models.hf_zoo import FALCON, ZAMBA, hf_logits, random_prompt
from tests.models.trees import random_tree

ARCHS = ["mamba2", "mamba2_tied", "nemotron_h", "bamba", "granitemoehybrid", *FALCON, *ZAMBA]
TOL = 1e-4


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = (a - b).abs().max().item()
    assert err < TOL, f"{what}: max abs error {err:.3g}"


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_decode_match_transformers(saved, arch):
    path, model = saved(arch)
    lm = HybridLM.from_pretrained(path, max_slots=4, max_len=64)
    rng = random.Random(1)
    prompts = [random_prompt(rng, n) for n in (11, 3, 1, 17)]
    slots = [lm.pool.alloc() for _ in prompts]
    out = lm.prefill(slots, prompts)
    for b, p in enumerate(prompts):
        close(out[b], hf_logits(model, p)[-1], f"prefill {b}")
    seqs = [list(p) for p in prompts]
    for step in range(3):
        toks = [rng.randrange(1, 96) for _ in seqs]
        out = lm.decode(slots, toks)
        for b, t in enumerate(toks):
            seqs[b].append(t)
            close(out[b], hf_logits(model, seqs[b])[-1], f"decode step {step} seq {b}")
    # prefill continues from what a slot holds (chunked prompt)
    more = [random_prompt(rng, 5), random_prompt(rng, 2)]
    out = lm.prefill(slots[:2], more)
    for b in range(2):
        close(out[b], hf_logits(model, seqs[b] + more[b])[-1], f"second prefill {b}")
    assert [lm.pool.length(s) for s in slots] == [len(seqs[0]) + 5, len(seqs[1]) + 2, len(seqs[2]), len(seqs[3])]


@pytest.mark.parametrize("arch", ARCHS)
def test_verify_every_node_then_commit_and_decode(saved, arch):
    path, model = saved(arch)
    lm = HybridLM.from_pretrained(path, max_slots=4, max_len=96)
    rng = random.Random(2)
    kinds = [("chain", 6), ("star", 7), ("random", 12), ("deep", 9)]
    prompts = [random_prompt(rng, n) for n in (7, 12, 4, 5)]
    slots = [lm.pool.alloc() for _ in prompts]
    lm.prefill(slots, prompts)
    for rnd in range(2):
        trees = [random_tree(rng, rng.randrange(1, 96), n, kind) for kind, n in kinds]
        res = lm.verify(slots, trees)
        assert res.offsets[-1] == res.logits.shape[0] == sum(t.size for t in trees)
        for b, tree in enumerate(trees):
            # one transformers forward per leaf covers every node on its root-to-leaf path
            for leaf in tree.leaves():
                branch = tree.path_to(leaf)
                ref = hf_logits(model, prompts[b] + tree.tokens_along(branch))
                for depth, node in enumerate(branch):
                    close(res.logits[res.offsets[b] + node], ref[len(prompts[b]) + depth], f"round {rnd} tree {b} node {node}")
        accepted = [tree.path_to(rng.randrange(tree.size)) for tree in trees]
        lm.commit([(res.pending[b], accepted[b]) for b in range(len(trees))])
        for b, tree in enumerate(trees):
            prompts[b] = prompts[b] + tree.tokens_along(accepted[b])
            assert lm.pool.length(slots[b]) == len(prompts[b])
        nxt = [rng.randrange(1, 96) for _ in slots]
        out = lm.decode(slots, nxt)
        for b in range(len(slots)):
            prompts[b].append(nxt[b])
            close(out[b], hf_logits(model, prompts[b])[-1], f"decode after commit, round {rnd} seq {b}")


def test_granite_rope_ignores_partial_rotary_factor(tmp_path):
    """transformers' Granite rotates the whole head whatever `partial_rotary_factor` a config carries."""
    from tests.models.hf_zoo import make_model

    model = make_model("granitemoehybrid", partial_rotary_factor=0.5)
    model.save_pretrained(tmp_path)
    lm = HybridLM.from_pretrained(tmp_path, max_slots=1, max_len=32)
    prompt = random_prompt(random.Random(6), 12)
    s = lm.pool.alloc()
    close(lm.prefill([s], [prompt])[0], hf_logits(model, prompt)[-1], "prefill")
    close(lm.decode([s], [5])[0], hf_logits(model, prompt + [5])[-1], "decode")


def test_commit_handles_from_different_verify_calls(saved):
    path, model = saved("bamba")
    lm = HybridLM.from_pretrained(path, max_slots=3, max_len=64)
    rng = random.Random(3)
    prompts = [random_prompt(rng, 6), random_prompt(rng, 9)]
    slots = [lm.pool.alloc() for _ in prompts]
    lm.prefill(slots, prompts)
    t0 = random_tree(rng, 5, 6, "random")
    t1 = random_tree(rng, 7, 5, "chain")
    r0 = lm.verify([slots[0]], [t0])
    r1 = lm.verify([slots[1]], [t1])
    # a second verification of slot 0 overwrites its scratch K/V rows; the first handle still commits
    lm.verify([slots[0]], [random_tree(rng, 9, 6, "star")])
    p0, p1 = t0.path_to(t0.size - 1), t1.path_to(3)
    lm.commit([(r1.pending[0], p1), (r0.pending[0], p0)])
    out = lm.decode(slots, [11, 12])
    close(out[0], hf_logits(model, prompts[0] + t0.tokens_along(p0) + [11])[-1], "slot 0")
    close(out[1], hf_logits(model, prompts[1] + t1.tokens_along(p1) + [12])[-1], "slot 1")


def test_verify_reduce_returns_only_what_is_asked(saved):
    path, _ = saved("nemotron_h")
    lm = HybridLM.from_pretrained(path, max_slots=2, max_len=32)
    s = lm.pool.alloc()
    lm.prefill([s], [[3, 4, 5]])
    tree = random_tree(random.Random(4), 6, 5, "random")
    full = lm.verify([s], [tree])
    res = lm.verify([s], [tree], reduce=lambda logits: logits.argmax(-1))
    assert res.logits is None
    assert res.output.tolist() == full.logits.argmax(-1).tolist()
    assert res.offsets == full.offsets == [0, 5]
