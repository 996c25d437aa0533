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

import logging
import queue
import threading
import time
from typing import Optional

import ray

from orchestrator.names import COORDINATOR
from orchestrator.request import Event, RequestSpec

log = logging.getLogger("treeserve.orchestrator.router")

_UNAVAILABLE = 14
DRAIN_POLL_S = 1.0  # how long one `EngineActor.drain` call waits for events


class Inbox:
    """A request's events, in order."""

    def __init__(self, request_id: str):
        self.request_id = request_id
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


class Router:
    def __init__(self, namespace: str, front: str):
        self.front = front
        self._ns = namespace
        self.coordinator = ray.get_actor(COORDINATOR, namespace=namespace)
        self._lock = threading.Lock()
        self._inboxes: dict[str, Inbox] = {}
        self._readers: dict[str, threading.Thread] = {}
        self._stopped = threading.Event()

    def submit(self, spec: RequestSpec) -> tuple[Optional[Inbox], Optional[tuple[int, str]]]:
        """(inbox, None) or (None, (grpc code number, message))."""
        inbox = Inbox(spec.request_id)
        with self._lock:
            if spec.request_id in self._inboxes:
                return None, (6, f"request id {spec.request_id!r} is already live")
            self._inboxes[spec.request_id] = inbox
        try:
            engine, error = ray.get(self.coordinator.submit.remote(spec))
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
            return bool(ray.get(self.coordinator.cancel.remote(request_id, reason), timeout=10))
        except Exception:  # noqa: BLE001
            log.exception("cancel of %s failed", request_id)
            return False

    def forget(self, inbox: Inbox) -> None:
        """Stop filing events for `inbox`'s request (idempotent). Only that inbox: a new request
        may reuse the id as soon as its client has heard the end of this one."""
        with self._lock:
            if self._inboxes.get(inbox.request_id) is inbox:
                del self._inboxes[inbox.request_id]

    def limits(self) -> Optional[dict]:
        return ray.get(self.coordinator.limits.remote())

    def stop(self, timeout: float = 3 * DRAIN_POLL_S) -> bool:
        """Stop the readers and wait (at most `timeout`) until they have ended; each ends within
        one drain poll. Ray must not be shut down under a thread still blocked in `ray.get`: that
        can crash the whole process. True when every reader has ended."""
        self._stopped.set()
        with self._lock:  # `_ensure_reader` starts none once the flag is set
            readers = list(self._readers.values())
        deadline = time.monotonic() + timeout
        for t in readers:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in readers)

    def _ensure_reader(self, engine: str) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            t = self._readers.get(engine)
            if t is not None and t.is_alive():
                return
            t = threading.Thread(target=self._read, args=(engine,), name=f"reader-{engine}", daemon=True)
            self._readers[engine] = t
        t.start()

    def _read(self, engine: str) -> None:
        try:
            handle = ray.get_actor(engine, namespace=self._ns)
        except ValueError:
            self._fail_engine(engine, "engine is gone")
            return
        while not self._stopped.is_set():
            try:
                events = ray.get(handle.drain.remote(self.front, DRAIN_POLL_S))
            except SystemExit:  # what Ray raises here when this process shuts it down
                return
            except Exception as exc:  # noqa: BLE001 - RayActorError and friends: the engine died
                if self._stopped.is_set():
                    return
                log.warning("engine %s unreachable: %s", engine, exc)
                self._fail_engine(engine, f"engine {engine} died")
                return
            for ev in events:
                with self._lock:
                    inbox = self._inboxes.get(ev.request_id)
                if inbox is None:
                    continue
                if ev.moved_to is not None:
                    inbox.engine = ev.moved_to
                    self._ensure_reader(ev.moved_to)
                    continue
                inbox.deliver(ev)

    def _fail_engine(self, engine: str, message: str) -> None:
        try:
            ray.get(self.coordinator.check_engine.remote(engine), timeout=15)
        except Exception:  # noqa: BLE001 - the requests fail all the same
            log.exception("could not report engine %s to the coordinator", engine)
        with self._lock:
            lost = [i for i in self._inboxes.values() if i.engine == engine]
            self._readers.pop(engine, None)
        for inbox in lost:
            inbox.fail(_UNAVAILABLE, message)
