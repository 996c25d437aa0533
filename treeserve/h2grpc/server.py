"""A gRPC server for a few hot methods, written on sockets: one thread per connection reads a
request and runs its handler on that same thread, then writes the answer. No thread hands a
message to another, where grpcio's Python server wakes the handler's thread from its
completion-queue thread and back. With a client that does the same (`client.py`) a round trip
costs about 0.15 ms less than grpcio's at both ends; against grpcio's client the server alone
gains nothing (BENCHMARKS.md, twenty-second round). After each answer the thread polls for the
next request for `poll_s` before it sleeps.

What it serves: cleartext HTTP/2 with prior knowledge (what `grpc.insecure_channel` speaks), unary
and bidirectional-streaming methods whose handler turns one request message into one response
message, bearer-token auth, `grpc-timeout` deadlines, and gRPC status codes for every refusal.
What it leaves to the main (grpcio) server: health, reflection, every other method (UNIMPLEMENTED
here), and TLS. A connection serves its calls one at a time, in the order their messages arrive;
clients that want their calls to run together (and be batched) open one connection each. A
connection must complete its handshake (preface, then SETTINGS) within `handshake_s`, or it is
closed: each holds a thread and one of MAX_CONNECTIONS slots."""
from __future__ import annotations

import contextlib
import logging
import math
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import hpack

from treeserve.errors import (ResourceExhausted, ServeError, Unauthenticated, Unavailable, Unimplemented,
                              status_of)
from treeserve.h2grpc import frames as f
from treeserve.h2grpc.peer import Peer, StreamReset
from treeserve.server import MAX_MESSAGE_BYTES  # the main port's limit, in both directions
from treeserve.server import number_argument

log = logging.getLogger(__name__)

MAX_CONCURRENT_STREAMS = 100
MAX_CONNECTIONS = 256  # each has a thread of its own; more are refused (GOAWAY ENHANCE_YOUR_CALM)
ACCEPT_RETRY_S = 0.05  # pause after a failed accept (e.g. no file descriptor left) before the next
# How long a new connection has to send the client preface and its first SETTINGS: one that does
# not is closed, so sockets that never speak HTTP/2 cannot hold every connection slot
HANDSHAKE_SECONDS = 10.0
# How long a connection's thread polls for the next request before it sleeps (frames.FrameReader):
# a step loop's next request comes within this, at the cost of a busy core for as long
POLL_SECONDS = 0.0005
# A connection with no call open that sends nothing for this long is closed (GOAWAY NO_ERROR), and
# one whose peer takes none of an answer's bytes for SEND_TIMEOUT_S too: else silent or stalled
# peers would hold every connection slot, and their threads, for ever
IDLE_SECONDS = 300.0
SEND_TIMEOUT_S = 60.0
# A peer whose host vanished (power, a network gone) sends no FIN: TCP keepalive probes find it
# after KEEPALIVE_IDLE_S of quiet and KEEPALIVE_PROBES unanswered probes KEEPALIVE_INTERVAL_S
# apart (2 min), and the connection's read fails; before, a call it had open waited for ever
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 60, 10, 6



def add_arguments(p, methods: str) -> None:
    """A service's `--direct-port` and `--direct-poll-us` options; `methods` names what the port
    serves (for the help text)."""
    p.add_argument("--direct-port", type=int, default=None,
                   help=f"also serve {methods} on this port without grpcio's threads (a shorter round trip per "
                        "step; 0 picks a free port; default: off). See docs/internals.md")
    p.add_argument("--direct-poll-us", type=number_argument("microseconds", 1e6), default=POLL_SECONDS * 1e6,
                   metavar="US",
                   help="how long a direct-port connection polls for its next request before it sleeps (a busy "
                        f"core meanwhile, a faster next step; 0: never; default {POLL_SECONDS * 1e6:g})")


@dataclass(frozen=True)
class Method:
    """A served method: `handle(request_bytes, call) -> response_bytes` for each request message.
    Unary methods take one request; streaming ones (bidirectional) answer each request in turn.
    A handler that raises ends the call with the exception's status (`treeserve.errors.status_of`)."""

    handle: Callable[[bytes, "Call"], bytes]
    streaming: bool = False


class Call:
    """What a handler may ask about its call (the parts of grpc.ServicerContext the services use)."""

    __slots__ = ("_conn", "sid", "metadata", "_deadline")

    def __init__(self, conn: "_Connection", sid: int, metadata: dict[str, str], deadline: float | None):
        self._conn = conn
        self.sid = sid
        self.metadata = metadata
        self._deadline = deadline

    def is_active(self) -> bool:
        return self._conn.serving and self.sid in self._conn.streams

    def add_callback(self, fn: Callable[[], None]) -> bool:
        """Run `fn` once the response has been written (bookkeeping off the caller's path)."""
        self._conn.after.append(fn)
        return True

    def time_remaining(self) -> float:
        """Seconds left before the call's deadline (infinity without one)."""
        return math.inf if self._deadline is None else self._deadline - time.monotonic()


class _Stream:
    __slots__ = ("method", "call", "messages", "requests", "headers_sent", "half_closed")

    def __init__(self, method: Method, call: Call, max_message: int):
        self.method = method
        self.call = call
        self.messages = f.MessageBuffer(max_message)
        self.requests: list[bytes] = []  # a unary call's request, until the client half-closes
        self.headers_sent = False
        self.half_closed = False


RESPONSE_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]


class DirectServer:
    """Serve `methods` ({"/package.Service/Method": Method}) on `address` ("host:port"; port 0 picks
    one). `start()`, then `stop(grace)`."""

    def __init__(self, address: str, methods: dict[str, Method], auth_token: str | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, thread_context: Callable | None = None,
                 poll_s: float = POLL_SECONDS, handshake_s: float = HANDSHAKE_SECONDS,
                 idle_s: float = IDLE_SECONDS, send_timeout_s: float = SEND_TIMEOUT_S):
        """thread_context: a context manager factory entered once by each connection thread (the
        verifier keeps torch's inference mode on for good in the threads that run its model);
        poll_s: how long a connection's thread polls for more bytes before it sleeps (0: never);
        handshake_s: how long a new connection has to send its preface and first SETTINGS before
        it is closed; idle_s: how long one with no call open may send nothing; send_timeout_s: how
        long a write may make no progress before the connection is closed."""
        if not poll_s >= 0:
            raise ValueError(f"poll_s must be >= 0, got {poll_s}")
        for name, value in (("handshake_s", handshake_s), ("idle_s", idle_s), ("send_timeout_s", send_timeout_s)):
            if not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        self.poll_s = poll_s
        self.handshake_s = handshake_s
        self.idle_s = idle_s
        self.send_timeout_s = send_timeout_s
        host, _, port = address.rpartition(":")
        self._bind = (host.strip("[]") or "0.0.0.0", int(port))
        self.methods = dict(methods)
        self._auth = f"Bearer {auth_token}" if auth_token else None
        self.max_message_bytes = max_message_bytes
        self._thread_context = thread_context
        self._listener: socket.socket | None = None
        self._connections: set[_Connection] = set()
        self._lock = threading.Lock()
        self.stopping = threading.Event()
        self._acceptor: threading.Thread | None = None
        self.port: int | None = None

    def start(self) -> "DirectServer":
        family = socket.AF_INET6 if ":" in self._bind[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(self._bind)
        except OSError as exc:
            sock.close()
            # grpcio's words for the same failure, which `orchestrator.procs` recognises
            raise OSError(exc.errno, f"Failed to bind to address {self._bind[0]}:{self._bind[1]}: {exc.strerror}") \
                from exc
        sock.listen(64)
        self._listener = sock
        self.port = sock.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name="h2grpc-accept", daemon=True)
        self._acceptor.start()
        return self

    def _accept(self) -> None:
        warned = -math.inf
        while not self.stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self.stopping.is_set() or self._listener.fileno() < 0:
                    return  # the listener was closed: stopping
                # out of file descriptors, or a connection that failed while queued: the port
                # must go on accepting once that passes
                if time.monotonic() - warned > 10.0:  # once in a while, not 20 times a second
                    log.warning("h2grpc: accept failed (%s); accepting again shortly", exc)
                    warned = time.monotonic()
                time.sleep(ACCEPT_RETRY_S)
                continue
            try:
                conn = _Connection(self, sock)
            except OSError as exc:  # its socket options could not be set: this one connection goes
                log.warning("h2grpc: could not set up a connection (%s)", exc)
                sock.close()
                continue
            with self._lock:
                if self.stopping.is_set():
                    sock.close()
                    return
                full = len(self._connections) >= MAX_CONNECTIONS
                if not full:
                    self._connections.add(conn)
            if full:
                log.warning("h2grpc: %d connections open; refusing another", MAX_CONNECTIONS)
                try:
                    sock.sendall(f.settings_frame({}) + f.goaway(0, f.ENHANCE_YOUR_CALM, b"too many connections"))
                except OSError:
                    pass
                sock.close()
                continue
            threading.Thread(target=conn.run, name="h2grpc-conn", daemon=True).start()

    def _closed(self, conn: "_Connection") -> None:
        with self._lock:
            self._connections.discard(conn)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting; let each connection finish the call it is running (up to `grace`
        seconds), end its other open calls with UNAVAILABLE, send GOAWAY and close."""
        self.stopping.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns = list(self._connections)
        for conn in conns:
            conn.wake()
        end = time.monotonic() + grace
        for conn in conns:
            conn.done.wait(max(0.0, end - time.monotonic()))
        for conn in conns:
            conn.peer.close()


def _keep_alive(sock: socket.socket) -> None:
    """TCP keepalive on `sock` with this port's bounds (KEEPALIVE_*; where the system has them)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _Connection:
    def __init__(self, server: DirectServer, sock: socket.socket):
        self.server = server
        self.handshake_by = time.monotonic() + server.handshake_s
        # a kernel-level send timeout: Python's own timeout would also bound the blocking reads
        seconds = int(server.send_timeout_s)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", seconds, int((server.send_timeout_s - seconds) * 1e6)))
        _keep_alive(sock)
        self.peer = Peer(sock, poll_s=server.poll_s)
        self.streams: dict[int, _Stream] = {}
        self.last_sid = 0
        self.serving = True
        self.done = threading.Event()
        self.after: list[Callable[[], None]] = []  # Call.add_callback's, run after the next write

    def wake(self) -> None:
        """Make the connection's thread stop reading (it finishes the call it runs first)."""
        try:
            self.peer.sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def run(self) -> None:
        ctx = self.server._thread_context() if self.server._thread_context else None
        try:
            if ctx is not None:
                ctx.__enter__()
            self._serve()
        except f.ConnectionClosed:
            pass
        except f.ProtocolError as exc:
            log.info("h2grpc connection ended: %s", exc)
            self._goaway(exc.code, str(exc))
        except hpack.OversizedHeaderListError:
            self._goaway(f.COMPRESSION_ERROR, "header list too large")
        except Exception:  # noqa: BLE001 - one broken connection must not stop the others
            log.exception("h2grpc connection failed")
            self._goaway(f.INTERNAL_ERROR, "internal error")
        finally:
            self.serving = False
            if self.server.stopping.is_set():
                self._end_open_streams()
                self._goaway(f.NO_ERROR, "server shutting down")
            self._run_after()
            if ctx is not None:
                ctx.__exit__(None, None, None)
            self.peer.close()
            self.server._closed(self)
            self.done.set()

    def _goaway(self, code: int, message: str) -> None:
        try:
            self.peer.queue(f.goaway(self.last_sid, code, message.encode()[:256]))
            self.peer.flush()
        except (f.ConnectionClosed, OSError):
            pass

    def _end_open_streams(self) -> None:
        for sid in list(self.streams):
            try:
                self._finish(sid, Unavailable("the server is shutting down"))
            except (f.ConnectionClosed, OSError):
                return
        try:
            self.peer.flush()
        except (f.ConnectionClosed, OSError):
            pass

    def _serve(self) -> None:
        peer = self.peer
        self._handshake()
        while not self.server.stopping.is_set():
            ftype, flags, sid, payload, flow = self._read()
            if peer.control(ftype, flags, sid, payload):
                continue
            if ftype == f.HEADERS:
                self._headers(sid, flags, payload)
            elif ftype == f.DATA:
                self._data(sid, flags, payload, flow)
            elif ftype == f.RST_STREAM:
                if self.streams.pop(sid, None) is not None:
                    peer.forget(sid)
            else:  # CONTINUATION outside a header block
                raise f.ProtocolError(f"unexpected frame type {ftype}")
            peer.flush(only_with_output=True)
            if self.after:
                self._run_after()

    def _read(self):
        """The next frame; with no call open, waiting at most the server's `idle_s` for it (then
        GOAWAY NO_ERROR, and the connection ends)."""
        peer = self.peer
        if self.streams:  # (bytes already buffered do not lift the bound: a partial frame waits on it)
            return peer.reader.read()
        peer.reader.deadline = time.monotonic() + self.server.idle_s
        try:
            return peer.reader.read()
        except TimeoutError as exc:
            self._goaway(f.NO_ERROR, "idle")
            raise f.ConnectionClosed(f"no call and no frame for {self.server.idle_s:g} s") from exc
        finally:
            peer.reader.deadline = None
            with contextlib.suppress(OSError):
                peer.sock.settimeout(None)  # blocking again: Python's timeout would bound writes too

    def _handshake(self) -> None:
        """Read the client's connection preface and its first frame, which must be SETTINGS (RFC
        9113 §3.4), by `handshake_by`; this end's SETTINGS go out after the preface. A client
        that sends neither in time, or trickles them, is closed (ConnectionClosed) instead of
        holding a connection slot, and its thread, for ever."""
        peer = self.peer
        reader = peer.reader
        reader.deadline = self.handshake_by
        try:
            if reader.exact(len(f.PREFACE)) != f.PREFACE:
                raise f.ConnectionClosed("not an HTTP/2 client preface")
            peer.queue(peer.local_settings(max_concurrent_streams=MAX_CONCURRENT_STREAMS))
            peer.flush()
            ftype, flags, sid, payload, _ = reader.read()
        except TimeoutError as exc:
            raise f.ConnectionClosed(f"no HTTP/2 handshake within {self.server.handshake_s:g} s") from exc
        finally:
            reader.deadline = None
            with contextlib.suppress(OSError):  # closed meanwhile (stop): the next read says so
                peer.sock.settimeout(None)  # blocking again: calls wait as long as they need
        if ftype != f.SETTINGS or flags & f.ACK:
            raise f.ProtocolError("the client preface must end with a SETTINGS frame")
        peer.control(ftype, flags, sid, payload)

    def _run_after(self) -> None:
        todo, self.after = self.after, []
        for fn in todo:
            try:
                fn()
            except Exception:  # noqa: BLE001 - bookkeeping must not end the connection
                log.exception("h2grpc call callback failed")

    # ---- a call's start ----------------------------------------------------------------------
    def _headers(self, sid: int, flags: int, payload: bytes) -> None:
        if sid == 0 or sid % 2 == 0:
            raise f.ProtocolError(f"HEADERS on stream {sid}")
        headers = self.peer.header_block(sid, flags, payload)  # decoded always: it updates HPACK state
        stream = self.streams.get(sid)
        if stream is not None or sid <= self.last_sid:  # trailers: the client is done sending
            if stream is not None and flags & f.END_STREAM:
                self._half_close(sid, stream)
            return
        self.last_sid = sid
        meta: dict[str, str] = {}
        for name, value in headers:
            meta[name] = value
        if meta.get(":method") != "POST" or ":path" not in meta:
            self.peer.queue(f.rst_stream(sid, f.PROTOCOL_ERROR))
            return
        if not meta.get("content-type", "").startswith("application/grpc"):
            self.peer.queue_headers(sid, [(":status", "415")], end_stream=True)
            return
        if len(self.streams) >= MAX_CONCURRENT_STREAMS:
            self.peer.queue(f.rst_stream(sid, f.REFUSED_STREAM))
            return
        deadline = None
        if "grpc-timeout" in meta:
            try:
                deadline = time.monotonic() + f.timeout_seconds(meta["grpc-timeout"])
            except ValueError:
                deadline = None  # ignored, as gRPC's own servers ignore a malformed one
        method = self.server.methods.get(meta[":path"])
        self.peer.open_stream(sid)
        self.streams[sid] = stream = _Stream(method, Call(self, sid, meta, deadline), self.server.max_message_bytes)
        if self.server._auth is not None and meta.get("authorization") != self.server._auth:
            self._finish(sid, Unauthenticated("missing or wrong bearer token"))
        elif method is None:
            self._finish(sid, Unimplemented(f"method {meta[':path']} is not served on this port (the main port "
                                            "serves it)"))
        elif flags & f.END_STREAM:
            self._half_close(sid, stream)

    # ---- messages ----------------------------------------------------------------------------
    def _data(self, sid: int, flags: int, payload: bytes, flow: int) -> None:
        stream = self.streams.get(sid)
        self.peer.received(sid, flow, stream_open=stream is not None and not flags & f.END_STREAM)
        if stream is None:
            if sid == 0 or sid > self.last_sid:
                raise f.ProtocolError(f"DATA on idle stream {sid}")
            return  # a call already answered (refused, failed or reset): its data is dropped
        try:
            messages = stream.messages.feed(payload)
        except f.MessageTooLarge as exc:
            self._finish(sid, ResourceExhausted(str(exc)))
            return
        except ValueError as exc:
            self._finish(sid, Unimplemented(str(exc)))
            return
        for message in messages:
            if stream.method.streaming:
                if not self._answer(sid, stream, message):
                    return
            else:
                stream.requests.append(message)
                if len(stream.requests) > 1:
                    self._finish(sid, ServeError("a unary call with more than one request"))
                    return
        if flags & f.END_STREAM:
            self._half_close(sid, stream)

    def _half_close(self, sid: int, stream: _Stream) -> None:
        stream.half_closed = True
        if stream.method.streaming:
            if not stream.messages.empty:
                self._finish(sid, ServeError("the stream ended inside a message"))
            else:
                self._finish(sid, None)
        elif len(stream.requests) != 1 or not stream.messages.empty:
            self._finish(sid, ServeError("a unary call needs exactly one request"))
        elif self._answer(sid, stream, stream.requests[0]):
            self._finish(sid, None)

    def _answer(self, sid: int, stream: _Stream, message: bytes) -> bool:
        """Run the handler on one request and queue its response; False when the call ended."""
        try:
            response = stream.method.handle(message, stream.call)
        except Exception as exc:  # noqa: BLE001 - every failure is the call's status
            if not isinstance(exc, ServeError):
                log.exception("h2grpc handler failed on %s", stream.call.metadata.get(":path"))
            self._finish(sid, exc)
            return False
        peer = self.peer
        if not stream.headers_sent:
            peer.queue_headers(sid, RESPONSE_HEADERS, end_stream=False)
            stream.headers_sent = True
        try:
            peer.queue_data(sid, f.grpc_message(response))
        except StreamReset:
            self.streams.pop(sid, None)
            peer.forget(sid)
            return False
        return True

    def _finish(self, sid: int, exc: BaseException | None) -> None:
        """End the call with OK (exc None) or the exception's status; a client still sending is told
        to stop (RST_STREAM NO_ERROR after the trailers, as gRPC servers do)."""
        stream = self.streams.pop(sid, None)
        code, message = (grpc.StatusCode.OK, "") if exc is None else status_of(exc)
        trailers = [("grpc-status", str(code.value[0]))]
        if message:
            trailers.append(("grpc-message", f.encode_status_message(message)))
        if stream is None or not stream.headers_sent:
            trailers = RESPONSE_HEADERS + trailers  # a trailers-only response
        self.peer.queue_headers(sid, trailers, end_stream=True)
        if stream is not None and not stream.half_closed:
            self.peer.queue(f.rst_stream(sid, f.NO_ERROR))
        self.peer.forget(sid)
