"""`treeserve demo`'s speculative runs and its account of the adaptive policy (no services)."""
from __future__ import annotations

import pytest

from orchestrator.cli_demo import RUNS, adaptive_note, speculative_requests
from orchestrator.client import Result
from orchestrator.generation import parse_speculation


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_a_named_mode_runs_that_fixed_shape(mode):
    """The demo's run for an explicit mode must measure the drafter's trees every step, not what
    the adaptive policy makes of them (it may turn speculation off)."""
    (label, req), = speculative_requests("def f():\n", 16, mode)
    spec = parse_speculation(req.speculation)
    assert (spec.mode, spec.adaptive) == (mode, False)
    assert req.max_new_tokens == 16 and label == f"fixed {mode}"


def test_auto_runs_a_fixed_tree_and_the_adaptive_policy():
    runs = {label: parse_speculation(req.speculation) for label, req in speculative_requests("x", 8, "auto")}
    assert set(runs) == {label for label, _ in RUNS["auto"]}
    assert (runs["fixed tree"].mode, runs["fixed tree"].adaptive) == ("tree", False)
    assert (runs["adaptive"].mode, runs["adaptive"].adaptive) == ("tree", True)


def result(steps):
    """A finished request: the prefill message, then (tree nodes, tokens, ms) per step."""
    steps = [(0, 1, 5.0), *steps]
    tokens = sum(t for _, t, _ in steps)
    return Result(token_ids=list(range(tokens)), generated_tokens=tokens, target_forwards=len(steps),
                  mean_accepted=tokens / len(steps), steps=steps)


PLAIN = [result([(1, 1, 10.0)] * 40)]


def test_note_says_speculation_is_off_and_why():
    fixed = [result([(16, 4, 60.0)] * 10)]  # 15 ms per token: slower than plain decoding's 10
    adaptive = [result([(8, 3, 50.0)] * 3 + [(1, 1, 10.0)] * 30)]
    note = adaptive_note(PLAIN, fixed, adaptive, "fixed tree")
    assert note.startswith("adaptive policy: speculation off on 30 of 33 steps")
    assert ", because\n" in note
    assert "15.0 ms per token" in note and "10.0 ms per token" in note
    assert "drafting costs more than it saves" in note


def test_note_when_off_although_trees_paid():
    fixed = [result([(16, 4, 20.0)] * 10)]
    adaptive = [result([(1, 1, 10.0)] * 30)]
    note = adaptive_note(PLAIN, fixed, adaptive, "fixed tree")
    assert "speculation off on 30 of 30 steps" in note and ", although\n" in note


def test_note_when_the_policy_drafts():
    fixed = [result([(16, 4, 20.0)] * 10)]
    adaptive = [result([(8, 4, 20.0)] * 9 + [(16, 4, 22.0)] * 4 + [(1, 1, 10.0)] * 2)]
    note = adaptive_note(PLAIN, fixed, adaptive, "fixed tree")
    assert note.startswith("adaptive policy: trees on 13 of 15 steps, typically 8 nodes, tau 3.44")
    assert "n-gram lookup" in note  # trees of either drafting, chosen tree by tree
