"""A gRPC client for one hot bidirectional-streaming method, written on a socket: the caller's thread
writes the request and reads the response itself, so a step costs no thread hand-off (grpcio's sync
client sends a stream's requests from its own thread and reads responses on another).

`DirectStreamSession` has `treeserve.stream_session.StreamSession`'s contract: `send(request)`
returns the response, one at a time; failures are grpc.RpcError with `code()` and `details()`; any
failure ends the stream and the next `send` opens a new one (on a new connection if the old one
broke). It speaks to any gRPC server over cleartext HTTP/2: to the verifier's direct port
(`treeserve.h2grpc.server`) or to a grpcio server."""
from __future__ import annotations

import socket
import time
from typing import Callable

import grpc
import hpack

from treeserve.h2grpc import frames as f
from treeserve.h2grpc.peer import Peer, StreamReset
from treeserve.server import MAX_MESSAGE_BYTES
from treeserve.stream_session import StreamError

CONNECT_TIMEOUT_S = 10.0


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

    def __init__(self, address: str):
        host, _, port = address.rpartition(":")
        self.authority = address
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"cannot connect to {address}: {exc}") from exc
        sock.settimeout(None)
        self.peer = _ClientPeer(sock)  # no polling: it waits out a whole forward (and six runs saw no gain)
        self.next_sid = 1
        self.peer.queue(f.PREFACE + self.peer.local_settings())
        self.broken = False

    def close(self) -> None:
        self.broken = True
        self.peer.close()


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
                self._conn.peer.flush()
                self._conn.peer.sock.settimeout(CONNECT_TIMEOUT_S)
                ftype, flags, _, payload, _ = self._conn.peer.reader.read()  # the server's SETTINGS
                self._conn.peer.sock.settimeout(None)
                if ftype != f.SETTINGS or flags & f.ACK:
                    raise f.ProtocolError("the server did not start with SETTINGS")
                self._conn.peer.control(ftype, flags, 0, payload)
            except (f.ConnectionClosed, f.ProtocolError, OSError) as exc:
                self._drop_connection()
                raise StreamError(grpc.StatusCode.UNAVAILABLE, f"{self.address} does not answer as gRPC: {exc}") \
                    from exc
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
        if self._conn is None or self._conn.broken:
            self._conn = _Connection(self.address)
        conn = self._conn
        sid = conn.next_sid
        conn.next_sid += 2
        headers = [(":method", "POST"), (":scheme", "http"), (":path", self.path), (":authority", conn.authority),
                   ("content-type", "application/grpc"), ("te", "trailers"), ("user-agent", "treeserve-h2grpc")]
        if self._auth:
            headers.append(("authorization", self._auth))
        conn.peer.open_stream(sid)
        conn.peer.queue_headers(sid, headers, end_stream=False)
        self._sid = sid
        self._messages = f.MessageBuffer(MAX_MESSAGE_BYTES)

    def _response(self, deadline: float | None, timeout: float | None) -> bytes:
        """Read frames until this stream's next message, by `deadline` (time.monotonic(); None: no
        limit; `timeout` is what it was set from, for the message); a status ends the stream (raised)."""
        conn, sid = self._conn, self._sid
        peer = conn.peer
        while True:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no response within {timeout:g} s")
                peer.sock.settimeout(left)
            try:
                ftype, flags, stream, payload, flow = peer.reader.read()
            except TimeoutError:
                raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no response within {timeout:g} s") from None
            if peer.control(ftype, flags, stream, payload):
                continue
            if ftype == f.DATA:
                peer.received(stream, flow, stream_open=stream == sid and not flags & f.END_STREAM)
                if stream != sid:
                    continue
                try:
                    messages = self._messages.feed(payload)
                except (f.MessageTooLarge, ValueError) as exc:
                    raise StreamError(grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(exc, f.MessageTooLarge)
                                      else grpc.StatusCode.INTERNAL, f"response: {exc}") from None
                if messages:
                    if len(messages) > 1:
                        raise StreamError(grpc.StatusCode.INTERNAL, "more than one response to a request")
                    return messages[0]  # the windows owed go out with the next request
            elif ftype == f.HEADERS:
                headers = dict(peer.header_block(stream, flags, payload))
                if stream != sid:
                    continue
                if headers.get(":status", "200") != "200":
                    raise StreamError(grpc.StatusCode.UNAVAILABLE, f"HTTP status {headers[':status']}")
                if flags & f.END_STREAM:
                    self._sid = None  # the server ended the stream
                    peer.forget(sid)
                    code = _status(headers.get("grpc-status", ""))
                    message = f.decode_status_message(headers.get("grpc-message", ""))
                    if code == grpc.StatusCode.OK:
                        raise StreamError(grpc.StatusCode.UNKNOWN, "the server ended the stream without a response")
                    raise StreamError(code, message)
            elif ftype == f.RST_STREAM:
                if stream == sid:
                    self._sid = None
                    peer.forget(sid)
                    raise StreamError(grpc.StatusCode.INTERNAL, "the server reset the stream")
            else:
                raise f.ProtocolError(f"unexpected frame type {ftype}")

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
