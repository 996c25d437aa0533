"""Request rules of the drafter engine: errors carry the right code and change nothing; other
sequences are unaffected; retries and resets behave; sequence lengths are bounded; idle sequences
are swept; concurrent starts of one id leave one state."""
import contextlib
import math
import threading
import time

import grpc
import pytest

from drafter_service.engine import DraftCall, Drafter, Options
from drafter_service.limits import NGRAM_MAX_LEN
from treeserve.acceptance import Outcome
from treeserve.errors import ServeError
from treeserve.sampling import Sampling


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(ServeError) as info:
        fn()
    return info.value.code


@pytest.fixture
def drafter(draft_model):
    d = Drafter(draft_model, Options("dynamic", 8, 3, True), max_sequences=3)
    yield d
    d.close()


def test_bad_requests_get_codes_and_change_nothing(drafter, prompt):
    L = len(prompt)
    drafter.start("a", prompt)
    first = drafter.draft(DraftCall("a", L, (), 5))
    tree = first.tree
    kid = tree.children(0)[0]
    good = DraftCall("a", L + 2, (5, tree.tokens[kid]), 9, Outcome((0, kid), 9))
    bad = {
        grpc.StatusCode.NOT_FOUND: [DraftCall("nobody", L, (), 5)],
        grpc.StatusCode.FAILED_PRECONDITION: [DraftCall("a", L + 3, good.appended, 9, good.outcome),
                                              DraftCall("a", L - 1, (), 5)],
        grpc.StatusCode.INVALID_ARGUMENT: [
            DraftCall("a", L + 2, good.appended, 9, Outcome((0, tree.size + 3), 9)),  # not a path
            DraftCall("a", L + 2, good.appended, 9, Outcome((1, kid), 9)),  # does not start at the root
            DraftCall("a", L + 2, good.appended, 8, good.outcome),  # bonus differs from the root
            DraftCall("a", L + 1, (5,), 9, Outcome((0, kid), 9)),  # path tokens differ from appended
            DraftCall("a", L + 2, good.appended, 10_000, None),  # root outside the vocabulary
            DraftCall("a", L + 2, good.appended, 9, None, node_budget=-1),
        ],
    }
    for code, calls in bad.items():
        for call in calls:
            assert code_of(lambda: drafter.draft(call)) == code, call
    assert drafter.draft(good).tree.tokens[0] == 9  # still in step after every refusal


def test_other_sequences_unaffected_and_retry_is_idempotent(draft_model, drafter, prompt):
    L = len(prompt)
    solo = Drafter(draft_model, Options("dynamic", 8, 3, True))
    try:
        solo.start("b", prompt[:-2])
        expect = solo.draft(DraftCall("b", L - 2, (), 7)).tree
    finally:
        solo.close()
    drafter.start("a", prompt)
    drafter.start("b", prompt[:-2])
    drafter.draft(DraftCall("a", L, (), 5))
    with pytest.raises(ServeError):
        drafter.draft(DraftCall("a", L + 7, (1, 2), 5))
    got = drafter.draft(DraftCall("b", L - 2, (), 7))
    assert got.tree == expect
    again = drafter.draft(DraftCall("b", L - 2, (), 7))  # a retried request: same answer, no advance
    assert again is got and drafter._seqs["b"].state.length == L - 2


def test_start_resets_limits_and_end(drafter, prompt):
    assert drafter.start("a", prompt) == len(prompt)
    drafter.draft(DraftCall("a", len(prompt), (), 5))
    assert drafter.start("a", prompt[:4], Sampling(0.7, 0, 0, 1)) == 4  # resync: a fresh state
    assert drafter.draft(DraftCall("a", 4, (), 5)).tree.draft is not None
    drafter.start("b", prompt)
    drafter.start("c", prompt)
    assert code_of(lambda: drafter.start("d", prompt)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert drafter.end("c") and not drafter.end("c")
    drafter.start("d", prompt)
    assert code_of(lambda: drafter.start("", prompt)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: drafter.start("e", [1, -3])) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: drafter.start("e", prompt, Sampling(-1.0))) == grpc.StatusCode.INVALID_ARGUMENT


def test_ngram_only_drafter_refuses_model_shapes():
    d = Drafter(None)
    assert d.defaults.shape == "ngram"
    assert code_of(lambda: d.options(shape="dynamic")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: d.options(node_budget=-2)) == grpc.StatusCode.INVALID_ARGUMENT
    assert d.options(node_budget=10_000).node_budget == d.max_nodes
    d.close()


def test_sequence_past_the_draft_models_length_is_refused_until_restarted(draft_model, prompt):
    d = Drafter(draft_model, Options("dynamic", 8, 3, False), ahead=None)
    limit = draft_model.max_len
    try:
        d.start("long", prompt)
        tree = d.draft(DraftCall("long", len(prompt), (), 5)).tree
        assert tree.size <= 8
        filler = tuple([7] * (limit - len(prompt) - 3))
        near = d.draft(DraftCall("long", limit - 3, filler, 6))
        assert near.tree.size <= 3 and max(near.tree.depths()) <= 2  # cut to the room left
        over = DraftCall("long", limit + 1, (6, 1, 2, 3), 4)
        assert code_of(lambda: d.draft(over)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert d._seqs["long"].state.length == limit - 3  # refused before the state moved
        ok = DraftCall("long", limit - 2, (6,), 4)
        assert d.draft(ok).tree.size <= 2  # so the sequence goes on in step
        d.start("long", prompt)
        assert d.draft(DraftCall("long", len(prompt), (), 5)).tree == tree
    finally:
        d.close()


def test_a_sequence_at_the_draft_models_length_drafts_a_root_and_stays_usable(draft_model, prompt, caplog):
    """Committed exactly the model's length, with draft-ahead on: every tree is the root alone
    (no position is left for a forward), nothing fails in the background, and a request with
    another budget at the same length is answered too. Before, the draft-ahead job failed on its
    forward (logged), and the second request got INTERNAL and left the sequence broken."""
    import logging

    from drafter_service.ahead import AheadConfig

    d = Drafter(draft_model, Options("dynamic", 4, 2, True), ahead=AheadConfig(2, 2), idle_timeout_s=0)
    limit = draft_model.max_len
    try:
        d.start("end", prompt)
        filler = tuple([7] * (limit - len(prompt)))
        with caplog.at_level(logging.ERROR, logger="treeserve"):
            assert d.draft(DraftCall("end", limit, filler, 6)).tree.size == 1
            d.wait_idle()
            assert d.draft(DraftCall("end", limit, (), 6, None, 2)).tree.size == 1
            d.wait_idle()
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        assert d._seqs["end"].broken is None
    finally:
        d.close()


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


class Clock:
    """A clock the test moves by hand (the drafter reads idle times from it)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def restarting(d: Drafter, sid: str):
    """Inside: a StartSequence of `sid` (with 4 tokens) is running, held up by a draft of the old
    `sid` (3 tokens) in flight; on leaving, that draft ends and the start completes."""
    d.start(sid, [1, 2, 3])
    old = d._seqs[sid]
    old.lock.acquire()
    start = threading.Thread(target=d.start, args=(sid, [1, 2, 3, 4]))
    start.start()
    try:
        wait_until(lambda: sid in d._starting)
        yield
    finally:
        old.lock.release()
        start.join(30)


def test_a_second_start_while_one_is_starting_is_refused_and_no_slot_leaks(draft_model):
    """StartSequence A for an id whose old sequence is busy waits for it; StartSequence B for the
    same id meanwhile once found nothing to replace and opened a second state, which A then
    overwrote: a slot nobody could free."""
    d = Drafter(draft_model, Options("dynamic", 4, 2, False), max_sequences=4, ahead=None)
    pool = draft_model.lm.pool
    before = len(pool.in_use())
    try:
        with restarting(d, "x"):
            assert code_of(lambda: d.start("x", [1, 2])) == grpc.StatusCode.FAILED_PRECONDITION
        assert d.active() == 1 and d._seqs["x"].state.length == 4  # A's sequence
        assert len(pool.in_use()) == before + 1
        assert d.end("x")
        assert len(pool.in_use()) == before
    finally:
        d.close()


def test_an_end_while_the_sequence_is_starting_ends_it_once_started(draft_model):
    """EndSequence while a StartSequence of the id runs (its old sequence busy): it says ended, and
    the sequence is closed once started, not installed to hold its slot until the idle sweep."""
    d = Drafter(draft_model, Options("dynamic", 4, 2, False), max_sequences=4, ahead=None, idle_timeout_s=0)
    pool = draft_model.lm.pool
    before = len(pool.in_use())
    try:
        with restarting(d, "x"):
            assert d.end("x") is True
        assert d.active() == 0 and "x" not in d._seqs
        assert len(pool.in_use()) == before
        d.start("x", [1, 2])  # and the id starts afresh
        assert d.active() == 1
    finally:
        d.close()


def test_installing_over_a_stray_entry_closes_it(draft_model):
    d = Drafter(draft_model, Options("chain", 4, 2, False), max_sequences=4, ahead=None)
    pool = draft_model.lm.pool
    before = len(pool.in_use())
    try:
        d.start("x", [1, 2, 3])
        d.start("y", [4, 5])
        fresh = d._seqs.pop("y")
        fresh.id = "x"
        d._install(fresh)  # as if another call had put "x" back meanwhile
        assert d.active() == 1 and d._seqs["x"].state.length == 2
        assert len(pool.in_use()) == before + 1  # the stray one's slot is free
    finally:
        d.close()
    assert len(pool.in_use()) == before


class Huge:
    """Tokens that claim to be many and must not be walked."""

    def __len__(self):
        return 10**7

    def __iter__(self):
        raise AssertionError("the tokens were walked before their length was checked")


def test_an_ngram_sequence_is_bounded_by_max_len():
    assert Drafter(None, idle_timeout_s=0).max_len == NGRAM_MAX_LEN
    d = Drafter(None, max_len=16, idle_timeout_s=0)
    assert code_of(lambda: d.start("a", list(range(17)))) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: d.start("a", Huge())) == grpc.StatusCode.INVALID_ARGUMENT
    tokens = [1, 2, 3] * 5 + [1]
    assert d.start("a", tokens) == 16  # exactly at the limit: kept
    at_limit = d.draft(DraftCall("a", 16, (), 2))
    assert at_limit.tree.tokens[:3] == (2, 3, 1)
    assert code_of(lambda: d.draft(DraftCall("a", 17, (2,), 3))) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert d._seqs["a"].state.length == 16  # refused before the history grew
    assert d.draft(DraftCall("a", 16, (), 2)) is at_limit  # still in step
    d.close()


def test_a_model_drafter_takes_the_models_length(draft_model):
    d = Drafter(draft_model, max_len=5, idle_timeout_s=0)
    assert d.max_len == draft_model.max_len
    d.close()


@pytest.mark.parametrize("kwargs", [dict(max_sequences=0), dict(max_nodes=0), dict(support=0), dict(max_len=0),
                                    dict(idle_timeout_s=-1.0), dict(idle_timeout_s=math.nan)])
def test_numbers_that_would_break_the_drafter_later_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Drafter(None, **kwargs)


def test_idle_sequences_and_their_draft_ahead_forks_are_swept(draft_model, prompt):
    clock = Clock()
    pool = draft_model.lm.pool
    before = len(pool.in_use())
    d = Drafter(draft_model, Options("dynamic", 8, 3, True), max_sequences=3, idle_timeout_s=10.0, clock=clock,
                background_sweep=False)
    try:
        L = len(prompt)
        d.start("a", prompt)
        d.start("b", prompt)
        d.draft(DraftCall("b", L, (), 5))
        assert d.wait_idle()
        assert len(pool.in_use()) > before + 2  # b's prepared outcomes hold forked slots
        clock.now = 6.0
        d.draft(DraftCall("a", L, (), 5))  # a draft touches "a"
        clock.now = 10.0
        assert d.sweep() == []  # not past the timeout yet
        clock.now = 12.0
        assert d.sweep() == ["b"]
        assert d.active() == 1
        assert code_of(lambda: d.draft(DraftCall("b", L, (), 5))) == grpc.StatusCode.NOT_FOUND
        assert d.wait_idle()
        clock.now = 30.0
        assert d.sweep() == ["a"]
        assert d.active() == 0 and len(pool.in_use()) == before  # own slots and forks
        d.start("b", prompt)  # the id is free again
    finally:
        d.close()
    assert len(pool.in_use()) == before


def test_a_sequence_whose_request_is_running_is_not_idle():
    clock = Clock()
    d = Drafter(None, idle_timeout_s=5.0, clock=clock, background_sweep=False)
    d.start("a", [1, 2, 3])
    busy = d._seqs["a"]
    clock.now = 100.0
    with busy.lock:  # a draft of "a" in progress
        assert d.sweep() == []
    assert d.sweep() == ["a"]
    assert Drafter(None, idle_timeout_s=0, clock=clock).sweep() == []  # 0: never


def test_the_sweep_runs_on_its_own():
    d = Drafter(None, idle_timeout_s=0.2)
    try:
        d.start("a", [1, 2, 3])
        wait_until(lambda: d.active() == 0)
    finally:
        d.close()


def _counted(method, calls: list, name: str):
    def counted(*args, **kwargs):
        calls.append(name)
        return method(*args, **kwargs)
    return counted


def _same_tree(a, b) -> None:
    """Equal tokens and parents; draft distributions equal within float rounding (the model's
    state reached by other passes)."""
    assert (a.tokens, a.parents) == (b.tokens, b.parents)
    assert (a.draft is None) == (b.draft is None)
    for da, db in zip(a.draft or (), b.draft or ()):
        assert (da is None) == (db is None)
        if da is not None:
            assert da.tokens == db.tokens
            assert da.probs == pytest.approx(db.probs, abs=1e-5)


def test_a_tree_of_another_shape_costs_the_model_nothing_and_drafting_with_it_catches_up(draft_model, drafter,
                                                                                          prompt, monkeypatch):
    """A sequence started with the model's dynamic shape asks for an n-gram tree: it is the n-gram
    drafter's tree for the same text, no forward pass runs (the tokens wait in `behind`), and the
    draft-ahead tree prepared meanwhile is not taken. Its next dynamic tree, after the model
    caught up on every token it missed, is the tree of a sequence started with all of them."""
    L = len(prompt)
    drafter.start("a", prompt)
    first = drafter.draft(DraftCall("a", L, (), 5)).tree
    kid = first.children(0)[0]
    appended = (5, first.tokens[kid])
    drafter.wait_idle()
    passes = []
    for name in ("verify", "grow", "advance"):
        monkeypatch.setattr(draft_model, name, _counted(getattr(draft_model, name), passes, name))
    misses = drafter.metrics.ahead_misses
    lookup = drafter.draft(DraftCall("a", L + 2, appended, 9, Outcome((0, kid), 9), shape="ngram"))
    assert passes == [] and drafter._seqs["a"].state.behind == list(appended)
    assert drafter.metrics.ahead_misses == misses  # it could not have been prepared: not a miss
    assert not lookup.from_draft_ahead and lookup.tree.draft is None
    only_ngram = Drafter(None, Options("ngram", 8, 3, False))
    try:
        only_ngram.start("a", list(prompt) + list(appended))
        assert lookup.tree == only_ngram.draft(DraftCall("a", L + 2, (), 9)).tree
    finally:
        only_ngram.close()
    more = (9, 11, 12)  # past the n-gram tree: tokens the model decodes when it catches up
    got = drafter.draft(DraftCall("a", L + 5, more, 13)).tree
    assert drafter._seqs["a"].state.behind == [] and passes[0] == "advance"
    monkeypatch.undo()
    fresh = Drafter(draft_model, Options("dynamic", 8, 3, False))
    try:
        fresh.start("a", list(prompt) + list(appended) + list(more))
        _same_tree(got, fresh.draft(DraftCall("a", L + 5, (), 13)).tree)
    finally:
        fresh.close()


def test_a_trees_shape_the_sequence_cannot_serve_is_refused_and_changes_nothing(draft_model, drafter, prompt):
    L = len(prompt)
    drafter.start("a", prompt)
    drafter.start("n", prompt, options=Options("ngram", 8, 3, False))
    for call in (DraftCall("a", L, (), 5, shape="fused"), DraftCall("a", L, (), 5, shape="cubic"),
                 DraftCall("n", L, (), 5, shape="dynamic")):
        assert code_of(lambda: drafter.draft(call)) == grpc.StatusCode.INVALID_ARGUMENT, call
    assert drafter.draft(DraftCall("a", L, (), 5, shape="chain")).tree.size > 1  # a model shape that picks alike
    assert drafter.draft(DraftCall("n", L, (), 5)).tree.tokens[0] == 5
