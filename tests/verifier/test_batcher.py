"""The model thread in-process: packing, splitting, cancelled callers, the idle sweep."""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from treeserve.errors import status_of
from treeserve.sampling import Sampling
from treeserve.tree import TokenTree
from verifier_service.batcher import Batcher
from verifier_service.engine import Engine, VerifyWork
from verifier_service.limits import Limits


@pytest.fixture()
def make(tiny_pair):
    """make(**limits) -> (engine, batcher); the batcher is not started and is stopped afterwards."""
    from models import HybridLM

    made = []

    def build(**kw):
        limits = Limits(**{"max_sequences": 8, "max_tree_nodes": 16, "max_sequence_length": 128, **kw})
        lm = HybridLM.from_pretrained(tiny_pair[0], max_slots=limits.max_sequences, max_len=limits.max_sequence_length)
        engine = Engine(lm, limits)
        batcher = Batcher(engine, limits)
        made.append(batcher)
        return engine, batcher

    yield build
    for b in made:
        b.stop()


def _prefill(engine, n, prefix="s"):
    out = []
    for k in range(n):
        sid = f"{prefix}{k}"
        L, root = engine.prefill(sid, tuple(range(1 + k, 6 + k)), Sampling())
        out.append((sid, L, root))
    return out


def test_queued_items_share_one_forward_and_match_solo_answers(make):
    engine, batcher = make()
    seqs = _prefill(engine, 5)
    trees = [TokenTree.chain([root] + list(range(10 + k, 10 + 2 * k))) for k, (_, _, root) in enumerate(seqs)]
    # two requests (as from two RPCs) queued while the model thread is not running yet
    f1 = batcher.verify([VerifyWork(sid, L, t) for (sid, L, _), t in zip(seqs[:2], trees[:2])])
    f2 = batcher.verify([VerifyWork(sid, L, t) for (sid, L, _), t in zip(seqs[2:], trees[2:])])
    batcher.start()
    r1, r2 = f1.result(30), f2.result(30)
    assert engine.forward_passes == 1
    assert r1.batch_sequences == r2.batch_sequences == 5
    assert r1.forward_ms > 0 and r1.forward_ms == r2.forward_ms
    batched = [o.result.target_tokens for o in r1.outputs + r2.outputs]
    solo = [engine.verify([VerifyWork(sid, L, t)]).outputs[0].result.target_tokens for (sid, L, _), t in zip(seqs, trees)]
    assert batched == solo


def test_limits_split_batches(make):
    engine, batcher = make(max_batch=2)
    seqs = _prefill(engine, 5)
    fut = batcher.verify([VerifyWork(sid, L, TokenTree.single(root)) for sid, L, root in seqs])
    batcher.start()
    reply = fut.result(30)
    assert all(o.error is None for o in reply.outputs)
    assert engine.forward_passes == 3 and reply.batch_sequences == 2

    engine, batcher = make(max_batch_nodes=20)
    seqs = _prefill(engine, 3)
    fut = batcher.verify([VerifyWork(sid, L, TokenTree.chain([root] + [7] * 9)) for sid, L, root in seqs])
    batcher.start()
    assert all(o.error is None for o in fut.result(30).outputs)
    assert engine.forward_passes == 2  # 10 + 10 nodes, then 10


def test_one_sequence_twice_goes_to_two_forwards(make):
    engine, batcher = make()
    ((sid, L, root),) = _prefill(engine, 1)
    tree = TokenTree.chain([root, 4, 5])
    a = batcher.verify([VerifyWork(sid, L, tree)])
    b = batcher.verify([VerifyWork(sid, L + 2, TokenTree.single(9), commit=(L, (0, 1)))])
    batcher.start()
    assert a.result(30).outputs[0].error is None
    out = b.result(30).outputs[0]
    assert out.error is None and out.committed_length == L + 2
    assert engine.forward_passes == 2


def test_items_of_departed_callers_never_reach_the_model(make):
    engine, batcher = make()
    ((sid, L, root),) = _prefill(engine, 1)
    gone = batcher.verify([VerifyWork(sid, L, TokenTree.single(root))], alive=lambda: False)
    op = batcher.submit(engine.release, sid, alive=lambda: False)
    batcher.start()
    assert gone.result(30).outputs[0].error.code == grpc.StatusCode.CANCELLED
    with pytest.raises(Exception) as e:
        op.result(30)
    assert e.value.code == grpc.StatusCode.CANCELLED
    assert engine.forward_passes == 0 and sid in engine.table


def test_idle_sequences_are_swept(make):
    engine, batcher = make(idle_timeout_s=2.0)
    _prefill(engine, 2)
    slots_before = len(engine.lm.pool.in_use())
    batcher.start()
    # keep one sequence busy (touched 40 times within its idle bound), let the other go idle
    deadline = time.monotonic() + 30
    while "s1" in engine.table and time.monotonic() < deadline:
        batcher.submit(engine.commit, "s0", 5, (0,)).exception(10)  # refused (no tree), but a touch
        time.sleep(0.05)
    assert "s1" not in engine.table and "s0" in engine.table
    assert len(engine.lm.pool.in_use()) == slots_before - 1


def test_stop_refuses_new_work(make):
    engine, batcher = make()
    batcher.start()
    batcher.stop()
    fut = batcher.submit(len, ())
    assert fut.exception(5).code == grpc.StatusCode.UNAVAILABLE


def test_bearer_token_is_required(tiny_pair):
    from models import HybridLM
    from verifier_service.client import VerifierClient
    from verifier_service.servicer import ModelInfo, VerifierServer

    lm = HybridLM.from_pretrained(tiny_pair[0], max_slots=2, max_len=64)
    srv = VerifierServer(lm, Limits(max_sequences=2, max_tree_nodes=8, max_sequence_length=64), "127.0.0.1:0",
                         ModelInfo("target", "cpu", (0,)), auth_token="s3cret")
    try:
        address = f"127.0.0.1:{srv.port}"
        with VerifierClient(address, timeout=30) as anonymous:
            with pytest.raises(grpc.RpcError) as e:
                anonymous.stats()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with VerifierClient(address, auth_token="s3cret", timeout=30) as c:
            assert c.prefill("a", [1, 2, 3])[0] == 3
            assert c.stats().active_sequences == 1
    finally:
        srv.stop()


def test_window_waits_only_for_expected_company(make):
    engine, batcher = make(batch_window_ms=3000)
    (a, La, ra), (b, Lb, rb), _ = _prefill(engine, 3)
    one = {a: VerifyWork(a, La, TokenTree.single(ra)), b: VerifyWork(b, Lb, TokenTree.single(rb))}
    # s0 and s1 come in separate requests and share a forward (queued before the model thread starts)
    first = [batcher.verify([one[a]]), batcher.verify([one[b]])]
    batcher.start()
    assert [f.result(30).batch_sequences for f in first] == [2, 2]
    # s0 comes back first and waits for s1, which follows shortly (each from its own thread, as
    # RPCs come: a caller that finds the model free runs it itself)
    with ThreadPoolExecutor(2) as rpc:
        fa = rpc.submit(lambda: batcher.verify([one[a]]).result(30))
        time.sleep(0.2)
        fb = rpc.submit(lambda: batcher.verify([one[b]]).result(30))
        assert fa.result(30).batch_sequences == fb.result(30).batch_sequences == 2
    # a caller that sent s0 and s1 together and now sends s0 alone is done with s1 (its Release may
    # still be on the way): no wait; nor for s0 alone with the other live sequences idle
    assert batcher.verify([one[a], one[b]]).result(30).batch_sequences == 2
    t = time.monotonic()
    for _ in range(3):
        assert batcher.verify([one[a]]).result(30).batch_sequences == 1
    assert time.monotonic() - t < 2.5  # three forwards of a tiny model, no 3 s window


def test_window_opens_when_the_model_comes_free(make):
    """Clients that fell out of step (one arriving while the other's forward runs) share again."""
    engine, batcher = make(batch_window_ms=2000)
    (a, La, ra), (b, Lb, rb) = _prefill(engine, 2)
    one = {a: VerifyWork(a, La, TokenTree.single(ra)), b: VerifyWork(b, Lb, TokenTree.single(rb))}
    first = [batcher.verify([one[a]]), batcher.verify([one[b]])]  # separate requests, one forward
    batcher.start()
    assert [f.result(30).batch_sequences for f in first] == [2, 2]
    with ThreadPoolExecutor(3) as rpc:
        held, release = _hold_model(rpc, batcher)  # stands in for b's forward
        fa = rpc.submit(lambda: batcher.verify([one[a]]).result(30))
        _wait_queued(batcher, 1)
        time.sleep(2.1)  # s0 has been queued for longer than the window
        release.set()
        time.sleep(0.05)
        fb = rpc.submit(lambda: batcher.verify([one[b]]).result(30))
        assert held.result(30) is True
        assert fa.result(30).batch_sequences == fb.result(30).batch_sequences == 2


def _hold_model(rpc, batcher):
    """Submit, through `rpc` (a thread pool standing in for gRPC's), an operation that holds the
    model until released; returns (the future of its result: True once released, the release
    event), once the operation runs."""
    holding, release = threading.Event(), threading.Event()

    def hold():
        holding.set()
        return release.wait(30)

    held = rpc.submit(lambda: batcher.submit(hold).result(30))
    assert holding.wait(10)
    return held, release


def _wait_queued(batcher, n):
    """Wait (up to 10 s) until at least `n` requests are queued for the model."""
    deadline = time.monotonic() + 10
    while batcher.queued < n:
        time.sleep(0.01)
        assert time.monotonic() < deadline


def _record_threads(engine):
    """Wrap engine.verify to log (thread, sequences) per forward; returns the log."""
    calls: list[tuple[threading.Thread, int]] = []
    verify = engine.verify

    def logged(works):
        calls.append((threading.current_thread(), len(works)))
        return verify(works)

    engine.verify = logged
    return calls


def test_a_lone_request_runs_at_once_on_the_callers_thread(make):
    engine, batcher = make(batch_window_ms=2000)
    (a, La, ra), (b, Lb, rb), _ = _prefill(engine, 3)  # the third live sequence stays idle
    calls = _record_threads(engine)
    batcher.start()
    # a lone client; then an orchestrator-like caller that drops a sequence it sent last time
    for works in ([(a, La, ra)], [(a, La, ra)], [(a, La, ra), (b, Lb, rb)], [(a, La, ra)]):
        t = time.monotonic()
        fut = batcher.verify([VerifyWork(sid, L, TokenTree.chain([root, 7, 8])) for sid, L, root in works])
        elapsed = time.monotonic() - t
        assert fut.done(), "the model was free: the caller should have run the forward itself"
        reply = fut.result(0)
        assert all(o.error is None for o in reply.outputs) and reply.batch_sequences == len(works)
        assert reply.timing.inline and reply.timing.forward == reply.forward_ms > 0
        waited = elapsed - reply.forward_ms / 1e3  # the first forward of a fresh model is slow
        # no 2 s window waited (the bound leaves room for a busy machine's scheduling)
        assert reply.timing.queue < 1000 and waited < 1.0, f"{len(works)} sequence(s) waited {waited:.3f} s"
    assert calls == [(threading.current_thread(), 1)] * 2 + [(threading.current_thread(), 2), (threading.current_thread(), 1)]
    # operations too: a commit runs on this thread and is done on return
    op = batcher.submit(engine.commit, a, La, (0, 1))
    assert op.done() and op.result(0) == La + 2


def test_run_hands_a_lone_callers_reply_over_directly_and_leaves_metrics_for_after(make):
    """`run` (the servicer's way in): a request that finds the model free gets its VerifyReply back
    with no Future; the forward's metrics are recorded by `reply.after()`, which `verify` runs
    itself. Work that has to queue gets a Future, its metrics recorded by whoever ran it."""
    from concurrent.futures import Future

    from verifier_service.batcher import VerifyReply
    from verifier_service.metrics import metrics

    engine, batcher = make(batch_window_ms=0)
    (a, La, ra), (b, Lb, rb) = _prefill(engine, 2)
    batcher.start()
    passes = metrics().forward_passes
    before = passes._value.get()
    reply = batcher.run([VerifyWork(a, La, TokenTree.single(ra)), VerifyWork(b, Lb, TokenTree.single(rb))])
    assert isinstance(reply, VerifyReply) and reply.timing.inline and reply.batch_sequences == 2
    assert engine.forward_passes == 1 and passes._value.get() == before  # not yet recorded
    reply.after()
    assert passes._value.get() == before + 1
    # through `verify`: the same, recorded before it returns
    fut = batcher.verify([VerifyWork(a, La + 1, TokenTree.single(reply.outputs[0].result.target_tokens[0]),
                                     commit=(La, (0,)))])
    assert fut.done() and fut.result(0).outputs[0].error is None
    assert passes._value.get() == before + 2
    # with the model held elsewhere, the work queues: a Future, recorded by the thread that ran it
    with ThreadPoolExecutor(2) as rpc:
        held, release = _hold_model(rpc, batcher)
        got = batcher.run([VerifyWork(b, Lb + 1, TokenTree.single(reply.outputs[1].result.target_tokens[0]),
                                      commit=(Lb, (0,)))])
        assert isinstance(got, Future) and not got.done()
        release.set()
        assert got.result(30).outputs[0].error is None and not got.result(0).timing.inline
        assert passes._value.get() == before + 3


def test_requests_arriving_while_the_model_is_busy_share_the_next_forward(make):
    engine, batcher = make(batch_window_ms=0)
    seqs = _prefill(engine, 4)
    calls = _record_threads(engine)
    batcher.start()
    with ThreadPoolExecutor(5) as rpc:
        # an operation holds the model (on its caller's thread) until released
        held, release = _hold_model(rpc, batcher)
        futs = [rpc.submit(lambda s=s: batcher.verify([VerifyWork(s[0], s[1], TokenTree.single(s[2]))]).result(30))
                for s in seqs]
        _wait_queued(batcher, len(seqs))
        release.set()
        assert held.result(30) is True
        replies = [f.result(30) for f in futs]
    assert [r.batch_sequences for r in replies] == [4] * 4
    assert all(r.outputs[0].error is None and not r.timing.inline for r in replies)
    assert len(calls) == 1 and calls[0][1] == 4
    assert calls[0][0].name == "verifier-model"  # the caller that held the model handed the rest over


def test_stop_while_a_caller_holds_the_model_finishes_what_was_queued(make):
    engine, batcher = make()
    ((sid, L, root),) = _prefill(engine, 1)
    batcher.start()
    with ThreadPoolExecutor(3) as rpc:
        held, release = _hold_model(rpc, batcher)
        queued = rpc.submit(lambda: batcher.verify([VerifyWork(sid, L, TokenTree.single(root))]).result(30))
        _wait_queued(batcher, 1)
        stopping = rpc.submit(batcher.stop)
        time.sleep(0.05)
        release.set()
        stopping.result(30)
        assert held.result(30) is True
        assert queued.result(30).outputs[0].error is None
    assert batcher.verify([VerifyWork(sid, L, TokenTree.single(root))]).result(5).outputs[0].error.code == grpc.StatusCode.UNAVAILABLE


def test_only_a_few_threads_run_the_model_themselves(make):
    from verifier_service.batcher import INLINE_THREADS

    engine, batcher = make()
    ((sid, L, root),) = _prefill(engine, 1)
    calls = _record_threads(engine)
    batcher.start()
    finish = threading.Event()
    callers = []

    def call(called: threading.Event) -> None:
        batcher.verify([VerifyWork(sid, L, TokenTree.single(root))]).result(30)
        called.set()
        finish.wait(30)  # stay alive, as pool threads do (a finished thread's id may be reused)

    try:
        for _ in range(INLINE_THREADS + 2):  # one more thread per request, as a growing RPC pool
            called = threading.Event()
            callers.append(threading.Thread(target=call, args=(called,)))
            callers[-1].start()
            assert called.wait(30)
    finally:
        finish.set()
        for t in callers:
            t.join(30)
    ran_on = [c[0] for c in calls]
    assert ran_on[:INLINE_THREADS] == callers[:INLINE_THREADS]
    assert [t.name for t in ran_on[INLINE_THREADS:]] == ["verifier-model"] * 2


def test_threads_that_ended_give_their_place_as_runners_up(make):
    """Direct-port connections each run on a thread of their own, which ends with the connection:
    once INLINE_THREADS of them have come and gone, a new one still runs its forwards itself."""
    from verifier_service.batcher import INLINE_THREADS

    engine, batcher = make()
    ((sid, L, root),) = _prefill(engine, 1)
    batcher.start()
    inline = []

    def call() -> None:
        inline.append(batcher.verify([VerifyWork(sid, L, TokenTree.single(root))]).result(30).timing.inline)

    def connection() -> None:  # a thread that calls once and ends
        t = threading.Thread(target=call)
        t.start()
        t.join(30)

    for _ in range(INLINE_THREADS):
        connection()
    # a new thread may get an ended one's id back, which would hide the rule: the places are taken
    # by ids no live thread has
    batcher._runners = set(range(1, INLINE_THREADS + 1))
    connection()
    assert inline == [True] * (INLINE_THREADS + 1)
    assert len(batcher._runners) == 1


def test_after_a_burst_the_pool_gives_calls_to_threads_that_may_run_the_model(make):
    """When the thread that came free last may not run the model (the runners are all taken), a
    lone call still goes to one that may, so it needs no hand-off to the model thread."""
    from verifier_service.batcher import INLINE_THREADS
    from verifier_service.pool import LifoExecutor

    engine, batcher = make()
    ((sid, L, root),) = _prefill(engine, 1)
    batcher.start()
    n = INLINE_THREADS + 2
    pool = LifoExecutor(n, name="burst", prefer=batcher.is_runner)

    def verify():
        return batcher.verify([VerifyWork(sid, L, TokenTree.single(root))]).result(30)

    go, ran, release = ([threading.Event() for _ in range(n)] for _ in range(3))
    inline = [None] * n

    def hold(k):
        go[k].wait(30)
        if k < INLINE_THREADS:  # these threads run the model themselves and become its runners
            inline[k] = verify().timing.inline
        ran[k].set()
        release[k].wait(30)

    try:
        held = [pool.submit(hold, k) for k in range(n)]  # n threads, all busy
        for k in range(n):  # one at a time, so each finds the model free
            go[k].set()
            assert ran[k].wait(30)
        assert inline[:INLINE_THREADS] == [True] * INLINE_THREADS
        for k in range(n):  # the runners come free first; the last one free may not run the model
            release[k].set()
            held[k].result(30)
            deadline = time.monotonic() + 10
            while len(pool._idle) < k + 1:
                assert time.monotonic() < deadline
                time.sleep(0.001)
        assert pool.submit(verify).result(30).timing.inline
    finally:
        pool.shutdown()


def watch_waits(batcher) -> threading.Event:
    """Set once the batcher waits in a batching window for company (a `_take` with a timeout,
    not a look at what is queued)."""
    waited = threading.Event()
    take = batcher._take

    def watched_take(timeout):
        if timeout > 0:
            waited.set()
        return take(timeout)

    batcher._take = watched_take
    return waited


@pytest.mark.parametrize("limits, tree_nodes", [({"max_batch": 2}, 1), ({"max_batch_nodes": 20}, 10)],
                         ids=["items", "nodes"])
def test_a_request_split_over_forwards_does_not_wait_for_itself(make, limits, tree_nodes):
    """One caller's request of three sequences, more than one forward takes, step after step: the
    forward after a split never waits in the window for the part of the same request behind it
    (it once took the other part for a caller still to come, and waited the whole window)."""
    engine, batcher = make(batch_window_ms=60_000, **limits)
    seqs = _prefill(engine, 3)
    works = [VerifyWork(sid, L, TokenTree.chain([root] + [7] * (tree_nodes - 1))) for sid, L, root in seqs]
    waits = watch_waits(batcher)
    batcher.start()
    for _ in range(3):
        reply = batcher.verify(works).result(30)
        assert all(o.error is None for o in reply.outputs)
    assert engine.forward_passes == 6
    assert not waits.is_set()


def two_in_one_forward(make):
    """A started batcher with an endless window whose first forward took s0 and s1, each from a
    request of its own: -> (batcher, (s0, s1), {sid: its one-node VerifyWork})."""
    engine, batcher = make(batch_window_ms=math.inf)
    (a, La, ra), (b, Lb, rb) = _prefill(engine, 2)
    one = {a: VerifyWork(a, La, TokenTree.single(ra)), b: VerifyWork(b, Lb, TokenTree.single(rb))}
    first = [batcher.verify([one[a]]), batcher.verify([one[b]])]  # separate requests, one forward
    batcher.start()
    assert [f.result(30).batch_sequences for f in first] == [2, 2]
    return batcher, (a, b), one


def test_an_endless_window_waits_without_overflow_until_its_company_comes(make):
    """Limits built without validation (an infinite window): the window's wait is capped at what a
    lock wait takes (threading.TIMEOUT_MAX), where it once raised OverflowError on the thread
    holding the model. s0 comes back alone, waits for s1, and they share the forward."""
    batcher, (a, b), one = two_in_one_forward(make)
    in_window = watch_waits(batcher)
    with ThreadPoolExecutor(2) as rpc:
        fa = rpc.submit(lambda: batcher.verify([one[a]]).result(30))
        assert in_window.wait(10), "s0 should wait in its window for s1"
        fb = rpc.submit(lambda: batcher.verify([one[b]]).result(30))
        ra_, rb_ = fa.result(30), fb.result(30)
    assert ra_.outputs[0].error is None and rb_.outputs[0].error is None
    assert ra_.batch_sequences == rb_.batch_sequences == 2


def test_a_shutdown_ends_the_wait_for_company(make):
    """s0 comes back alone and waits (an endless window) for s1, which the previous forward had
    from another request; a shutdown begins (`hurry`, what the server calls as it stops): s0's
    forward goes at once, within the calls' grace, and no later forward waits."""
    batcher, (a, b), one = two_in_one_forward(make)
    in_window = watch_waits(batcher)
    with ThreadPoolExecutor(1) as rpc:
        alone = rpc.submit(lambda: batcher.verify([one[a]]).result(30))
        assert in_window.wait(10), "s0 should wait in its window for s1"
        batcher.hurry()
        reply = alone.result(30)
    assert reply.outputs[0].error is None and reply.batch_sequences == 1
    assert batcher.verify([one[a]]).result(30).batch_sequences == 1  # and the next does not wait


def test_the_model_thread_outlives_an_exception_while_it_gathers_a_batch(make):
    """A bug while the model thread gathers a batch (here the OverflowError an endless window once
    raised) fails that batch's caller with INTERNAL; the thread logs it and serves the next."""
    engine, batcher = make(batch_window_ms=0)
    (a, La, ra), (b, Lb, rb) = _prefill(engine, 2)
    calls = _record_threads(engine)
    take = batcher._take
    failed: list[float] = []

    def take_failing_once(timeout):
        if not failed:
            failed.append(timeout)
            raise OverflowError("timestamp out of range for platform time_t")
        return take(timeout)

    batcher._take = take_failing_once
    # queued before the model thread starts, so that it is the one to run them
    fa = batcher.verify([VerifyWork(a, La, TokenTree.single(ra))])
    fb = batcher.verify([VerifyWork(b, Lb, TokenTree.single(rb))])
    batcher.start()
    (out_a,) = fa.result(30).outputs
    assert isinstance(out_a.error, OverflowError) and status_of(out_a.error)[0] == grpc.StatusCode.INTERNAL
    (out_b,) = fb.result(30).outputs
    assert out_b.error is None and out_b.result.target_tokens
    assert [(t.name, n) for t, n in calls] == [("verifier-model", 1)]


def test_a_failing_liveness_check_fails_only_its_own_caller(make):
    """`alive` is the caller's code: when it raises, that caller's item or operation gets the
    error (INTERNAL), and the model thread, which asked, goes on with the rest of the queue."""
    engine, batcher = make(batch_window_ms=0)
    (a, La, ra), (b, Lb, rb) = _prefill(engine, 2)

    def broken() -> bool:
        raise RuntimeError("liveness check broke")

    # queued before the model thread starts, so that it is the one to run them
    fa = batcher.verify([VerifyWork(a, La, TokenTree.single(ra))], alive=broken)
    fop = batcher.submit(len, (), alive=broken)
    fb = batcher.verify([VerifyWork(b, Lb, TokenTree.single(rb))])
    batcher.start()
    (out_a,) = fa.result(30).outputs
    assert isinstance(out_a.error, RuntimeError) and status_of(out_a.error)[0] == grpc.StatusCode.INTERNAL
    assert isinstance(fop.exception(30), RuntimeError)
    assert fb.result(30).outputs[0].error is None


def test_sequences_whose_commit_failed_midway_are_released_not_committed_twice(make, monkeypatch):
    """Two sequences' piggy-backed commits fail in the runtime after the state moved (a device
    error, injected): each item gets FAILED_PRECONDITION and its sequence is released (its state
    is unknown), where the retry one by one once applied each commit a second time and answered OK."""
    from models import verify as verify_module
    from treeserve.errors import FailedPrecondition

    engine, _ = make()
    seqs = _prefill(engine, 2)
    trees = {sid: TokenTree.chain([root, 4, 5]) for sid, _, root in seqs}
    engine.verify([VerifyWork(sid, L, trees[sid]) for sid, L, _ in seqs])
    run_commit = verify_module.run_commit

    def fails_after_running(*args, **kwargs):
        run_commit(*args, **kwargs)
        raise RuntimeError("device error")

    monkeypatch.setattr(verify_module, "run_commit", fails_after_running)
    report = engine.verify([VerifyWork(sid, L + 2, TokenTree.single(9), commit=(L, (0, 1))) for sid, L, _ in seqs])
    for out in report.outputs:
        assert isinstance(out.error, FailedPrecondition) and "prefill it again" in str(out.error)
    assert len(engine.table) == 0
