"""The front's side of the Ray actors: submit through the coordinator, receive events from the
engines' outboxes, cancel.

One reader thread per engine long-polls `EngineActor.drain(front)` and files each event into its
request's `Inbox`. Events carry a per-request sequence number, and the inbox releases them in
order: a request that moved between engines may have its last events from the old engine and
its first from the new one drained in either order. A reader whose engine died asks the
coordinator to drop it (`Coordinator.check_engine`) before it fails the engine's requests, so a
client that retries with the same id is not told the id is still live.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Optional

import ray
from ray.exceptions import GetTimeoutError

from orchestrator.names import COORDINATOR
from orchestrator.request import Event, RequestSpec

log = logging.getLogger("treeserve.orchestrator.router")

_UNAVAILABLE = 14
DRAIN_POLL_S = 1.0  # how long one `EngineActor.drain` call waits for events
DRAIN_SLACK_S = 1.0  # and how much longer a reader waits for its answer before it checks for `stop`
STOP_TIMEOUT_S = 5.0  # how long `Router.stop` waits for the threads in Ray to leave it


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

    def submit(self, spec: RequestSpec) -> tuple[Optional[Inbox], Optional[tuple[int, str]]]:
        """(inbox, None) or (None, (grpc code number, message))."""
        inbox = Inbox(spec.request_id, spec.admission)
        with self._lock:
            if spec.request_id in self._inboxes:
                return None, (6, f"request id {spec.request_id!r} is already live")
            self._inboxes[spec.request_id] = inbox
        try:
            with self._calling_ray():
                engine, error = ray.get(self.coordinator.submit.remote(spec))
        except _Stopped:
            error, engine = (_UNAVAILABLE, "this front is shutting down"), None
        except Exception as exc:  # noqa: BLE001 - the coordinator itself is gone
            error, engine = (_UNAVAILABLE, f"coordinator unavailable: {exc}"), None
        if error is not None:
            self.forget(inbox)
            return None, error
        inbox.engine = engine
        self._ensure_reader(engine)
        return inbox, None

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        try:
            with self._calling_ray():
                return bool(ray.get(self.coordinator.cancel.remote(request_id, reason), timeout=10))
        except _Stopped:
            return False
        except Exception:  # noqa: BLE001
            log.exception("cancel of %s failed", request_id)
            return False

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
        with self._lock:
            self._stopped.set()  # under the lock: `_ensure_reader` and `_calling_ray` see it there
            readers = list(self._readers.values())
            self._left_ray.wait_for(lambda: self._in_ray == 0, timeout)
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
        try:
            with self._calling_ray():
                handle = ray.get_actor(engine, namespace=self._ns)
        except _Stopped:
            return
        except ValueError:
            self._fail_engine(engine, "engine is gone")
            return
        pending = None  # a drain call not answered yet: asked again, never sent twice (it takes events)
        while True:
            try:
                with self._calling_ray():
                    if pending is None:
                        pending = handle.drain.remote(self.front, DRAIN_POLL_S)
                    events = ray.get(pending, timeout=DRAIN_POLL_S + DRAIN_SLACK_S)
                pending = None
            except (_Stopped, SystemExit):  # SystemExit: what Ray raises here when it shuts down
                return
            except GetTimeoutError:  # a busy engine: wait on, letting a `stop` in between
                continue
            except Exception as exc:  # noqa: BLE001 - RayActorError and friends: the engine died
                log.warning("engine %s unreachable: %s", engine, exc)
                self._fail_engine(engine, f"engine {engine} died")
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

    def _fail_engine(self, engine: str, message: str) -> None:
        """Fail the requests of a dead engine, once the coordinator has dropped it. Those filed
        under its name after the snapshot (submitted meanwhile, perhaps to an engine registered
        again under the name) get a reader of their own, which finds out which."""
        with self._lock:
            lost = [i for i in self._inboxes.values() if i.engine == engine]
        try:
            with self._calling_ray():
                ray.get(self.coordinator.check_engine.remote(engine), timeout=15)
        except _Stopped:
            pass
        except Exception:  # noqa: BLE001 - the requests fail all the same
            log.exception("could not report engine %s to the coordinator", engine)
        with self._lock:
            if self._readers.get(engine) is threading.current_thread():
                del self._readers[engine]
            failed = {id(i) for i in lost}
            newer = any(i.engine == engine and id(i) not in failed for i in self._inboxes.values())
        for inbox in lost:
            inbox.fail(_UNAVAILABLE, message)
        if newer:
            self._ensure_reader(engine)
