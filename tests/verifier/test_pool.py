"""The RPC thread pool: results and errors, the most recently idle thread goes first, the worker
limit with tasks waiting in order, shutdown."""
from __future__ import annotations

import threading
import time

import pytest

from verifier_service.pool import LifoExecutor


@pytest.fixture()
def pool():
    p = LifoExecutor(3, name="t")
    yield p
    p.shutdown()


def _fail():
    raise KeyError("boom")


def _idle(pool, n: int) -> None:
    """Wait until n threads are idle (a future is done a moment before its thread is idle)."""
    deadline = time.monotonic() + 10
    while len(pool._idle) < n:
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_results_and_errors_reach_the_futures(pool):
    assert pool.submit(pow, 2, 10).result(10) == 1024
    assert pool.submit(dict, a=1).result(10) == {"a": 1}
    with pytest.raises(KeyError):
        pool.submit(_fail).result(10)


def test_calls_one_at_a_time_stay_on_one_thread(pool):
    # make all three threads: three tasks that wait for each other
    gate = threading.Barrier(3)
    assert len({f.result(10) for f in [pool.submit(lambda: (gate.wait(10), threading.get_ident())[1]) for _ in range(3)]}) == 3
    ran = []
    for _ in range(20):
        _idle(pool, 3)  # as between calls: everyone is idle again
        ran.append(pool.submit(threading.get_ident).result(10))
    assert len(set(ran)) == 1  # a round-robin pool would visit all three


def _free_in_order(pool, order) -> list[int]:
    """Occupy len(order) threads, then let them come free in `order`; their idents in that order."""
    release = [threading.Event() for _ in order]
    started = [threading.Event() for _ in order]

    def hold(k):
        started[k].set()
        release[k].wait(10)
        return threading.get_ident()

    futs = [pool.submit(hold, k) for k in range(len(order))]
    assert all(s.wait(10) for s in started)
    idents = []
    for n, k in enumerate(order):
        release[k].set()
        idents.append(futs[k].result(10))
        _idle(pool, n + 1)
    return idents


def test_most_recently_idle_thread_goes_first(pool):
    idents = _free_in_order(pool, (2, 0, 1))
    # the last one free (task 1's thread) takes the next task
    assert pool.submit(threading.get_ident).result(10) == idents[-1]


def test_a_preferred_idle_thread_goes_before_more_recently_idle_ones():
    preferred: set[int] = set()
    pool = LifoExecutor(3, name="p", prefer=preferred.__contains__)
    try:
        idents = _free_in_order(pool, (2, 0, 1))
        preferred.add(idents[0])  # the first to come free, now the least recently idle
        assert pool.submit(threading.get_ident).result(10) == idents[0]
        _idle(pool, 3)
        preferred.clear()  # no preferred thread: the most recently idle (the one that just ran)
        assert pool.submit(threading.get_ident).result(10) == idents[0]
    finally:
        pool.shutdown()


def test_threads_up_to_the_limit_then_tasks_wait_in_order(pool):
    release = threading.Event()
    started = threading.Barrier(4)
    holders = [pool.submit(lambda: (started.wait(10), release.wait(10))) for _ in range(3)]
    started.wait(10)  # all three threads are busy
    more = [pool.submit(threading.get_ident) for _ in range(4)]
    assert not any(f.done() for f in more)
    release.set()
    for f in holders + more:
        f.result(10)
    assert len(pool._threads) == 3

    one = LifoExecutor(1)
    try:
        gate = threading.Event()
        first = one.submit(gate.wait, 10)
        order: list[int] = []
        waiting = [one.submit(order.append, k) for k in range(5)]
        gate.set()
        for f in [first, *waiting]:
            f.result(10)
        assert order == list(range(5))
    finally:
        one.shutdown()


def test_shutdown_finishes_queued_work_and_refuses_new():
    p = LifoExecutor(1)
    release = threading.Event()
    first = p.submit(release.wait, 10)
    queued = p.submit(lambda: "done")
    closer = threading.Thread(target=p.shutdown)
    closer.start()
    release.set()
    closer.join(10)
    assert not closer.is_alive()
    assert first.result(0) is True and queued.result(0) == "done"
    with pytest.raises(RuntimeError):
        p.submit(len, ())
    assert not any(t.is_alive() for t in p._threads)


def test_each_thread_enters_the_context_once_around_all_its_tasks():
    events: list[str] = []
    inside = threading.local()

    class Mark:
        def __enter__(self):
            events.append("enter")
            inside.on = True

        def __exit__(self, *exc):
            events.append("exit")
            inside.on = False

    p = LifoExecutor(1, name="c", context=Mark)
    try:
        assert all(p.submit(lambda: getattr(inside, "on", False)).result(10) for _ in range(5))
        assert events == ["enter"]
    finally:
        p.shutdown()
    assert events == ["enter", "exit"]  # left when the thread ends
    assert not getattr(inside, "on", False)  # this thread never entered it
