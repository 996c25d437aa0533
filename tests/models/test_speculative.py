"""Greedy speculative tree decoding through verify/commit reproduces transformers' greedy `generate`
exactly (fp32), for every architecture, with several sequences verified together in one batch."""
from __future__ import annotations

import random

import pytest

from models import HybridLM
from tests.models.hf_zoo import hf_greedy, random_prompt
from tests.models.trees import argmax_rows, greedy_walk, guided_tree

N_NEW = 14


@pytest.mark.parametrize("arch", ["mamba2", "nemotron_h", "bamba", "granitemoehybrid", "falcon_h1", "falcon_h1_norm",
                                  "zamba2", "zamba2_plain"])
def test_greedy_speculation_equals_generate(saved, arch):
    path, model = saved(arch)
    lm = HybridLM.from_pretrained(path, max_slots=3, max_len=64)
    rng = random.Random(5)
    prompts = [random_prompt(rng, n) for n in (5, 9, 2)]
    truth = [hf_greedy(model, p, N_NEW) for p in prompts]

    slots = [lm.pool.alloc() for _ in prompts]
    first = argmax_rows(lm.prefill(slots, prompts))
    emitted = [[t] for t in first]
    rounds = 0
    while any(len(e) < N_NEW for e in emitted):
        live = [b for b in range(len(slots)) if len(emitted[b]) < N_NEW]
        trees = []
        for b in live:
            done = len(emitted[b])
            trees.append(guided_tree(rng, emitted[b][-1], truth[b][done:], rng.choice([1, 3, 6, 10])))
        res = lm.verify([slots[b] for b in live], trees)
        commits = []
        for i, b in enumerate(live):
            rows = res.logits[res.offsets[i] : res.offsets[i + 1]]
            path, bonus = greedy_walk(trees[i], argmax_rows(rows))
            commits.append((res.pending[i], path))
            emitted[b] += trees[i].tokens_along(path[1:]) + [bonus]
        lm.commit(commits)
        rounds += 1
    for b in range(len(slots)):
        assert emitted[b][:N_NEW] == truth[b], f"sequence {b}"
    assert rounds < N_NEW  # the guided trees did get tokens accepted
