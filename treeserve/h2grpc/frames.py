"""HTTP/2 framing as gRPC uses it (RFC 9113 §4 and §6; gRPC's "PROTOCOL-HTTP2" document): frame
types, flags, settings, error codes, one frame's bytes, a frame reader over a socket, gRPC's
length-prefixed messages, and the `grpc-timeout` and `grpc-message` header encodings.

Only what a cleartext (h2c, prior knowledge) gRPC peer needs: no push, no priorities (read and
ignored), no compression of messages."""
from __future__ import annotations

import socket
import struct
import time
import urllib.parse
from collections import deque

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# flags
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# settings
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = \
    range(1, 7)
# error codes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 5, 6, 7, 8, 9
ENHANCE_YOUR_CALM = 11

DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME = 16384
MAX_WINDOW = 2**31 - 1
# what a peer here reads in one frame: the protocol's smallest allowed maximum, which every
# peer must accept and which gRPC's own peers send anyway
RECEIVE_MAX_FRAME = DEFAULT_MAX_FRAME


class ProtocolError(Exception):
    """The connection broke the protocol: it ends with GOAWAY(code)."""

    def __init__(self, message: str, code: int = PROTOCOL_ERROR):
        super().__init__(message)
        self.code = code


class ConnectionClosed(Exception):
    """The peer closed the connection (or it failed)."""


def frame(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One frame: its 9-byte header, then the payload."""
    return struct.pack(">I", len(payload))[1:] + bytes((ftype, flags)) + struct.pack(">I", stream) + payload


def settings_frame(pairs: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in pairs.items()))


def window_update(stream: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream, struct.pack(">I", increment))


def rst_stream(stream: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream, struct.pack(">I", code))


def goaway(last_stream: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, struct.pack(">II", last_stream, code) + debug)


def parse_settings(payload: bytes) -> dict[int, int]:
    if len(payload) % 6:
        raise ProtocolError("SETTINGS payload is not a multiple of 6 bytes", FRAME_SIZE_ERROR)
    return {k: v for k, v in struct.iter_unpack(">HI", payload)}


class FrameReader:
    """Frames off a socket: `read()` -> (type, flags, stream, payload, flow-controlled length),
    with DATA and HEADERS padding and HEADERS priority fields already removed. Frames put back with
    `defer` come first.

    `poll_s`: before it blocks for more bytes, the reader polls the socket for up to this long. A
    thread that sleeps in `recv` wakes up later than one that polls, and then runs on cold caches:
    on the H100 host a verifier connection that polled for 0.5 ms after each reply took 0.075 ms
    (mean of six runs) off a batch-1 step (BENCHMARKS.md, twenty-second round).

    `deadline` (a time.monotonic() instant, or None): while set, reads that would wait past it
    raise TimeoutError, however the bytes trickle in (a server's bound on a client's handshake);
    what was read stays buffered. The caller restores the socket's own timeout afterwards."""

    def __init__(self, sock: socket.socket, max_frame: int = RECEIVE_MAX_FRAME, poll_s: float = 0.0):
        self.poll_s = poll_s
        self.deadline: float | None = None
        self._sock = sock
        self._buf = bytearray()
        self._max = max_frame
        self._deferred: deque = deque()

    def defer(self, item) -> None:
        self._deferred.append(item)

    @property
    def deferred_count(self) -> int:
        return len(self._deferred)

    @property
    def buffered(self) -> bool:
        """Whether frames or bytes of one wait here, read off the socket already."""
        return bool(self._deferred or self._buf)

    def exact(self, n: int) -> bytes:
        """The next n bytes of the connection (the preface)."""
        self._fill(n)
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def _fill(self, n: int) -> None:
        if len(self._buf) >= n:
            return
        poll_end = time.perf_counter() + self.poll_s if self.poll_s else 0.0
        while len(self._buf) < n:
            polling = poll_end and time.perf_counter() < poll_end
            try:
                if self.deadline is not None:
                    self._sock.settimeout(self._time_left())
                chunk = self._sock.recv(max(65536, n - len(self._buf)), socket.MSG_DONTWAIT if polling else 0)
            except BlockingIOError:  # polling, nothing yet
                continue
            except TimeoutError:
                raise  # the caller's deadline: what was read stays buffered
            except OSError as exc:
                raise ConnectionClosed(str(exc)) from exc
            if not chunk:
                raise ConnectionClosed("the peer closed the connection")
            self._buf += chunk

    def _time_left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the read deadline passed")
        return left

    def read(self):
        """The next frame: a deferred one first, else one off the socket."""
        if self._deferred:
            return self._deferred.popleft()
        return self.read_new()

    def read_new(self):
        """The next frame off the socket, past any deferred ones."""
        self._fill(9)
        b = self._buf
        length = (b[0] << 16) | (b[1] << 8) | b[2]
        ftype, flags = b[3], b[4]
        stream = ((b[5] << 24) | (b[6] << 16) | (b[7] << 8) | b[8]) & 0x7FFFFFFF
        if length > self._max:
            raise ProtocolError(f"a {length}-byte frame exceeds the {self._max}-byte maximum", FRAME_SIZE_ERROR)
        self._fill(9 + length)
        payload = bytes(b[9:9 + length])
        del b[:9 + length]
        if ftype in (DATA, HEADERS) and flags & PADDED:
            if not payload or payload[0] >= len(payload):
                raise ProtocolError("padding longer than the frame")
            payload = payload[1:len(payload) - payload[0]]
        if ftype == HEADERS and flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise ProtocolError("HEADERS too short for its priority fields", FRAME_SIZE_ERROR)
            payload = payload[5:]
        return ftype, flags, stream, payload, length


def grpc_message(payload: bytes) -> bytes:
    """A gRPC length-prefixed message (uncompressed)."""
    return b"\x00" + struct.pack(">I", len(payload)) + payload


class MessageTooLarge(Exception):
    pass


class MessageBuffer:
    """gRPC messages reassembled from a stream's DATA payloads."""

    def __init__(self, max_bytes: int):
        self._buf = bytearray()
        self._max = max_bytes

    def feed(self, data: bytes) -> list[bytes]:
        """The messages completed by `data`. Raises MessageTooLarge past the limit, ValueError
        for a compressed message (none was negotiated)."""
        self._buf += data
        out = []
        while len(self._buf) >= 5:
            if self._buf[0] not in (0, 1):
                raise ValueError(f"bad message flag {self._buf[0]}")
            if self._buf[0] == 1:
                raise ValueError("a compressed message, though no compression was negotiated")
            size = int.from_bytes(self._buf[1:5], "big")
            if size > self._max:
                raise MessageTooLarge(f"a {size}-byte message exceeds the {self._max}-byte limit")
            if len(self._buf) < 5 + size:
                break
            out.append(bytes(self._buf[5:5 + size]))
            del self._buf[:5 + size]
        return out

    @property
    def empty(self) -> bool:
        return not self._buf


_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def timeout_seconds(value: str) -> float:
    """A `grpc-timeout` header value (1-8 digits and a unit) in seconds."""
    digits, unit = value[:-1], value[-1:]
    if not 1 <= len(digits) <= 8 or not digits.isdigit() or unit not in _TIMEOUT_UNITS:
        raise ValueError(f"bad grpc-timeout {value!r}")
    return int(digits) * _TIMEOUT_UNITS[unit]


def timeout_header(seconds: float) -> str:
    """`seconds` as a `grpc-timeout` value, in the finest unit that fits 8 digits."""
    for unit, scale in (("n", 1e-9), ("u", 1e-6), ("m", 1e-3), ("S", 1.0), ("M", 60.0), ("H", 3600.0)):
        n = int(max(seconds, 0.0) / scale)
        if n < 10**8:
            return f"{max(n, 1)}{unit}"
    return "99999999H"


def encode_status_message(message: str) -> str:
    """`grpc-message`: percent-encoded UTF-8 (the spec's unreserved set kept)."""
    return urllib.parse.quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")


def decode_status_message(value: str) -> str:
    return urllib.parse.unquote(value)
