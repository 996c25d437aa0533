"""Request/response over one long-lived bidirectional stream, one pair at a time, with a deadline
per message: what a client uses in place of a unary call it makes every step (a stream message
costs less than a call). Failures look like a failed call: a grpc.RpcError with `code()` and
`details()`.

Built on gRPC's sync API: requests go through a queue that feeds the call's request generator
(gRPC sends them from its own thread), and the response is read with `next()` on the caller's
thread, where a unary call would wait, so a step pays no extra thread hand-off on the way back.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from typing import Callable, Iterator

import grpc


class StreamError(grpc.RpcError):
    """A stream failure the client decides on itself (a response's deadline passed, the stream
    ended without an answer), shaped like the grpc.RpcError of a call: `code()` and `details()`,
    so callers handle both alike."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class StreamSession:
    """One stream of a stream-stream method (`stub.Method`), opened on the first `send` and kept
    open: `send(request)` writes one request and returns its response. One caller at a time (as
    one engine loop is); the server must answer every request with exactly one response, in order.

    The stream itself has no deadline. `timeout` (seconds; None: wait as long as it takes) bounds
    the wait for each response: when it passes, the stream is cancelled and `send` raises a
    grpc.RpcError with code DEADLINE_EXCEEDED, as a unary call would. Any failure ends the stream:
    `send` raises the grpc.RpcError (also kept as `error`) and the next `send` opens a new stream.
    A server without the method fails the first `send` with UNIMPLEMENTED."""

    def __init__(self, method: Callable, timeout: float | None = None):
        self._method = method
        self.timeout = timeout
        self.error: grpc.RpcError | None = None  # what ended the last stream
        self._requests: queue.SimpleQueue | None = None
        self._call = None
        self._deadlines = _Deadlines()
        self._closed = False

    @property
    def open(self) -> bool:
        """Whether a stream is open now (a session opens one on its first `send`)."""
        return self._call is not None

    def send(self, request, timeout: float | None = None):
        """The response to `request`; `timeout` overrides the session's for this message."""
        if self._closed:
            raise ValueError("send on a closed StreamSession")
        timeout = self.timeout if timeout is None else timeout
        if self._call is None:
            self._requests = queue.SimpleQueue()
            self._call = self._method(drain(self._requests))
        call = self._call
        if timeout is not None:
            # armed before the request goes: once it is queued, gRPC's sending thread wakes and
            # waits for the GIL until this thread blocks in `next`, so nothing should come between
            self._deadlines.arm(call, timeout)
        self._requests.put(request)
        failure: grpc.RpcError | None = None
        try:
            response = next(call)
        except grpc.RpcError as exc:
            failure = exc
        except StopIteration:
            failure = StreamError(grpc.StatusCode.UNKNOWN, "the server ended the stream without a response")
        if timeout is not None and self._deadlines.disarm(call):
            failure = StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no response within {timeout:g} s")
        if failure is not None:
            self.error = failure
            self._end()
            raise failure
        return response

    def close(self) -> None:
        """End the stream and the deadline thread; the session sends nothing more."""
        self._end()
        self._deadlines.close()
        self._closed = True

    def __enter__(self) -> "StreamSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _end(self) -> None:
        """Stop the open stream, if any: end its request generator (gRPC's sending thread waits
        on it) and cancel the call (the server drops the stream's queued work)."""
        if self._call is not None:
            self._requests.put(None)
            self._call.cancel()
            self._call = self._requests = None


def drain(q: queue.Queue | queue.SimpleQueue) -> Iterator:
    """Yield the items put on `q` until a None (the end of a stream's requests: a request is
    never None)."""
    while (item := q.get()) is not None:
        yield item


class _Deadlines:
    """Cancels a stream whose response is late. One thread per session, asleep until the next
    deadline it knows of, or for one timeout while nothing is awaited. A message armed with a
    deadline no earlier than that wake-up (the usual case: every message with the same timeout)
    only sets a field, so a step costs no thread wake-up; a timer started per message would cost
    about as much as the round trip it guards."""

    def __init__(self):
        self._cv = threading.Condition()
        self._armed: tuple | None = None  # (call, monotonic deadline) of the response awaited
        self._fired = None  # the call the last deadline cancelled
        self._wake = math.inf  # when the thread looks next (while it waits)
        self._idle_s = 1.0
        self._thread: threading.Thread | None = None
        self._closed = False

    def arm(self, call, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stream-deadline", daemon=True)
                self._thread.start()
            self._armed, self._idle_s = (call, deadline), timeout
            if deadline < self._wake:
                self._cv.notify()

    def disarm(self, call) -> bool:
        """Stop watching; returns whether the deadline cancelled `call` first."""
        with self._cv:
            self._armed = None
            return self._fired is call

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                now = time.monotonic()
                if self._armed is not None and self._armed[1] <= now:
                    call, self._armed = self._armed[0], None
                    self._fired = call
                    call.cancel()  # the waiting `next()` wakes with CANCELLED; `send` reports the deadline
                    continue
                self._wake = self._armed[1] if self._armed is not None else now + self._idle_s
                self._cv.wait(self._wake - now)
            self._wake = math.inf
