"""Draft-ahead: a hit serves exactly the tree fresh drafting would have produced, and the draft
state stays exact through hits and misses."""
import random
import time

import pytest
import torch

from drafter_service.ahead import AheadConfig, predict
from drafter_service.engine import DraftCall, Drafter, Options
from drafter_service.state import DraftState
from treeserve.acceptance import Outcome
from treeserve.sampling import Sampling
from treeserve.tree import TokenTree

STEPS = 10


def drive(model, prompt, sampling, shape, ahead, calls=None, seed=0):
    """Run STEPS draft requests. Without `calls`, outcomes are made up: often one that draft-ahead
    prepared (a hit), otherwise a random path and bonus (a miss). Returns (replies, calls, probs
    at the final tree from the final state)."""
    d = Drafter(model, Options(shape, 10, 4, True), ahead=ahead)
    rng = random.Random(seed)
    replies, made = [], []
    try:
        d.start("s", prompt, sampling)
        call = DraftCall("s", len(prompt), (), prompt[-1])
        for step in range(STEPS):
            call = calls[step] if calls else call
            made.append(call)
            reply = d.draft(call)
            replies.append(reply)
            assert d.wait_idle(60)
            tree = reply.tree
            rnd = d._seqs["s"].round
            prepared = [j for j in rnd.jobs if j.result is not None] if rnd else []
            if prepared and rng.random() < 0.6:
                job = rng.choice(prepared)
                path, bonus = list(job.prediction.path), job.prediction.bonus
            else:
                path = [0]
                while tree.children(path[-1]) and rng.random() < 0.6:
                    path.append(rng.choice(tree.children(path[-1])))
                bonus = rng.randrange(model.vocab_size)
            appended = tuple(tree.tokens_along(path))
            call = DraftCall("s", call.committed_length + len(path), appended, bonus, Outcome(tuple(path), bonus))
        state = d._seqs["s"].state
        logits = state.logits(replies[-1].tree)  # the draft model's own numbers, before any ranking
        length = state.length
    finally:
        d.close()
    return replies, made, logits, length


@pytest.mark.parametrize("shape,sampling", [("dynamic", Sampling()), ("dynamic", Sampling(0.8, 0, 0.95, 11)),
                                            ("static", Sampling())], ids=["dynamic-greedy", "dynamic-sampling", "static"])
def test_hits_equal_fresh_drafting_and_state_stays_exact(draft_model, prompt, shape, sampling):
    slots_before = len(draft_model.lm.pool.in_use())
    ahead, calls, logits_a, length = drive(draft_model, prompt, sampling, shape, AheadConfig(trees=4, fanout=4))
    hits = [r.from_draft_ahead for r in ahead]
    assert any(hits) and not all(hits[1:])
    # the same requests with draft-ahead predicting nothing: every tree is drafted fresh
    fresh, _, logits_f, _ = drive(draft_model, prompt, sampling, shape, AheadConfig(trees=0), calls=calls)
    assert not any(r.from_draft_ahead for r in fresh)
    for a, f in zip(ahead, fresh):
        assert a.tree == f.tree
    assert torch.equal(logits_a, logits_f)
    # and the state is that of the committed tokens: compare with prefilling them from scratch
    committed = list(prompt) + [t for c in calls[1:] for t in c.appended]
    assert len(committed) == length
    ref = DraftState.open("ref", committed, sampling, None, draft_model)
    try:
        ref_logits = ref.logits(ahead[-1].tree)
    finally:
        ref.release()
    # logits, not probabilities: a token of early context left out moves the latter by ~1e-6 only
    assert torch.allclose(logits_a, ref_logits, rtol=0, atol=2e-5), (logits_a - ref_logits).abs().max()
    assert len(draft_model.lm.pool.in_use()) == slots_before  # no slot leaked by jobs


def test_predictions_are_ranked_with_geometric_fanout():
    tree = TokenTree((0, 1, 2, 3), (-1, 0, 0, 1))
    V = 8
    probs = torch.zeros(4, V)
    probs[0, [1, 2, 5]] = torch.tensor([0.6, 0.3, 0.1])
    probs[1, [3, 6, 7]] = torch.tensor([0.5, 0.3, 0.2])
    probs[2, [4, 5]] = torch.tensor([0.9, 0.1])
    probs[3, [1, 2]] = torch.tensor([0.7, 0.3])
    preds = predict(tree, probs, AheadConfig(trees=10, fanout=4))
    assert [p.prob for p in preds] == sorted((p.prob for p in preds), reverse=True)
    for p in preds:
        assert p.bonus not in {tree.tokens[c] for c in tree.children(p.path[-1])}
    by_node: dict[int, int] = {}
    for p in preds:
        by_node[p.path[-1]] = by_node.get(p.path[-1], 0) + 1
    # P(walk ends at node): 1: 0.6 * 0.5, 2: 0.3, 3: 0.3 * 1, 0: 0.1 -> at most 4, 2, 1, 1 guesses
    # (node 1 has only two tokens besides its child)
    assert by_node == {1: 2, 2: 2, 3: 1, 0: 1}
    top = preds[0]
    assert top.path == (0, 2) and top.bonus == 4 and abs(top.prob - 0.3 * 0.9) < 1e-6
    assert len(predict(tree, probs, AheadConfig(trees=2))) == 2


def test_draft_ahead_off_per_sequence(draft_model, prompt):
    d = Drafter(draft_model, Options("dynamic", 8, 3, True))
    try:
        d.start("on", prompt)
        d.start("off", prompt, options=d.options(draft_ahead=False))
        d.draft(DraftCall("on", len(prompt), (), 5))
        d.draft(DraftCall("off", len(prompt), (), 5))
        assert d._seqs["on"].round is not None and d._seqs["off"].round is None
    finally:
        d.close()


def test_forks_stay_within_their_slot_budget(draft_model, prompt):
    d = Drafter(draft_model, Options("dynamic", 8, 3, True), ahead=AheadConfig(trees=4))
    draft_model.fork_slots = 2
    try:
        d.start("f", prompt)
        reply = d.draft(DraftCall("f", len(prompt), (), 5))
        assert d.wait_idle(60)
        jobs = d._seqs["f"].round.jobs
        assert len(jobs) == 4 and sum(j.result is not None for j in jobs) == 2
        job = next(j for j in jobs if j.result is not None)
        p = job.prediction
        hit = d.draft(DraftCall("f", len(prompt) + len(p.path), job.appended, p.bonus, Outcome(p.path, p.bonus)))
        assert hit.from_draft_ahead and hit.tree.tokens[0] == p.bonus and reply.tree.tokens[0] == 5
        assert len(draft_model._forks) <= 2  # the adopted fork no longer counts
    finally:
        draft_model.fork_slots = None
        d.close()
    assert not draft_model._forks


def test_ahead_work_waits_for_a_graph_capture(draft_model, prompt):
    """While a model in this process captures a CUDA graph (it holds models.graphs.CAPTURE_LOCK), no
    draft-ahead work may launch device work: it would break the capture. Holding the lock here must
    stall the worker, and releasing it lets the round finish."""
    from models.graphs import CAPTURE_LOCK

    d = Drafter(draft_model, Options("dynamic", 8, 3, True), ahead=AheadConfig(trees=2))
    try:
        d.start("c", prompt)
        with CAPTURE_LOCK:
            d.draft(DraftCall("c", len(prompt), (), 5))  # the foreground call runs on this thread
            assert not d.wait_idle(0.5), "draft-ahead ran while a capture held the lock"
            assert not d._seqs["c"].round.finalised
        assert d.wait_idle(60)
        assert d._seqs["c"].round.finalised
    finally:
        d.close()


def test_rounds_claimed_while_the_worker_waits_at_the_gate_do_not_pile_up(draft_model, prompt):
    """Requests that keep coming hold the worker at the gate; every draft claims its sequence's
    last round and submits a new one. The claimed ones leave the worker's queue then, not when the
    worker next looks (before, they piled up for as long as the requests kept coming)."""
    d = Drafter(draft_model, Options("dynamic", 8, 3, True))
    try:
        d.start("g", prompt)
        call = DraftCall("g", len(prompt), (), 5)
        with draft_model.gate.foreground():
            for step in range(6):
                tree = d.draft(call).tree
                appended = tuple(tree.tokens_along([0]))
                call = DraftCall("g", call.committed_length + 1, appended, 7, Outcome((0,), 7))
                if step == 0:  # the worker has taken the first round and waits at the gate with it
                    deadline = time.monotonic() + 30
                    while not d.worker._busy and time.monotonic() < deadline:
                        time.sleep(0.01)
                    assert d.worker._busy
            assert len(d.worker._rounds) == 1
    finally:
        d.close()
