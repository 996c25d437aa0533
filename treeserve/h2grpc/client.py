"""A gRPC client for one hot bidirectional-streaming method, written on a socket: the caller's thread
writes the request and reads the response itself, so a step costs no thread hand-off (grpcio's sync
client sends a stream's requests from its own thread and reads responses on another).

`DirectStreamSession` has `treeserve.stream_session.StreamSession`'s contract: `send(request)`
returns the response, one at a time; failures are grpc.RpcError with `code()` and `details()`; any
failure ends the stream and the next `send` opens a new one (on a new connection if the old one
broke). It speaks to any gRPC server over cleartext HTTP/2: to the verifier's direct port
(`treeserve.h2grpc.server`) or to a grpcio server.

`DirectStream` keeps several requests in flight on one stream instead: `write(request)` sends at
once, `read(timeout)` returns the next response or None when none came in time (the stream stays
open; a late response is read later). The orchestrator's draft link uses it on the drafter's direct
port, one request per sequence of its batch."""
from __future__ import annotations

import select
import socket
import time
from collections import deque
from typing import Callable

import grpc
import hpack

from treeserve.h2grpc import frames as f
from treeserve.h2grpc.peer import Peer, StreamReset
from treeserve.server import MAX_MESSAGE_BYTES
from treeserve.stream_session import StreamError

CONNECT_TIMEOUT_S = 10.0
# How long `DirectStream.read(0)` waits for the rest of a frame whose first bytes have come
PARTIAL_FRAME_S = 0.05


def _status(value: str) -> grpc.StatusCode:
    """A `grpc-status` header's code (UNKNOWN when missing or not a code)."""
    for status in grpc.StatusCode:
        if str(status.value[0]) == value:
            return status
    return grpc.StatusCode.UNKNOWN


class _ClientPeer(Peer):
    end_stream_ends_call = True


class _Connection:
    """One socket to the server, its HTTP/2 state, and at most one open stream."""

    def __init__(self, address: str, connect_timeout: float = CONNECT_TIMEOUT_S):
        host, _, port = address.rpartition(":")
        self.authority = address
        self.connect_timeout = connect_timeout
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=connect_timeout)
        except OSError as exc:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"cannot connect to {address}: {exc}") from exc
        sock.settimeout(None)
        self.peer = _ClientPeer(sock)  # no polling: it waits out a whole forward (and six runs saw no gain)
        self.next_sid = 1
        self.peer.queue(f.PREFACE + self.peer.local_settings())
        self.broken = False

    def handshake(self, address: str) -> None:
        """Send the preface and settings, read the server's SETTINGS: UNAVAILABLE (a StreamError)
        when the server does not answer as HTTP/2."""
        try:
            self.peer.flush()
            self.peer.sock.settimeout(self.connect_timeout)
            ftype, flags, _, payload, _ = self.peer.reader.read()  # the server's SETTINGS
            self.peer.sock.settimeout(None)
            if ftype != f.SETTINGS or flags & f.ACK:
                raise f.ProtocolError("the server did not start with SETTINGS")
            self.peer.control(ftype, flags, 0, payload)
        except (f.ConnectionClosed, f.ProtocolError, OSError) as exc:
            self.close()
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"{address} does not answer as gRPC: {exc}") from exc

    def still_open(self) -> bool:
        """Before a new stream on a connection that may have sat without one: take the frames the
        server sent meanwhile (a SETTINGS ack, a PING, the end of an old stream). False when it has
        gone away: a GOAWAY (a server closes connections idle for long) or the socket closed."""
        sock = self.peer.sock
        try:
            while self.peer.reader.buffered or select.select([sock], [], [], 0)[0]:
                sock.settimeout(self.connect_timeout)  # the frame has begun to come: its rest follows
                ftype, flags, sid, payload, flow = self.peer.reader.read()
                if self.peer.control(ftype, flags, sid, payload):  # raises ConnectionClosed on a GOAWAY
                    continue
                if ftype == f.HEADERS:  # an old stream's: decoded all the same, for HPACK's table
                    self.peer.header_block(sid, flags, payload)
                elif ftype == f.DATA:
                    self.peer.received(sid, flow, stream_open=False)
            sock.settimeout(None)
        except (f.ConnectionClosed, f.ProtocolError, hpack.HPACKError, OSError):
            self.close()
            return False
        return True

    def open_stream(self, path: str, auth: str | None) -> int:
        """A new stream of `path` (its HEADERS queued, not yet flushed): its id."""
        sid = self.next_sid
        self.next_sid += 2
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", self.authority),
                   ("content-type", "application/grpc"), ("te", "trailers"), ("user-agent", "treeserve-h2grpc")]
        if auth:
            headers.append(("authorization", auth))
        self.peer.open_stream(sid)
        self.peer.queue_headers(sid, headers, end_stream=False)
        return sid

    def close(self) -> None:
        self.broken = True
        self.peer.close()


class _StreamOver(StreamError):
    """The server ended or reset the stream (nothing is left to reset at this end)."""


class _ReadTimedOut(Exception):
    """No whole frame came within the socket's timeout or the reader's deadline: what was read
    stays buffered for the next read. (A TimeoutError instead means a write timed out, part of a
    frame may have gone, and the connection is unusable.)"""


def _read_messages(conn: _Connection, sid: int, messages: f.MessageBuffer) -> list[bytes]:
    """Read frames of `conn` until stream `sid` delivers one or more whole messages (returned).
    The server's end of the stream raises _StreamOver with its status; the socket's timeout (or
    its reader's deadline) raises _ReadTimedOut, with what was read kept for the next call."""
    while True:
        out = _read_frame(conn, sid, messages)
        if out:
            return out  # the windows owed go out with the next request


def _read_frame(conn: _Connection, sid: int, messages: f.MessageBuffer) -> list[bytes]:
    """Read one frame of `conn` and act on it: the whole messages of stream `sid` it completes (none
    for most frames). Raises as `_read_messages` does."""
    peer = conn.peer
    try:
        ftype, flags, stream, payload, flow = peer.reader.read()
    except TimeoutError:
        raise _ReadTimedOut() from None
    if peer.control(ftype, flags, stream, payload):  # may write (an ACK, windows): its TimeoutError passes
        return []
    if ftype == f.DATA:
        peer.received(stream, flow, stream_open=stream == sid and not flags & f.END_STREAM)
        if stream != sid:
            return []
        try:
            return messages.feed(payload)
        except (f.MessageTooLarge, ValueError) as exc:
            raise StreamError(grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(exc, f.MessageTooLarge)
                              else grpc.StatusCode.INTERNAL, f"response: {exc}") from None
    if ftype == f.HEADERS:
        headers = dict(peer.header_block(stream, flags, payload))
        if stream != sid:
            return []
        if headers.get(":status", "200") != "200":
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"HTTP status {headers[':status']}")
        if flags & f.END_STREAM:
            peer.forget(sid)
            code = _status(headers.get("grpc-status", ""))
            message = f.decode_status_message(headers.get("grpc-message", ""))
            if code == grpc.StatusCode.OK:
                raise _StreamOver(grpc.StatusCode.UNKNOWN, "the server ended the stream without a response")
            raise _StreamOver(code, message)
        return []
    if ftype == f.RST_STREAM:
        if stream == sid:
            peer.forget(sid)
            raise _StreamOver(grpc.StatusCode.INTERNAL, "the server reset the stream")
        return []
    raise f.ProtocolError(f"unexpected frame type {ftype}")


class DirectStreamSession:
    """Request/response pairs over one stream of `path` ("/package.Service/Method") at `address`
    ("host:port"). `serialize(request) -> bytes`, `deserialize(bytes) -> response`; `timeout`
    (seconds; None: no limit) bounds each response's wait, as in StreamSession."""

    def __init__(self, address: str, path: str, serialize: Callable, deserialize: Callable,
                 timeout: float | None = None, auth_token: str | None = None):
        self.address = address
        self.path = path
        self._serialize = serialize
        self._deserialize = deserialize
        self.timeout = timeout
        self._auth = f"Bearer {auth_token}" if auth_token else None
        self._conn: _Connection | None = None
        self._sid: int | None = None
        self._messages: f.MessageBuffer | None = None
        self.error: grpc.RpcError | None = None
        self._closed = False

    @property
    def open(self) -> bool:
        return self._sid is not None

    def connect(self) -> "DirectStreamSession":
        """Open the connection now (else the first `send` does): raises a grpc.RpcError with
        UNAVAILABLE when the server cannot be reached or does not speak HTTP/2."""
        if self._conn is None or self._conn.broken:
            self._conn = _Connection(self.address)
            try:
                self._conn.handshake(self.address)
            except StreamError:
                self._drop_connection()
                raise
        return self

    def send(self, request, timeout: float | None = None):
        if self._closed:
            raise ValueError("send on a closed DirectStreamSession")
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if self._sid is None:
                self._open()
            conn = self._conn
            conn.peer.sock.settimeout(timeout)  # sending too (a peer may hold its window shut)
            try:
                conn.peer.queue_data(self._sid, f.grpc_message(self._serialize(request)))
            except StreamReset:
                pass  # the server ended the call before taking the whole request: its status follows
            conn.peer.flush()
            return self._deserialize(self._response(deadline, timeout))
        except TimeoutError:  # while sending: part of a frame may have gone, so the connection goes
            failure = StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the request was not sent within {timeout:g} s")
            self.error = failure
            self._drop_connection()
            raise failure from None
        except _StreamOver as exc:
            self.error = exc
            self._sid = None  # the server ended the stream
            raise
        except grpc.RpcError as exc:
            self.error = exc
            self._end(reset=exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
            raise
        except (f.ConnectionClosed, f.ProtocolError, hpack.HPACKError, OSError) as exc:
            failure = StreamError(grpc.StatusCode.UNAVAILABLE, f"connection to {self.address} failed: {exc}")
            self.error = failure
            self._drop_connection()
            raise failure from exc

    def _open(self) -> None:
        if self._conn is None or self._conn.broken or not self._conn.still_open():
            self._conn = _Connection(self.address)
        self._sid = self._conn.open_stream(self.path, self._auth)
        self._messages = f.MessageBuffer(MAX_MESSAGE_BYTES)

    def _response(self, deadline: float | None, timeout: float | None) -> bytes:
        """This stream's next message, by `deadline` (time.monotonic(); None: no limit; `timeout`
        is what it was set from, for the message); a status ends the stream (raised)."""
        peer = self._conn.peer
        try:
            peer.reader.deadline = deadline
            messages = _read_messages(self._conn, self._sid, self._messages)
        except _ReadTimedOut:
            raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no response within {timeout:g} s") from None
        finally:
            peer.reader.deadline = None
        if len(messages) > 1:
            raise StreamError(grpc.StatusCode.INTERNAL, "more than one response to a request")
        return messages[0]

    def _end(self, reset: bool) -> None:
        """Stop the open stream: a late response's stream is reset (its answer is dropped)."""
        sid, self._sid = self._sid, None
        if sid is not None and self._conn is not None and not self._conn.broken:
            try:
                self._conn.peer.queue(f.rst_stream(sid, f.CANCEL if reset else f.NO_ERROR))
                self._conn.peer.flush()
                self._conn.peer.forget(sid)
            except (f.ConnectionClosed, OSError):
                self._drop_connection()

    def _drop_connection(self) -> None:
        self._sid = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        """End the stream and the connection; the session sends nothing more."""
        if self._sid is not None and self._conn is not None and not self._conn.broken:
            try:  # a clean end: half-close, so the server answers with its status
                self._conn.peer.queue(f.frame(f.DATA, f.END_STREAM, self._sid))
                self._conn.peer.flush()
            except (f.ConnectionClosed, OSError):
                pass
        self._drop_connection()
        self._closed = True

    def __enter__(self) -> "DirectStreamSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DirectStream:
    """One stream of the bidirectional method `path` at `address` ("host:port") carrying several
    requests at once: `write(request)` sends at once; `read(timeout)` returns the next response (in
    request order, as the server answers them) or None when none came within `timeout` seconds.
    A late response stays readable: the stream is not ended for it. `serialize(request) -> bytes`,
    `deserialize(bytes) -> response`. One thread writes and reads (it has no thread of its own, so a
    response costs its reader no hand-off); any other thread may only `abort()` it. Any failure
    (the server's status, a broken connection, a response that does not parse) raises a
    grpc.RpcError and ends the stream: `open` is then False and the caller makes a new one.
    Both ends write with blocking sends and read nothing meanwhile: a caller that writes megabytes
    of requests without reading their answers fills both sockets' buffers and its write times out
    (`send_timeout`); read what has come (`read(0)`) between writes, as the draft link does."""

    def __init__(self, address: str, path: str, serialize: Callable, deserialize: Callable,
                 auth_token: str | None = None, send_timeout: float = CONNECT_TIMEOUT_S,
                 connect_timeout: float = CONNECT_TIMEOUT_S):
        """send_timeout: how long a write may wait for the server to take its bytes;
        connect_timeout: how long the connection and the server's first SETTINGS may take."""
        self.address = address
        self._serialize = serialize
        self._deserialize = deserialize
        self._send_timeout = send_timeout
        self._conn = _Connection(address, connect_timeout)
        try:
            self._conn.handshake(address)
            self._sid: int | None = self._conn.open_stream(path, f"Bearer {auth_token}" if auth_token else None)
            self._conn.peer.flush()
        except StreamError:
            self._conn.close()
            raise
        except (f.ConnectionClosed, OSError) as exc:
            self._conn.close()
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"connection to {address} failed: {exc}") from exc
        self._messages = f.MessageBuffer(MAX_MESSAGE_BYTES)
        self._ready: deque[bytes] = deque()  # responses read off the socket, not yet returned
        # poll, not select: select cannot watch descriptors past 1023
        self._poller = select.poll()
        self._poller.register(self._conn.peer.sock, select.POLLIN)

    @property
    def open(self) -> bool:
        return self._sid is not None

    def write(self, request) -> None:
        self._check_open()
        peer = self._conn.peer
        try:
            peer.sock.settimeout(self._send_timeout)
            try:
                peer.queue_data(self._sid, f.grpc_message(self._serialize(request)))
            except StreamReset:
                pass  # the server ended the call: its status comes with the next read
            peer.flush()
        except TimeoutError:  # part of a frame may have gone: the connection is unusable
            raise self._failed(StreamError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                           f"the request was not sent within {self._send_timeout:g} s")) from None
        except (f.ConnectionClosed, f.ProtocolError, hpack.HPACKError, OSError) as exc:
            raise self._failed(StreamError(grpc.StatusCode.UNAVAILABLE,
                                           f"connection to {self.address} failed: {exc}")) from exc

    def read(self, timeout: float | None):
        """The next response, or None when none came within `timeout` seconds (0: only what has
        arrived already; None: wait as long as it takes)."""
        if not self._ready:
            self._check_open()
            try:
                self._read_some(timeout)
            except _ReadTimedOut:
                return None
            except grpc.RpcError as exc:
                raise self._failed(exc) from None
            except (TimeoutError, f.ConnectionClosed, f.ProtocolError, hpack.HPACKError, OSError, ValueError) as exc:
                raise self._failed(StreamError(grpc.StatusCode.UNAVAILABLE,
                                               f"connection to {self.address} failed: {exc}")) from exc
            finally:
                self._conn.peer.reader.deadline = None
            if not self._ready:
                return None
        message = self._ready.popleft()
        try:
            return self._deserialize(message)
        except Exception as exc:  # noqa: BLE001 - a response that does not parse ends the stream
            raise self._failed(StreamError(grpc.StatusCode.INTERNAL, f"a response that does not parse: {exc}")) \
                from exc

    def _read_some(self, timeout: float | None) -> None:
        """Read frames into `_ready`: with `timeout` 0, only those that have come (a frame whose
        first bytes have come gets PARTIAL_FRAME_S for the rest); else until a message comes."""
        peer = self._conn.peer
        if timeout is not None and timeout <= 0:
            while not self._ready and (peer.reader.buffered or self._bytes_waiting()):
                peer.reader.deadline = time.monotonic() + PARTIAL_FRAME_S
                self._ready.extend(_read_frame(self._conn, self._sid, self._messages))
            return
        if timeout is None:
            peer.sock.settimeout(None)  # the reader sets it only under a deadline
        peer.reader.deadline = None if timeout is None else time.monotonic() + timeout
        self._ready.extend(_read_messages(self._conn, self._sid, self._messages))

    def _bytes_waiting(self) -> bool:
        """Whether the socket has bytes to read (or an end or error to report) right now."""
        return bool(self._poller.poll(0))

    def abort(self) -> None:
        """End the connection from any thread: a read blocked in another thread wakes and fails."""
        self._sid = None
        try:
            self._conn.peer.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Half-close the stream and drop the connection; responses not read are lost."""
        if self._sid is not None and not self._conn.broken:
            try:
                self._conn.peer.queue(f.frame(f.DATA, f.END_STREAM, self._sid))
                self._conn.peer.flush()
            except (f.ConnectionClosed, OSError):
                pass
        self._sid = None
        self._conn.close()

    def _check_open(self) -> None:
        if self._sid is None:
            raise StreamError(grpc.StatusCode.CANCELLED, "the stream is closed")

    def _failed(self, exc: grpc.RpcError) -> grpc.RpcError:
        self._sid = None
        self._conn.close()
        return exc
