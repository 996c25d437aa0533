"""The router's threads against a stand-in for Ray's API (no Ray processes): `stop` waits until no
thread is inside a Ray call, and a dead engine's requests fail while those filed under its name
meanwhile get a reader of their own. `test_coordinator.py` runs the router against real Ray."""
from __future__ import annotations

import threading
import time

import pytest

from orchestrator import router as router_module
from orchestrator.engine import Outbox
from orchestrator.names import COORDINATOR, ENGINE_ANSWERS, ENGINE_DEAD, ENGINE_UNREACHABLE
from orchestrator.request import CANCELLED, Event, RequestSpec, Speculation
from orchestrator.router import Router
from tests.orchestrator.stack import wait_until
from treeserve.sampling import Sampling

UNAVAILABLE = 14


class EngineDied(Exception):
    pass


class Call:
    """What `.remote()` returns: `ray.get` runs it."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __call__(self):
        return self.fn(*self.args)


class Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return Call(self.fn, *args)


class EngineUnavailable(Exception):
    pass


class StandInEngine:
    """The engine's own `Outbox` behind a stand-in actor. `kill()` makes every drain from then on
    fail as a dead actor's would; `lose_answers(n)`: the next n drains run, then fail as one whose
    answer was lost on the way (a transient Ray error)."""

    def __init__(self):
        self.outbox = Outbox()
        self.dead = threading.Event()
        self._lose = 0
        self.drain = Method(self._drain)

    def put(self, event: Event, front: str = "front") -> None:
        self.outbox.put(front, [event])

    def lose_answers(self, n: int) -> None:
        self._lose = n

    def _drain(self, front, timeout, ack):
        if self.dead.is_set():
            raise EngineDied("the actor died")
        answer = self.outbox.drain(front, min(timeout, 0.05), ack)
        if self._lose:
            self._lose -= 1
            raise EngineUnavailable("the answer was lost")
        return answer

    def kill(self):
        self.dead.set()


class StandInCoordinator:
    """Routes every request to engine "E". `hold` blocks `cancel` and `check_engine` until
    released; `check_engine` says `verdict`."""

    def __init__(self, engines: dict):
        self.engines = engines
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.checked: list[str] = []
        self.cancelled: list[tuple[str, str, str]] = []
        self.verdict = ENGINE_ANSWERS
        self.submit = Method(lambda spec: ("E", None))
        self.cancel = Method(self._held(self._cancel))
        self.check_engine = Method(self._held(self._check))

    def _cancel(self, rid, reason, admission):
        self.cancelled.append((rid, reason, admission))
        return True

    def _check(self, engine):
        self.checked.append(engine)
        return self.verdict

    def _held(self, fn):
        def call(*args):
            self.entered.set()
            self.hold.wait()
            return fn(*args)
        return call


class StandInRay:
    def __init__(self):
        self.engines: dict[str, StandInEngine] = {"E": StandInEngine()}
        self.coordinator = StandInCoordinator(self.engines)

    def get_actor(self, name, namespace=None):
        if name == COORDINATOR:
            return self.coordinator
        if name not in self.engines:
            raise ValueError(f"no actor {name}")
        return self.engines[name]

    def get(self, call, timeout=None):
        return call()


@pytest.fixture
def ray_api(monkeypatch):
    api = StandInRay()
    monkeypatch.setattr(router_module, "ray", api)
    return api


@pytest.fixture
def router(ray_api):
    """Stopped at the end, while the stand-in is still in place (also when the test failed)."""
    r = Router("ns", "front")
    yield r
    ray_api.coordinator.hold.set()
    r.stop()


def spec(rid: str) -> RequestSpec:
    return RequestSpec(rid, (1, 2, 3), Sampling(), 8, Speculation(mode="off", adaptive=False), "front")


def in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def test_stop_waits_for_a_thread_inside_a_ray_call(ray_api, router):
    ray_api.coordinator.hold.clear()
    canceller, cancelled = in_thread(lambda: router.cancel("r"))
    assert ray_api.coordinator.entered.wait(5)
    stopper, stopped = in_thread(lambda: router.stop(timeout=30))
    stopper.join(0.3)
    assert stopper.is_alive()  # the cancel is still inside Ray
    ray_api.coordinator.hold.set()
    stopper.join(10)
    canceller.join(10)
    assert stopped == [True] and cancelled == [True]


def test_stop_says_when_a_call_did_not_leave_ray_in_time(ray_api, router):
    ray_api.coordinator.hold.clear()
    canceller, _ = in_thread(lambda: router.cancel("r"))
    assert ray_api.coordinator.entered.wait(5)
    assert router.stop(timeout=0.2) is False
    ray_api.coordinator.hold.set()
    canceller.join(10)


def test_a_stopped_router_makes_no_ray_call(ray_api, router):
    inbox, error = router.submit(spec("before"))
    assert error is None
    reader = router._readers["E"]
    assert router.stop() is True
    assert not reader.is_alive()
    assert router.submit(spec("after")) == (None, (UNAVAILABLE, "this front is shutting down"))
    assert router.cancel("before") is False
    router._ensure_reader("E")
    assert not any(t.is_alive() for t in router._readers.values())


def test_a_dead_engines_requests_fail_and_later_ones_get_a_reader(ray_api, router):
    old, _ = router.submit(spec("old"))
    first_reader = router._readers["E"]
    ray_api.coordinator.hold.clear()
    ray_api.engines["E"].kill()
    ray_api.coordinator.verdict = ENGINE_DEAD  # what it says of the engine it pinged: the old one
    assert ray_api.coordinator.entered.wait(5)  # the reader reports the engine: check_engine is held
    # meanwhile the verifier is registered again, its engine under the same name, and a request goes there
    ray_api.engines["E"] = StandInEngine()
    new, error = router.submit(spec("new"))
    assert error is None and first_reader.is_alive()  # no second reader for "E" yet
    ray_api.coordinator.hold.set()
    failed = old.get(timeout=10)
    assert failed.error is not None and failed.error[0] == UNAVAILABLE
    ray_api.engines["E"].put(Event("new", 0, tokens=(7,), admission=new.admission))
    delivered = new.get(timeout=10)
    assert delivered is not None and delivered.tokens == (7,)
    wait_until(lambda: router._readers.get("E") is not first_reader, 10, "a new reader")
    assert ray_api.coordinator.checked == ["E"]
    assert ray_api.coordinator.cancelled == []  # a dead engine's ids are free: nothing to cancel
    assert router.stop() is True


def test_a_late_event_of_an_ids_last_user_is_not_filed_under_its_next(ray_api, router):
    """The id's first request ends (its client left); its client submits the id again at once, and
    the first request's last event (CANCELLED) reaches the front after that: it is dropped, not
    taken as the new request's end."""
    first = spec("x")
    inbox, _ = router.submit(first)
    router.forget(inbox)
    again = spec("x")
    assert again.admission != first.admission
    inbox, _ = router.submit(again)
    engine = ray_api.engines["E"]
    engine.put(Event("x", 0, finish=CANCELLED, admission=first.admission))
    engine.put(Event("x", 0, tokens=(5,), admission=again.admission))
    ev = inbox.get(timeout=10)
    assert ev.tokens == (5,) and ev.finish is None
    assert router.stop() is True


def test_a_cancel_from_a_done_callback_does_not_wait_for_ray(ray_api, router):
    """`cancel_soon` returns at once while the coordinator takes its time (gRPC runs done-callbacks
    on its one polling thread); the cancel is made, for that request's admission only."""
    ray_api.coordinator.hold.clear()
    done, _ = in_thread(lambda: router.cancel_soon("r", "client went away", "adm1"))
    done.join(1.0)
    assert not done.is_alive()
    assert ray_api.coordinator.entered.wait(5) and ray_api.coordinator.cancelled == []
    ray_api.coordinator.hold.set()
    wait_until(lambda: ray_api.coordinator.cancelled == [("r", "client went away", "adm1")], 10, "the cancel")


def test_a_drain_whose_answer_was_lost_is_answered_again(ray_api, router):
    """A drain that ran on the engine and then failed on the way back (a transient Ray error): the
    engine still answers, so the reader drains again and gets the same events, once each."""
    inbox, _ = router.submit(spec("r"))
    engine = ray_api.engines["E"]
    engine.lose_answers(2)
    for seq in range(3):
        engine.put(Event("r", seq, tokens=(seq,), admission=inbox.admission))
    got = [inbox.get(timeout=10) for _ in range(3)]
    assert [ev.tokens for ev in got] == [(0,), (1,), (2,)]
    assert inbox.get(timeout=0.3) is None  # no repeats
    assert ray_api.coordinator.checked == ["E", "E"] and ray_api.coordinator.cancelled == []


def test_an_engine_that_stays_unreachable_fails_its_requests_and_cancels_them(ray_api, router, monkeypatch):
    """Not known dead, so it may still run the requests: after ENGINE_LOST_S of failed drains they
    fail here (UNAVAILABLE) and are cancelled there, each for its own admission."""
    monkeypatch.setattr(router_module, "ENGINE_LOST_S", 0.5)
    monkeypatch.setattr(router_module, "READ_RETRY_S", 0.1)
    inbox, _ = router.submit(spec("r"))
    ray_api.coordinator.verdict = ENGINE_UNREACHABLE
    ray_api.engines["E"].lose_answers(10**6)
    failed = inbox.get(timeout=10)
    assert failed.error == (UNAVAILABLE, "engine E unreachable")
    assert len(ray_api.coordinator.checked) >= 2  # asked again while within ENGINE_LOST_S
    wait_until(lambda: ray_api.coordinator.cancelled == [("r", "engine E unreachable", inbox.admission)], 10,
               "the cancel")


def test_a_submission_the_coordinator_does_not_answer_in_time_is_refused_and_cancelled(ray_api, router, monkeypatch):
    """The coordinator may have admitted it all the same: the front cancels it (for its admission)."""
    monkeypatch.setattr(router_module, "SUBMIT_TIMEOUT_S", 0.2)

    def slow_get(call, timeout=None):
        if call.fn == ray_api.coordinator.submit.fn:
            raise router_module.GetTimeoutError("no answer")
        return call()

    monkeypatch.setattr(ray_api, "get", slow_get)
    request = spec("slow")
    inbox, error = router.submit(request)
    assert inbox is None and error[0] == UNAVAILABLE and "coordinator unavailable" in error[1]
    wait_until(lambda: ray_api.coordinator.cancelled == [("slow", "its submission failed", request.admission)], 10,
               "the cancel")
    assert "slow" not in router._inboxes  # the id is not held here meanwhile


def test_the_cancels_asked_for_before_a_stop_go_out_before_it(ray_api, router):
    """A server's stop ends its open streams, whose done-callbacks queue their cancels; the router's
    stop comes next and must send them, not drop them (else the requests run on unread)."""
    held = ray_api.coordinator._cancel

    def round_trip(*args):
        time.sleep(0.01)
        return held(*args)

    ray_api.coordinator.cancel = Method(round_trip)
    for i in range(50):
        router.cancel_soon(f"r{i}", "client went away", "adm")
    assert router.stop() is True
    assert len(ray_api.coordinator.cancelled) == 50


def test_a_reader_whose_engine_was_replaced_under_its_name_lets_the_new_one_be_read(ray_api, router, monkeypatch):
    """The engine dies and its verifier is registered again: a new engine under the same name,
    which answers the coordinator's ping. The old engine's requests fail (nothing to cancel), and
    a request on the new one is read, at once, not after ENGINE_LOST_S of draining the dead one."""
    monkeypatch.setattr(router_module, "READ_RETRY_S", 0.1)
    old, _ = router.submit(spec("old"))
    ray_api.engines["E"].put(Event("old", 0, tokens=(1,), admission=old.admission))
    assert old.get(timeout=10).tokens == (1,)  # the reader holds the first engine's handle
    ray_api.engines["E"].lose_answers(10**6)  # its drains fail from now on, as a dead actor's do
    ray_api.engines["E"] = StandInEngine()
    ray_api.coordinator.verdict = ENGINE_ANSWERS  # it pings the engine under the name: the new one
    failed = old.get(timeout=10)
    assert failed.error == (UNAVAILABLE, "engine E died")
    new, error = router.submit(spec("new"))
    assert error is None
    ray_api.engines["E"].put(Event("new", 0, tokens=(7,), admission=new.admission))
    delivered = new.get(timeout=10)
    assert delivered is not None and delivered.tokens == (7,)
    assert ray_api.coordinator.cancelled == []
