"""The router's threads against a stand-in for Ray's API (no Ray processes): `stop` waits until no
thread is inside a Ray call, and a dead engine's requests fail while those filed under its name
meanwhile get a reader of their own. `test_coordinator.py` runs the router against real Ray."""
from __future__ import annotations

import queue
import threading

import pytest

from orchestrator import router as router_module
from orchestrator.names import COORDINATOR
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


class StandInEngine:
    """An outbox per front; `kill()` makes every drain from then on fail as a dead actor's would."""

    def __init__(self):
        self.events: queue.Queue = queue.Queue()
        self.dead = threading.Event()
        self.drain = Method(self._drain)

    def _drain(self, front, timeout):
        if self.dead.is_set():
            raise EngineDied("the actor died")
        try:
            return [self.events.get(timeout=min(timeout, 0.05))]
        except queue.Empty:
            return []

    def kill(self):
        self.dead.set()


class StandInCoordinator:
    """Routes every request to engine "E". `hold` blocks `cancel` and `check_engine` until released."""

    def __init__(self):
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.checked: list[str] = []
        self.submit = Method(lambda spec: ("E", None))
        self.cancel = Method(self._held(lambda rid, reason: True))
        self.check_engine = Method(self._held(self.checked.append))

    def _held(self, fn):
        def call(*args):
            self.entered.set()
            self.hold.wait()
            return fn(*args)
        return call


class StandInRay:
    def __init__(self):
        self.coordinator = StandInCoordinator()
        self.engines: dict[str, StandInEngine] = {"E": StandInEngine()}

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
    assert ray_api.coordinator.entered.wait(5)  # the reader reports the engine: check_engine is held
    # meanwhile the verifier is registered again, its engine under the same name, and a request goes there
    ray_api.engines["E"] = StandInEngine()
    new, error = router.submit(spec("new"))
    assert error is None and first_reader.is_alive()  # no second reader for "E" yet
    ray_api.coordinator.hold.set()
    failed = old.get(timeout=10)
    assert failed.error is not None and failed.error[0] == UNAVAILABLE
    ray_api.engines["E"].events.put(Event("new", 0, tokens=(7,), admission=new.admission))
    delivered = new.get(timeout=10)
    assert delivered is not None and delivered.tokens == (7,)
    wait_until(lambda: router._readers.get("E") is not first_reader, 10, "a new reader")
    assert ray_api.coordinator.checked == ["E"]
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
    outbox = ray_api.engines["E"].events
    outbox.put(Event("x", 0, finish=CANCELLED, admission=first.admission))
    outbox.put(Event("x", 0, tokens=(5,), admission=again.admission))
    ev = inbox.get(timeout=10)
    assert ev.tokens == (5,) and ev.finish is None
    assert router.stop() is True
