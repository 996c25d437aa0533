"""One engine (no Ray) against a verifier in this process, reached through a TCP proxy that can
cut its connections once: what a network blip leaves behind, a cancel that crosses a move to
another replica, and when a request's last event goes out."""
from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest

from orchestrator import engine as engine_module
from orchestrator.engine import Engine, EngineConfig, Hooks
from orchestrator.request import CANCELLED, LENGTH, RequestSpec, Speculation
from tests.orchestrator.inproc import CuttingProxy, LocalVerifier
from tests.orchestrator.stack import wait_until
from treeserve.sampling import Sampling

FRONT = "front"
PROMPT = (5, 17, 42, 8, 99, 3)


@pytest.fixture(scope="module")
def verifier(tiny_pair):
    v = LocalVerifier(tiny_pair[0], max_sequences=4, max_sequence_length=128)
    yield v
    v.stop()


@pytest.fixture
def proxy(verifier):
    p = CuttingProxy(verifier.port)
    yield p
    p.stop()


def spec(rid: str, max_new_tokens: int) -> RequestSpec:
    return RequestSpec(rid, PROMPT, Sampling(), max_new_tokens, Speculation(mode="off", adaptive=False), FRONT)


def engine_for(address: str, hooks: Hooks, name: str) -> Engine:
    engine = Engine(EngineConfig(verifier=address, name=name, connect_timeout_s=30), hooks).start()
    engine.eos = frozenset()  # every request runs to max_new_tokens, whatever the random target predicts
    return engine


class Events:
    """Everything the engine published for FRONT, by request id."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.by_request: dict[str, list] = defaultdict(list)

    def pump_until(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {dict(self.by_request)}")
            for ev in self._engine.outbox.drain(FRONT, 0.2)[1]:
                self.by_request[ev.request_id].append(ev)

    def pump_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            for ev in self._engine.outbox.drain(FRONT, min(left, 0.2))[1]:
                self.by_request[ev.request_id].append(ev)

    def tokens(self, rid: str) -> list[int]:
        return [t for ev in self.by_request[rid] for t in ev.tokens]

    def ended(self, rid: str) -> bool:
        return any(ev.last for ev in self.by_request[rid])


class Recorder(Hooks):
    def __init__(self):
        self.downs = 0
        self.ups = 0

    def replica_down(self, states):
        self.downs += 1
        return {}

    def replica_up(self):
        self.ups += 1


def test_a_blip_releases_the_sequences_it_left_behind(verifier, proxy):
    """Cut the connections once while three requests run on a four-slot verifier that is still
    up. The engine re-prefills each request under a new sequence id; it must first release the
    old ones, which the verifier still holds: else the re-prefills need six slots (and fail
    RESOURCE_EXHAUSTED), and the old ones stay until the idle sweep."""
    n = 40
    rids = [f"blip-{i}" for i in range(3)]
    hooks = Recorder()
    engine = engine_for(proxy.address, hooks, "blip")
    try:
        events = Events(engine)
        for rid in rids:
            assert engine.submit(spec(rid, n)) is None
        events.pump_until(lambda: all(len(events.tokens(r)) >= 4 for r in rids), 120, "first tokens")
        assert verifier.active() == 3
        proxy.cut()
        events.pump_until(lambda: all(events.ended(r) for r in rids), 240, "the ends")
        assert hooks.downs >= 1 and hooks.ups >= 1, "the blip was not noticed"
        for rid in rids:
            last = events.by_request[rid][-1]
            assert last.error is None, last.error
            assert last.finish == LENGTH and len(events.tokens(rid)) == n
        assert len({tuple(events.tokens(r)) for r in rids}) == 1  # same prompt, greedy: one output
        wait_until(lambda: verifier.active() == 0, 15, "every sequence released")
    finally:
        engine.stop()
    # the output is what an engine that saw no blip produces
    calm = engine_for(verifier.address, Hooks(), "calm")
    try:
        events_calm = Events(calm)
        assert calm.submit(spec("calm", n)) is None
        events_calm.pump_until(lambda: events_calm.ended("calm"), 240, "the calm run")
        assert events_calm.tokens("calm") == events.tokens(rids[0])
    finally:
        calm.stop()
    wait_until(lambda: verifier.active() == 0, 15, "every sequence released")


class MoveOnCue(Hooks):
    """`replica_down` hands every request to "engine:other", but only once the test says so: the
    test sends a cancel meanwhile, which lands in the engine's inbox while the move is on."""

    def __init__(self):
        self.offered = threading.Event()
        self.go = threading.Event()
        self.forwarded: list[tuple[str, str, str]] = []

    def replica_down(self, states):
        self.offered.set()
        assert self.go.wait(30)
        return {s.request_id: "engine:other" for s in states}

    def forward_cancel(self, request_id, engine, reason, admission=""):
        self.forwarded.append((request_id, engine, reason))


def test_a_cancel_that_crosses_a_move_follows_the_request(verifier, proxy):
    hooks = MoveOnCue()
    engine = engine_for(proxy.address, hooks, "mover")
    try:
        events = Events(engine)
        assert engine.submit(spec("moves", 100)) is None
        events.pump_until(lambda: len(events.tokens("moves")) >= 2, 120, "first tokens")
        proxy.cut()
        assert hooks.offered.wait(60), "the engine did not offer its request elsewhere"
        engine.cancel("moves", "cancelled by the client")  # routed here: the coordinator has not heard of the move
        hooks.go.set()
        wait_until(lambda: hooks.forwarded, 15, "the cancel to be forwarded")
        assert hooks.forwarded == [("moves", "engine:other", "cancelled by the client")]
        events.pump_until(lambda: any(ev.moved_to for ev in events.by_request["moves"]), 15, "the move event")
        assert not events.ended("moves")  # its end comes from the engine that has it now
        # the sequence the blip left behind is released once the verifier answers again, although
        # its request lives elsewhere now
        wait_until(lambda: verifier.active() == 0, 30, "the moved request's old sequence released")
        engine.cancel("moves", "again")  # a later cancel of a moved request still follows it
        wait_until(lambda: len(hooks.forwarded) == 2, 15, "the second cancel to be forwarded")
        engine.cancel("never-here", "nothing")  # and one of a request never here is dropped:
        engine.cancel("moves", "third")  # the inbox is in order, so once this one is forwarded...
        wait_until(lambda: len(hooks.forwarded) == 3, 15, "the third cancel to be forwarded")
        assert [f[0] for f in hooks.forwarded] == ["moves"] * 3  # ..."never-here" was not
    finally:
        engine.stop()


class GatedFinish(Hooks):
    """`finished` blocks until the test lets it return."""

    def __init__(self):
        self.called = threading.Event()
        self.go = threading.Event()
        self.ids: list[str] = []

    def finished(self, request_ids):
        self.ids += request_ids
        self.called.set()
        assert self.go.wait(30)


def test_the_last_event_goes_out_after_the_finished_hook_returned(verifier):
    """The coordinator must have forgotten a request id before its client hears the end, or a
    client that reuses the id at once is told it is still live."""
    hooks = GatedFinish()
    engine = engine_for(verifier.address, hooks, "gated")
    try:
        events = Events(engine)
        assert engine.submit(spec("ends", 3)) is None
        assert hooks.called.wait(120)
        assert hooks.ids == ["ends"]
        assert engine.load == 0  # the slot is free already
        events.pump_until(lambda: len(events.tokens("ends")) == 2, 15, "the tokens before the last event")
        events.pump_for(0.5)
        assert not events.ended("ends"), "the last event went out before the finished hook returned"
        hooks.go.set()
        events.pump_until(lambda: events.ended("ends"), 15, "the last event")
        assert events.by_request["ends"][-1].finish == LENGTH and len(events.tokens("ends")) == 3
        # a cancel's end goes the same way
        hooks.called.clear()
        assert engine.submit(spec("cancelled", 100)) is None
        events.pump_until(lambda: len(events.tokens("cancelled")) >= 1, 120, "first token")
        engine.cancel("cancelled", "stop string")
        events.pump_until(lambda: events.ended("cancelled"), 15, "the cancel's end")
        assert events.by_request["cancelled"][-1].finish == CANCELLED
        assert hooks.ids == ["ends", "cancelled"]
    finally:
        hooks.go.set()
        engine.stop()
    wait_until(lambda: verifier.active() == 0, 15, "every sequence released")


def test_a_prefill_waits_for_the_releases_before_it(tiny_pair, monkeypatch):
    """A replica of one slot, whose Releases take 0.5 s: a request submitted as another ends, and
    one that reuses the ended request's id at once with another prompt, both run. Before, the
    Release was not waited for: the first found no free slot (RESOURCE_EXHAUSTED) and the second
    met the old sequence under the same id (FAILED_PRECONDITION)."""
    from verifier_service.servicer import VerifierServicer

    release = VerifierServicer.Release

    def slow_release(self, request, context):
        time.sleep(0.5)
        return release(self, request, context)

    monkeypatch.setattr(VerifierServicer, "Release", slow_release)
    verifier = LocalVerifier(tiny_pair[0], max_sequences=1, max_sequence_length=128)
    engine = engine_for(verifier.address, Hooks(), "one-slot")
    events = Events(engine)
    try:
        for rid, prompt in (("a", PROMPT), ("b", PROMPT), ("b", PROMPT[::-1])):
            assert engine.submit(RequestSpec(rid, prompt, Sampling(), 3, Speculation(mode="off", adaptive=False),
                                             FRONT)) is None
            events.pump_until(lambda: events.ended(rid), 60, f"the end of {rid}")
            last = events.by_request.pop(rid)[-1]
            assert last.error is None and last.finish == LENGTH, last
    finally:
        engine.stop()
        verifier.stop()


def test_a_stopped_engine_takes_no_request(verifier):
    """Its loop has ended: a request it accepted would never run, and its id would stay live."""
    engine = engine_for(verifier.address, Hooks(), "stopped")
    engine.stop()
    code, message = engine.submit(spec("late", 3))
    assert code == 14 and "stopping" in message
    assert engine.load == 0


def test_a_cancel_meant_for_an_earlier_request_under_the_id_is_ignored(verifier):
    """A cancel that names another admission (the id's earlier request, which has ended) leaves the
    live request running; one that names its own ends it."""
    engine = engine_for(verifier.address, Hooks(), "admissions")
    try:
        events = Events(engine)
        live = spec("reused", 120)
        assert engine.submit(live) is None
        events.pump_until(lambda: len(events.tokens("reused")) >= 2, 120, "first tokens")
        engine.cancel("reused", "client went away", "0123abcd")
        before = len(events.tokens("reused"))
        events.pump_until(lambda: len(events.tokens("reused")) >= before + 3, 120, "more tokens")
        assert not events.ended("reused")
        engine.cancel("reused", "client went away", live.admission)
        events.pump_until(lambda: events.ended("reused"), 60, "the cancel")
        assert events.by_request["reused"][-1].finish == CANCELLED
    finally:
        engine.stop()


def test_a_stop_right_after_a_cancel_still_releases_the_sequence(verifier, monkeypatch):
    """The Release of a request that ended just before the engine stopped was left in flight and
    lost with the channel: its sequence stayed on the verifier, holding a slot (a slow Release
    here: still in flight when the stop returned)."""
    release = verifier._server.engine.release

    def slow_release(*args, **kwargs):
        time.sleep(0.3)
        return release(*args, **kwargs)

    engine = engine_for(verifier.address, Hooks(), "stop-after-cancel")
    events = Events(engine)
    try:
        assert engine.submit(spec("last", 120)) is None
        events.pump_until(lambda: len(events.tokens("last")) >= 2, 120, "first tokens")
        monkeypatch.setattr(verifier._server.engine, "release", slow_release)
        engine.cancel("last", "client went away")
        wait_until(lambda: engine.load == 0, 60, "the cancel")
    finally:
        engine.stop()
    assert verifier.active() == 0


def test_the_requests_of_a_front_that_stopped_draining_are_cancelled(verifier, monkeypatch, caplog):
    """A front that crashed (or stopped with requests running) drains no more: after the outbox's
    silent_s its requests end and their slots are free, and nothing more piles up for it; the
    front that comes back is heard again."""
    monkeypatch.setattr(engine_module, "FRONT_CHECK_S", 0.05)
    engine = engine_for(verifier.address, Hooks(), "silent")
    engine.outbox.silent_s = 0.2
    try:
        events = Events(engine)
        assert engine.submit(spec("orphan", 120)) is None
        events.pump_until(lambda: len(events.tokens("orphan")) >= 2, 120, "first tokens")
        wait_until(lambda: engine.load == 0, 60, "the orphan cancelled")  # nobody drains meanwhile
        assert "cancelling its 1 request(s)" in caplog.text  # cancelled, not run to its length
        wait_until(lambda: verifier.active() == 0, 30, "its sequence released")
        _, left = engine.outbox.drain(FRONT, 0.0)  # its events went with the front, but for its end
        assert all(ev.request_id == "orphan" and ev.finish == CANCELLED for ev in left), left
        assert engine.submit(spec("back", 3)) is None  # the front drains again: heard from now on
        events.pump_until(lambda: events.ended("back"), 120, "the returning front's request")
        assert events.by_request["back"][-1].finish == LENGTH
    finally:
        engine.stop()
