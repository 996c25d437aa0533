"""The front's side of the Ray actors: submit through the coordinator, receive events from the
engines' outboxes, cancel.

One reader thread per engine long-polls `EngineActor.drain(front)` and files each event into its
request's `Inbox`. Events carry a per-request sequence number, and the inbox releases them in
order, once each: a request that moved between engines may have its last events from the old
engine and its first from the new one drained in either order, and a drain whose answer was lost
is answered again (`engine.Outbox`: each drain acknowledges the batch before it). A drain that
fails makes the reader ask the coordinator about the engine (`Coordinator.check_engine`, which
drops a dead one, freeing its requests' ids). One that answers, or is only unreachable for now,
is read again, for ENGINE_LOST_S at most; then, or once it is dead, its requests here fail
(UNAVAILABLE), and those it may still run are cancelled.

Cancels from gRPC's done-callbacks go through `cancel_soon`: those callbacks run on the server's
one polling thread, and a wait there for Ray would stall every call of the server.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Optional

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError

from orchestrator.names import COORDINATOR, ENGINE_ANSWERS, ENGINE_DEAD, ENGINE_UNKNOWN, ENGINE_UNREACHABLE
from orchestrator.request import Event, RequestSpec

log = logging.getLogger("treeserve.orchestrator.router")

_UNAVAILABLE = 14
DRAIN_POLL_S = 1.0  # how long one `EngineActor.drain` call waits for events
DRAIN_SLACK_S = 1.0  # and how much longer a reader waits for its answer before it checks for `stop`
STOP_TIMEOUT_S = 5.0  # how long `Router.stop` waits for the threads in Ray to leave it
SUBMIT_TIMEOUT_S = 60.0  # longest wait for the coordinator to route a request (it holds a stream meanwhile)
ENGINE_LOST_S = 30.0  # how long a reader goes on asking an engine that answers nothing (or fails its drains)
READ_RETRY_S = 1.0  # the pause before asking such an engine again


class Inbox:
    """A request's events, in order."""

    def __init__(self, request_id: str, admission: str = ""):
        self.request_id = request_id
        self.admission = admission
        self.engine: Optional[str] = None
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._next = 0
        self._early: dict[int, Event] = {}

    def deliver(self, ev: Event) -> None:
        with self._lock:
            if ev.seq < self._next:
                return
            self._early[ev.seq] = ev
            while self._next in self._early:
                self._q.put(self._early.pop(self._next))
                self._next += 1

    def fail(self, code: int, message: str) -> None:
        self._q.put(Event(self.request_id, -1, error=(code, message)))

    def get(self, timeout: float) -> Optional[Event]:
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None


_CANNOT_TELL = object()  # `Router._actor`'s answer when Ray could not say


def _same_actor(a, b) -> bool:
    """Whether two handles name one actor (a new actor under a reused name is another)."""
    return a is not None and b is not None and getattr(a, "_actor_id", a) == getattr(b, "_actor_id", b)


class _Stopped(Exception):
    """The router is stopping: it makes no new call into Ray."""


class Router:
    """Every call into Ray goes through `_calling_ray`, which counts it and refuses new ones once
    `stop` has begun, so that `stop` can wait until no thread of this process is inside Ray: Ray
    shut down under a thread blocked in `ray.get` (or starting a `.remote`) can crash the process."""

    def __init__(self, namespace: str, front: str):
        self.front = front
        self._ns = namespace
        self.coordinator = ray.get_actor(COORDINATOR, namespace=namespace)
        self._lock = threading.Lock()
        self._left_ray = threading.Condition(self._lock)
        self._in_ray = 0  # threads inside a Ray call now
        self._inboxes: dict[str, Inbox] = {}
        self._readers: dict[str, threading.Thread] = {}
        self._stopped = threading.Event()
        self._cancels: queue.Queue = queue.Queue()  # (request id, reason, admission), or None: stop
        self._canceller = threading.Thread(target=self._cancel_in_turn, name="router-cancels", daemon=True)
        self._canceller.start()

    def submit(self, spec: RequestSpec) -> tuple[Optional[Inbox], Optional[tuple[int, str]]]:
        """(inbox, None) or (None, (grpc code number, message))."""
        inbox = Inbox(spec.request_id, spec.admission)
        with self._lock:
            if spec.request_id in self._inboxes:
                return None, (6, f"request id {spec.request_id!r} is already live")
            self._inboxes[spec.request_id] = inbox
        try:
            with self._calling_ray():
                engine, error = ray.get(self.coordinator.submit.remote(spec), timeout=SUBMIT_TIMEOUT_S)
        except _Stopped:
            error, engine = (_UNAVAILABLE, "this front is shutting down"), None
        except Exception as exc:  # noqa: BLE001 - the coordinator is gone, or does not answer
            error, engine = (_UNAVAILABLE, f"coordinator unavailable: {exc}"), None
            # it may have admitted the request all the same: nobody would read it
            self.cancel_soon(spec.request_id, "its submission failed", spec.admission)
        if error is not None:
            self.forget(inbox)
            return None, error
        inbox.engine = engine
        self._ensure_reader(engine)
        return inbox, None

    def cancel(self, request_id: str, reason: str = "cancelled", admission: str = "") -> bool:
        """Whether a request was live under the id. admission: only the request admitted with it
        (`RequestSpec.admission`), not a newer one that reused the id."""
        try:
            with self._calling_ray():
                return bool(ray.get(self.coordinator.cancel.remote(request_id, reason, admission), timeout=10))
        except _Stopped:
            return False
        except Exception:  # noqa: BLE001
            log.exception("cancel of %s failed", request_id)
            return False

    def cancel_soon(self, request_id: str, reason: str, admission: str) -> None:
        """`cancel` on this router's own thread, in order, without waiting: for gRPC's done-callbacks."""
        self._cancels.put((request_id, reason, admission))

    def _cancel_in_turn(self) -> None:
        while (item := self._cancels.get()) is not None:
            self.cancel(*item)

    def forget(self, inbox: Inbox) -> None:
        """Stop filing events for `inbox`'s request (idempotent). Only that inbox: a new request
        may reuse the id as soon as its client has heard the end of this one."""
        with self._lock:
            if self._inboxes.get(inbox.request_id) is inbox:
                del self._inboxes[inbox.request_id]

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """Make no new call into Ray and wait (at most `timeout`) until no thread is in one and the
        readers have ended (each within one drain poll). True when both happened in time."""
        deadline = time.monotonic() + timeout
        # the cancels asked for before the stop go out first (the clients that left as the server
        # stopped): else their requests would run on until their engines found this front silent
        self._cancels.put(None)
        self._canceller.join(timeout)
        with self._lock:
            self._stopped.set()  # under the lock: `_ensure_reader` and `_calling_ray` see it there
            readers = [*self._readers.values(), self._canceller]
            self._left_ray.wait_for(lambda: self._in_ray == 0, max(0.0, deadline - time.monotonic()))
        for t in readers:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            return self._in_ray == 0 and not any(t.is_alive() for t in readers)

    @contextlib.contextmanager
    def _calling_ray(self):
        """Counts the call in; raises `_Stopped` once `stop` has begun."""
        with self._lock:
            if self._stopped.is_set():
                raise _Stopped
            self._in_ray += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_ray -= 1
                self._left_ray.notify_all()

    def _ensure_reader(self, engine: str) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            t = self._readers.get(engine)
            if t is not None and t.is_alive():
                return
            t = threading.Thread(target=self._read, args=(engine,), name=f"reader-{engine}", daemon=True)
            self._readers[engine] = t
            t.start()  # under the lock: `stop` never sees a reader that has not started

    def _read(self, engine: str) -> None:
        while (handle := self._actor(engine, unknown=_CANNOT_TELL)) is _CANNOT_TELL:
            if self._stopped.wait(READ_RETRY_S):
                return
        if handle is None:
            if not self._stopped.is_set():
                lost = self._filed_under(engine)
                self._fail_engine(engine, "engine is gone", self._check_engine(engine), lost)
            return
        pending = None  # a drain call not answered yet: asked again rather than piling up calls
        ack = 0  # the batch the last drain returned: the next one acknowledges it
        failing_since = None
        while True:
            try:
                with self._calling_ray():
                    if pending is None:
                        pending = handle.drain.remote(self.front, DRAIN_POLL_S, ack)
                    ack, events = ray.get(pending, timeout=DRAIN_POLL_S + DRAIN_SLACK_S)
                pending, failing_since = None, None
            except (_Stopped, SystemExit):  # SystemExit: what Ray raises here when it shuts down
                return
            except GetTimeoutError:  # a busy engine: wait on, letting a `stop` in between
                continue
            except Exception as exc:  # noqa: BLE001 - RayActorError and friends
                if self._stopped.is_set():
                    return
                pending = None  # a new drain, with the same ack: a lost answer comes again
                failing_since = failing_since or time.monotonic()
                lost = self._filed_under(engine)  # before the check: later ones may be a new engine's
                verdict = self._check_engine(engine)
                if isinstance(exc, ActorDiedError) or not _same_actor(self._actor(engine, unknown=handle), handle):
                    # this reader's engine is dead, whatever answers under its name now (a new
                    # engine of the verifier, registered again): its requests go, later ones get a reader
                    verdict = ENGINE_DEAD
                if verdict in (ENGINE_ANSWERS, ENGINE_UNREACHABLE) and \
                        time.monotonic() - failing_since < ENGINE_LOST_S:
                    log.warning("engine %s: a drain failed (%s); the engine %s, reading again", engine, exc, verdict)
                    if self._stopped.wait(READ_RETRY_S):
                        return
                    continue
                log.warning("engine %s unreachable: %s", engine, exc)
                self._fail_engine(engine, f"engine {engine} died" if verdict == ENGINE_DEAD else
                                  f"engine {engine} unreachable", verdict, lost)
                return
            for ev in events:
                with self._lock:
                    inbox = self._inboxes.get(ev.request_id)
                if inbox is None or ev.admission != inbox.admission:  # gone, or a late event of the id's last user
                    continue
                if ev.moved_to is not None:
                    inbox.engine = ev.moved_to
                    self._ensure_reader(ev.moved_to)
                    continue
                inbox.deliver(ev)

    def _actor(self, engine: str, unknown=None):
        """The actor named `engine` now: None when there is none by that name (or this router is
        stopping), `unknown` when Ray cannot tell."""
        try:
            with self._calling_ray():
                return ray.get_actor(engine, namespace=self._ns)
        except (_Stopped, ValueError):
            return None
        except Exception:  # noqa: BLE001 - e.g. the GCS busy for a moment
            return unknown

    def _check_engine(self, engine: str) -> str:
        """What the coordinator says of `engine` (a dead one it drops); unreachable when it cannot say."""
        try:
            with self._calling_ray():
                return ray.get(self.coordinator.check_engine.remote(engine), timeout=15)
        except _Stopped:
            return ENGINE_UNREACHABLE
        except Exception:  # noqa: BLE001
            log.exception("could not ask the coordinator about engine %s", engine)
            return ENGINE_UNREACHABLE

    def _filed_under(self, engine: str) -> list[Inbox]:
        with self._lock:
            return [i for i in self._inboxes.values() if i.engine == engine]

    def _fail_engine(self, engine: str, message: str, verdict: str, lost: list[Inbox]) -> None:
        """Fail `lost`, the requests of an engine this front lost, filed under it before the
        coordinator was asked. Unless the coordinator knows it dead or gone (their ids are free
        then), it may still run them: they are cancelled. Those filed under its name since
        (submitted meanwhile, perhaps to an engine registered again under the name) get a reader
        of their own, which finds out which."""
        with self._lock:
            if self._readers.get(engine) is threading.current_thread():
                del self._readers[engine]
        for inbox in lost:
            inbox.fail(_UNAVAILABLE, message)
            if verdict not in (ENGINE_DEAD, ENGINE_UNKNOWN):
                self.cancel_soon(inbox.request_id, message, inbox.admission)
        with self._lock:
            failed = {id(i) for i in lost}
            newer = any(i.engine == engine and id(i) not in failed for i in self._inboxes.values())
        if newer:
            self._ensure_reader(engine)
