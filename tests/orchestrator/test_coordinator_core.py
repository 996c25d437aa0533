"""The coordinator's routing as a plain object (`actors.CoordinatorCore`, no Ray processes): the
engines are stand-ins whose calls answer at once, and `ray.get` / `ray.kill` stand-ins in the
module run them."""
from __future__ import annotations

import pytest

from orchestrator import actors
from orchestrator.request import RequestSpec, Speculation
from treeserve.sampling import Sampling

UNAVAILABLE = 14


class Method:
    def __init__(self, fn):
        self.remote = fn


class StandInEngine:
    def __init__(self, refusal=None):
        self.accepted: list[str] = []
        self.stopped = False
        self.refusal = refusal
        self.cancelled: list[tuple] = []
        self.while_submitting = lambda: None  # what happens elsewhere while this engine takes a request
        self.submit = Method(self._submit)
        self.cancel = Method(self._cancel)
        self.shutdown = Method(lambda: setattr(self, "stopped", True))

    def _cancel(self, request_id, *args):
        if request_id in self.accepted:  # as an engine does: a cancel of a request it has not got is dropped
            self.cancelled.append((request_id, *args))

    def _submit(self, spec):
        self.while_submitting()
        if self.refusal is not None:
            return self.refusal
        self.accepted.append(spec.request_id)
        return None


@pytest.fixture
def coordinator(monkeypatch):
    monkeypatch.setattr(actors.ray, "get", lambda value, timeout=None: value)
    monkeypatch.setattr(actors.ray, "kill", lambda handle: None)
    return actors.CoordinatorCore("ns", None)


def replica(coordinator, verifier: str, engine: StandInEngine) -> None:
    coordinator._replicas[verifier] = actors._Replica(verifier, engine, f"engine-{verifier}", 4, None)


def spec(rid: str) -> RequestSpec:
    return RequestSpec(rid, (1, 2), Sampling(), 4, Speculation(), "front")


def test_a_replica_retired_during_a_submission_gets_no_request(coordinator):
    """`unregister` of an idle replica (it retires at once) between the submission's look at the
    replicas and its reservation: the request is not routed to the stopped engine, whose loop
    would never run it while its id stayed live for good."""
    engine = StandInEngine()
    replica(coordinator, "v:1", engine)
    reserve = coordinator._reserve

    def unregister_first(rep, request_id):
        coordinator.unregister("v:1")
        return reserve(rep, request_id)

    coordinator._reserve = unregister_first
    engine_name, error = coordinator.submit(spec("x"))
    assert engine_name is None and error is not None
    assert engine.stopped and engine.accepted == []
    assert coordinator._where == {}


def test_an_engine_that_is_stopping_passes_the_request_on(coordinator):
    """A replica whose engine says it is stopping (UNAVAILABLE) is skipped like a full one."""
    stopping = StandInEngine(refusal=(UNAVAILABLE, "the engine is stopping"))
    running = StandInEngine()
    replica(coordinator, "v:1", stopping)
    replica(coordinator, "v:2", running)
    coordinator._replicas["v:2"].load = 1  # so the stopping one is tried first
    engine_name, error = coordinator.submit(spec("x"))
    assert (engine_name, error) == ("engine-v:2", None)
    assert running.accepted == ["x"] and coordinator._where == {"x": "v:2"}
    assert coordinator._replicas["v:1"].load == 0


class AdoptingEngine(StandInEngine):
    """Adopts a moved request, which ends at once: its `finished` reaches the coordinator before
    `adopt` has returned (a request with one token left)."""

    def __init__(self, coordinator, verifier: str):
        super().__init__()
        self.adopt = Method(lambda state: coordinator.finished(verifier, [state.request_id]) or True)


def test_a_moved_request_that_ends_during_its_move_leaves_no_load_behind(coordinator):
    from orchestrator.request import RequestState

    replica(coordinator, "v:1", StandInEngine())
    replica(coordinator, "v:2", AdoptingEngine(coordinator, "v:2"))
    coordinator._replicas["v:1"].load = 1
    coordinator._where["x"] = "v:1"
    taken = coordinator.replica_down("v:1", [RequestState(spec("x"), [1, 2], None)])
    assert taken == {"x": "engine-v:2"}
    assert coordinator._where == {}  # the id is free again
    assert {v: r.load for v, r in coordinator._replicas.items()} == {"v:1": 0, "v:2": 0}
    assert coordinator._moving == set() and coordinator._ended_in_move == {}


def test_a_cancel_that_comes_while_the_engine_takes_the_request_follows_it(coordinator):
    """Sent at once, the cancel could reach the (threaded) engine actor before the request and be
    dropped there, while the client was told `cancelled`: it waits for the engine's answer."""
    engine = StandInEngine()
    replica(coordinator, "v:1", engine)
    told = []
    engine.while_submitting = lambda: told.append(coordinator.cancel("x", "cancelled by the client"))
    request = spec("x")
    assert coordinator.submit(request) == ("engine-v:1", None)
    assert told == [True] and engine.accepted == ["x"]
    assert engine.cancelled == [("x", "cancelled by the client", "")]
    assert coordinator.cancel("x", "again") is True  # after the submission: sent at once
    assert engine.cancelled[-1] == ("x", "again", "")


def test_a_cancel_for_another_admission_that_came_meanwhile_is_not_sent(coordinator):
    """A late cancel of the id's previous request (its admission) must not end the new one."""
    engine = StandInEngine()
    replica(coordinator, "v:1", engine)
    engine.while_submitting = lambda: coordinator.cancel("x", "client went away", "0badadm0")
    assert coordinator.submit(spec("x")) == ("engine-v:1", None)
    assert engine.cancelled == []
