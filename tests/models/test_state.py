"""State slots: allocation limits, length limits, fork, stale commits, and isolation between slots."""
from __future__ import annotations

import random

import pytest
import torch

from models import HybridLM, SequenceTooLong, SlotsExhausted, StaleHandle
from tests.models.hf_zoo import ARCHS, random_prompt
from tests.models.trees import random_tree
from treeserve.tree import TokenTree


def test_exhaustion_and_reuse(saved):
    lm = HybridLM.from_pretrained(saved("mamba2")[0], max_slots=2, max_len=16)
    a, b = lm.pool.alloc(), lm.pool.alloc()
    with pytest.raises(SlotsExhausted, match="all 2 state slots"):
        lm.pool.alloc()
    lm.pool.free(a)
    assert lm.pool.alloc() == a and lm.pool.length(a) == 0
    with pytest.raises(ValueError, match="not allocated"):
        lm.decode([2], [1])
    with pytest.raises(ValueError, match="twice"):
        lm.decode([b, b], [1, 2])
    assert lm.decode([], []).shape == (0, 96) and lm.prefill([], []).shape == (0, 96)
    assert lm.verify([], []).offsets == [0]
    lm.commit([])


def test_the_warm_up_verifies_every_row_tile_up_to_the_prepared_paths():
    """The warm-up's chains reach the longest path whose commit is prepared at start-up and meet
    every row tile a verify's KV write takes on the way (the power of two at or above the node
    count): an eager verify of any size up to there then runs a program the warm-up compiled."""
    from models.graphs import PREPARED_PATH

    assert max(HybridLM.WARM_UP_PATHS) == PREPARED_PATH
    tiles = {min(32, 1 << (n - 1).bit_length()) for n in range(1, PREPARED_PATH + 1)}
    assert tiles == set(HybridLM.WARM_UP_PATHS)


@pytest.mark.parametrize("arch,free", [("nemotron_h", 0), ("nemotron_h", 1), *((a, 3) for a in ARCHS)])
def test_the_warm_up_gives_back_every_slot_it_takes(saved, arch, free):
    """`warm_up`'s calls (on CUDA they compile; here the reference twins run them) work for every
    architecture, take up to two slots and give them all back, in the pool's order, whether one,
    several or none are free; the other slots' states are untouched."""
    lm = HybridLM.from_pretrained(saved(arch)[0], max_slots=4, max_len=256)
    held = [lm.pool.alloc() for _ in range(4 - free)]
    if held:
        lm.prefill(held[:1], [[1, 2, 3]])
    states = [name for name in ("ssm", "conv", "k", "v") if hasattr(lm.pool, name)]
    before = {name: getattr(lm.pool, name).clone() for name in states}
    lengths, order = [lm.pool.length(s) for s in held], list(lm.pool._free)
    lm.warm_up_calls()
    assert sorted(lm.pool.in_use()) == sorted(held)
    assert lm.pool._free == order
    for name in states:
        for s in held:
            assert torch.equal(getattr(lm.pool, name)[s], before[name][s]), (name, s)
    assert [lm.pool.length(s) for s in held] == lengths


@pytest.mark.parametrize("arch", ["mamba2", "nemotron_h"])
def test_a_reused_slot_starts_empty(saved, arch):
    """Decode, verify and prefill from length 0 on a slot that held another sequence give what they
    give on a slot never used: the old sequence's SSM and conv states are gone."""
    lm = HybridLM.from_pretrained(saved(arch)[0], max_slots=2, max_len=32)
    fresh = lm.pool.alloc()
    want_decode = lm.decode([fresh], [5])[0]
    used = lm.pool.alloc()
    lm.prefill([used], [random_prompt(random.Random(3), 20)])
    lm.pool.free(used)
    again = lm.pool.alloc()
    assert again == used
    torch.testing.assert_close(lm.decode([again], [5])[0], want_decode, rtol=0, atol=1e-5)
    lm.pool.free(fresh)
    lm.pool.free(again)
    tree = random_tree(random.Random(4), 5, 6, "random")
    a = lm.pool.alloc()
    want_verify = lm.verify([a], [tree]).logits
    lm.prefill([a], [random_prompt(random.Random(5), 20)])
    lm.pool.free(a)
    b = lm.pool.alloc()
    assert b == a
    torch.testing.assert_close(lm.verify([b], [tree]).logits, want_verify, rtol=0, atol=1e-5)
    prompt = random_prompt(random.Random(6), 7)
    want_prefill = lm.prefill([b], [prompt])[0]
    lm.pool.free(b)
    c = lm.pool.alloc()
    assert c == b
    torch.testing.assert_close(lm.prefill([c], [prompt])[0], want_prefill, rtol=0, atol=1e-5)


def test_too_long_is_refused_before_any_work(saved):
    lm = HybridLM.from_pretrained(saved("bamba")[0], max_slots=2, max_len=10)
    s = lm.pool.alloc()
    with pytest.raises(SequenceTooLong, match="max_len 10"):
        lm.prefill([s], [list(range(1, 12))])
    assert lm.pool.length(s) == 0
    lm.prefill([s], [list(range(1, 9))])
    with pytest.raises(SequenceTooLong):
        lm.verify([s], [random_tree(random.Random(0), 3, 3, "chain")])
    lm.decode([s], [4])
    lm.decode([s], [5])
    with pytest.raises(SequenceTooLong):
        lm.decode([s], [6])
    lm.pool.free(s)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.prefill([lm.pool.alloc()], [[10**6]])


@pytest.mark.parametrize("arch", ["nemotron_h", "falcon_h1", "zamba2"])
def test_fork_copies_the_whole_state(saved, arch):
    lm = HybridLM.from_pretrained(saved(arch)[0], max_slots=3, max_len=32)
    a, b = lm.pool.alloc(), lm.pool.alloc()
    lm.prefill([a], [random_prompt(random.Random(1), 9)])
    lm.decode([a], [7])
    lm.fork(a, b)
    assert lm.pool.length(b) == lm.pool.length(a) == 10
    out = lm.decode([a, b], [3, 3])
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)
    out = lm.decode([b], [4])
    ref = lm.decode([a], [4])
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_stale_and_malformed_commits(saved):
    lm = HybridLM.from_pretrained(saved("bamba")[0], max_slots=2, max_len=32)
    s = lm.pool.alloc()
    lm.prefill([s], [[1, 2, 3]])
    tree = random_tree(random.Random(2), 4, 6, "random")
    res = lm.verify([s], [tree])
    with pytest.raises(ValueError, match="not a root-down branch"):
        lm.commit([(res.pending[0], [1])])
    bad = next(i for i in range(1, tree.size) if tree.parents[i] != 0) if any(p > 0 for p in tree.parents) else None
    if bad is not None:
        with pytest.raises(ValueError, match="not a root-down branch"):
            lm.commit([(res.pending[0], [0, bad])])
    lm.commit([(res.pending[0], [0])])
    assert lm.pool.length(s) == 4
    with pytest.raises(StaleHandle):
        lm.commit([(res.pending[0], [0])])
    res = lm.verify([s], [tree])
    lm.decode([s], [5])
    with pytest.raises(StaleHandle):
        lm.commit([(res.pending[0], [0])])


@pytest.mark.parametrize("arch", ["mamba2", "bamba", "falcon_h1", "zamba2"])
def test_interleaved_sequences_match_running_alone(saved, arch):
    """Six sequences in four slots, freed and re-used, in shifting batches, against each run alone."""
    path, _ = saved(arch)
    rng = random.Random(3)
    scripts = []
    for _ in range(6):
        steps = [("prefill", random_prompt(rng, rng.randrange(1, 9)))]
        for _ in range(3):
            if rng.random() < 0.5:
                steps.append(("decode", rng.randrange(1, 96)))
            else:
                tree = random_tree(rng, rng.randrange(1, 96), rng.randrange(1, 7), rng.choice(["chain", "random", "star"]))
                steps.append(("verify", (tree, tree.path_to(rng.randrange(tree.size)))))
        scripts.append(steps)

    def run_alone(lm, steps):
        s = lm.pool.alloc()
        outs = [_step(lm, [s], [st])[0] for st in steps]
        lm.pool.free(s)
        return outs

    solo = HybridLM.from_pretrained(path, max_slots=1, max_len=64)
    expected = [run_alone(solo, steps) for steps in scripts]

    lm = HybridLM.from_pretrained(path, max_slots=4, max_len=64)
    pos = [0] * len(scripts)
    slot_of: dict[int, int] = {}
    got: list[list[torch.Tensor]] = [[] for _ in scripts]
    waiting = list(range(len(scripts)))
    while waiting or slot_of:
        while waiting and len(slot_of) < 4:
            slot_of[waiting.pop(0)] = lm.pool.alloc()
        live = [q for q in slot_of if rng.random() < 0.8] or list(slot_of)
        # one step each for the chosen sequences, one batch per step kind
        kinds = {q: scripts[q][pos[q]][0] for q in live}
        for kind in ("prefill", "decode", "verify"):
            group = [q for q in live if kinds[q] == kind]
            if group:
                outs = _step(lm, [slot_of[q] for q in group], [scripts[q][pos[q]] for q in group])
                for q, o in zip(group, outs):
                    got[q].append(o)
                    pos[q] += 1
        for q in [q for q in slot_of if pos[q] == len(scripts[q])]:
            lm.pool.free(slot_of.pop(q))
    for q in range(len(scripts)):
        for a, b in zip(got[q], expected[q]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _step(lm, slots, steps):
    kind = steps[0][0]
    if kind == "prefill":
        return list(lm.prefill(slots, [st[1] for st in steps]))
    if kind == "decode":
        return list(lm.decode(slots, [st[1] for st in steps]))
    trees = [st[1][0] for st in steps]
    res = lm.verify(slots, trees)
    lm.commit([(res.pending[b], st[1][1]) for b, st in enumerate(steps)])
    return [res.logits[res.offsets[b] : res.offsets[b + 1]] for b in range(len(steps))]


def test_a_failing_commit_applies_nothing(saved):
    lm = HybridLM.from_pretrained(saved("nemotron_h")[0], max_slots=2, max_len=32)
    a, b = lm.pool.alloc(), lm.pool.alloc()
    lm.prefill([a, b], [[1, 2], [3, 4, 5]])
    tree = random_tree(random.Random(5), 6, 4, "chain")
    res = lm.verify([a, b], [tree, tree])
    with pytest.raises(ValueError, match="not a root-down branch"):
        lm.commit([(res.pending[0], [0, 1]), (res.pending[1], [0, 2])])
    assert (lm.pool.length(a), lm.pool.length(b)) == (2, 3)
    lm.commit([(res.pending[0], [0, 1]), (res.pending[1], [0, 1, 2])])
    assert (lm.pool.length(a), lm.pool.length(b)) == (4, 6)


def test_a_commit_or_decode_that_fails_midway_leaves_no_handle_to_commit_again(saved, monkeypatch):
    """A device error after the state moved (injected: the commit's program runs, then raises):
    the handles are consumed and the slots spoiled, so a retry raises StaleHandle instead of
    applying the commit twice. A decode that fails partway spoils its slots the same way."""
    from models import verify as verify_module

    lm = HybridLM.from_pretrained(saved("nemotron_h")[0], max_slots=2, max_len=32)
    a, b = lm.pool.alloc(), lm.pool.alloc()
    lm.prefill([a, b], [[1, 2], [3, 4, 5]])
    tree = random_tree(random.Random(5), 6, 4, "chain")
    res = lm.verify([a, b], [tree, tree])
    run_commit = verify_module.run_commit

    def fails_after_running(*args, **kwargs):
        run_commit(*args, **kwargs)
        raise RuntimeError("device error")

    monkeypatch.setattr(verify_module, "run_commit", fails_after_running)
    with pytest.raises(RuntimeError, match="device error"):
        lm.commit([(res.pending[0], [0, 1]), (res.pending[1], [0, 1])])
    monkeypatch.setattr(verify_module, "run_commit", run_commit)
    for pending in res.pending:
        with pytest.raises(StaleHandle):
            lm.commit([(pending, [0, 1])])
    assert (lm.pool.length(a), lm.pool.length(b)) == (2, 3)

    res = lm.verify([a], [tree])
    monkeypatch.setattr(lm, "hidden", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("device error")))
    with pytest.raises(RuntimeError, match="device error"):
        lm.decode([a], [7])
    with pytest.raises(StaleHandle):
        lm.commit([(res.pending[0], [0])])


def test_a_tree_out_of_topological_order_is_refused(saved):
    lm = HybridLM.from_pretrained(saved("mamba2")[0], max_slots=1, max_len=32)
    s = lm.pool.alloc()
    lm.prefill([s], [[1, 2, 3]])
    for parents in ((-1, 2, 0), (-1, 0, -1), (-1, 1)):
        tree = TokenTree((4, 5, 6)[:len(parents)], parents)
        with pytest.raises(ValueError, match="malformed tree"):
            lm.verify([s], [tree])
