"""One end of an HTTP/2 connection, shared by `server` and `client`: the settings exchange, PING and
WINDOW_UPDATE handling, header blocks (HPACK through the `hpack` package), and DATA within the
peer's flow-control windows. It is driven by one thread at a time: whoever reads also writes."""
from __future__ import annotations

import socket
import struct

import hpack

from treeserve.h2grpc import frames as f

# What this end lets its peer send before a WINDOW_UPDATE: large, so that a peer never stalls on
# a stream whose messages this end reads only between calls. What it has received is handed back
# with its next write, and at once past half a window.
RECEIVE_WINDOW = 1 << 24
CONNECTION_RECEIVE_WINDOW = 1 << 30
MAX_HEADER_LIST_BYTES = 16384
# Frames a write waiting for the peer's window may set aside for later (the peer's requests, new
# calls): past this the peer is flooding a connection it does not let answer (ENHANCE_YOUR_CALM)
MAX_DEFERRED_FRAMES = 4096


class Peer:
    # Whether the peer's END_STREAM on a stream ends the call there. For a client it does (the
    # server's trailers carry the status, and no more window will come for the stream); for a
    # server it is the client's half-close, after which the client still reads the answer.
    end_stream_ends_call = False

    def __init__(self, sock: socket.socket, max_header_list: int = MAX_HEADER_LIST_BYTES, poll_s: float = 0.0):
        """poll_s: see `frames.FrameReader`."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.reader = f.FrameReader(sock, poll_s=poll_s)
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder(max_header_list_size=max_header_list)
        self.max_header_list = max_header_list
        self.peer_max_frame = f.DEFAULT_MAX_FRAME
        self.peer_initial_window = f.DEFAULT_WINDOW
        self.send_window = f.DEFAULT_WINDOW  # connection-level, towards the peer
        self.stream_send: dict[int, int] = {}  # stream -> its window towards the peer
        self._out = bytearray()
        self._owed_conn = 0  # bytes received and not yet handed back
        self._owed: dict[int, int] = {}
        self.goaway_from_peer: int | None = None  # the error code of the peer's GOAWAY

    # ---- connection setup --------------------------------------------------------------------
    def local_settings(self, max_concurrent_streams: int | None = None) -> bytes:
        """This end's SETTINGS (with the most calls it serves at once, for a server) and its
        connection window."""
        settings = {f.ENABLE_PUSH: 0, f.INITIAL_WINDOW_SIZE: RECEIVE_WINDOW, f.MAX_HEADER_LIST_SIZE: self.max_header_list}
        if max_concurrent_streams is not None:
            settings[f.MAX_CONCURRENT_STREAMS] = max_concurrent_streams
        return f.settings_frame(settings) + f.window_update(0, CONNECTION_RECEIVE_WINDOW - f.DEFAULT_WINDOW)

    # ---- writing -----------------------------------------------------------------------------
    def queue(self, data: bytes) -> None:
        self._out += data

    def flush(self, only_with_output: bool = False) -> None:
        """Send what is queued, with the windows owed to the peer; `only_with_output`: nothing at
        all when nothing else is queued (the owed windows then wait for the next write)."""
        if only_with_output and not self._out:
            return
        if self._owed_conn:
            self._out += f.window_update(0, self._owed_conn)
            self._owed_conn = 0
        for sid, n in self._owed.items():
            self._out += f.window_update(sid, n)
        self._owed.clear()
        if self._out:
            data, self._out = bytes(self._out), bytearray()
            try:
                self.sock.sendall(data)
            except TimeoutError:
                raise  # the caller's deadline (part of `data` may have gone: the connection is unusable)
            except OSError as exc:
                raise f.ConnectionClosed(str(exc)) from exc

    def queue_headers(self, sid: int, headers: list[tuple[str, str]], end_stream: bool) -> None:
        block = self.encoder.encode(headers, huffman=False)
        step = self.peer_max_frame
        first, rest = block[:step], block[step:]
        flags = (f.END_STREAM if end_stream else 0) | (0 if rest else f.END_HEADERS)
        self._out += f.frame(f.HEADERS, flags, sid, first)
        while rest:
            chunk, rest = rest[:step], rest[step:]
            self._out += f.frame(f.CONTINUATION, 0 if rest else f.END_HEADERS, sid, chunk)

    def queue_data(self, sid: int, data: bytes, end_stream: bool = False) -> None:
        """DATA frames carrying `data`, within the peer's windows: when they are spent, what is
        queued goes out and frames are read (control frames handled, the rest deferred) until the
        peer opens them again."""
        view = memoryview(data)
        while True:
            room = min(self.send_window, self.stream_send[sid], self.peer_max_frame)
            if room <= 0 and len(view):
                self.flush()
                self._await_window(sid)
                continue
            chunk = view[:room]
            view = view[len(chunk):]
            last = not len(view)
            self._out += f.frame(f.DATA, f.END_STREAM if (end_stream and last) else 0, sid, bytes(chunk))
            self.send_window -= len(chunk)
            self.stream_send[sid] -= len(chunk)
            if last:
                return

    def _await_window(self, sid: int) -> None:
        """Read until both windows of stream `sid` are open (a WINDOW_UPDATE, or SETTINGS raising the
        initial window). Frames for the caller are deferred, in order; raises StreamReset when the
        peer resets `sid` meanwhile."""
        while self.send_window <= 0 or self.stream_send.get(sid, 0) <= 0:
            item = self.reader.read_new()  # not the deferred frames: they stay deferred, in order
            ftype, flags, stream, payload, _ = item
            if not self.control(ftype, flags, stream, payload):
                if self.reader.deferred_count >= MAX_DEFERRED_FRAMES:
                    raise f.ProtocolError(f"more than {MAX_DEFERRED_FRAMES} frames while this end waits for a window",
                                          f.ENHANCE_YOUR_CALM)
                self.reader.defer(item)
                if stream == sid and (ftype == f.RST_STREAM or (
                        self.end_stream_ends_call and ftype == f.HEADERS and flags & f.END_STREAM)):
                    raise StreamReset(sid)  # the call is over: no window will come for it

    # ---- reading -----------------------------------------------------------------------------
    def control(self, ftype: int, flags: int, sid: int, payload: bytes) -> bool:
        """Handle a connection-level frame (or a stream's WINDOW_UPDATE, or PRIORITY); False for
        the frames the caller handles (DATA, HEADERS, CONTINUATION, RST_STREAM)."""
        if ftype == f.SETTINGS:
            if sid:
                raise f.ProtocolError("SETTINGS on a stream")
            if flags & f.ACK:
                return True
            for key, value in f.parse_settings(payload).items():
                if key == f.INITIAL_WINDOW_SIZE:
                    if value > f.MAX_WINDOW:
                        raise f.ProtocolError("initial window too large", f.FLOW_CONTROL_ERROR)
                    delta = value - self.peer_initial_window
                    self.peer_initial_window = value
                    for s in self.stream_send:
                        self.stream_send[s] += delta
                elif key == f.MAX_FRAME_SIZE:
                    if not f.DEFAULT_MAX_FRAME <= value <= 2**24 - 1:
                        raise f.ProtocolError(f"MAX_FRAME_SIZE {value} out of range")
                    self.peer_max_frame = value
                elif key == f.HEADER_TABLE_SIZE:
                    self.encoder.header_table_size = min(value, 4096)
            self.queue(f.frame(f.SETTINGS, f.ACK, 0))
            self.flush()
            return True
        if ftype == f.PING:
            if len(payload) != 8:
                raise f.ProtocolError("PING payload is not 8 bytes", f.FRAME_SIZE_ERROR)
            if not flags & f.ACK:
                self.queue(f.frame(f.PING, f.ACK, 0, payload))
                self.flush()
            return True
        if ftype == f.WINDOW_UPDATE:
            if len(payload) != 4:
                raise f.ProtocolError("WINDOW_UPDATE payload is not 4 bytes", f.FRAME_SIZE_ERROR)
            inc = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if sid == 0:
                self.send_window += inc
                if self.send_window > f.MAX_WINDOW:
                    raise f.ProtocolError("connection window overflow", f.FLOW_CONTROL_ERROR)
            elif sid in self.stream_send:  # a stream already over may still get one: ignored
                self.stream_send[sid] += inc
            return True
        if ftype == f.GOAWAY:
            self.goaway_from_peer = struct.unpack(">I", payload[4:8])[0] if len(payload) >= 8 else f.PROTOCOL_ERROR
            raise f.ConnectionClosed(f"the peer sent GOAWAY (error code {self.goaway_from_peer})")
        if ftype == f.PRIORITY:
            return True
        if ftype == f.PUSH_PROMISE:
            raise f.ProtocolError("PUSH_PROMISE, though push is disabled")
        if ftype > f.CONTINUATION:
            return True  # unknown frame types are ignored (RFC 9113 §4.1)
        return False

    def header_block(self, sid: int, flags: int, payload: bytes) -> list[tuple[str, str]]:
        """The headers of a HEADERS frame and its CONTINUATION frames, decoded."""
        block = bytearray(payload)
        while not flags & f.END_HEADERS:
            ftype, flags, stream, more, _ = self.reader.read()
            if ftype != f.CONTINUATION or stream != sid:
                raise f.ProtocolError("a header block interrupted by another frame")
            block += more
            if len(block) > 4 * self.max_header_list:
                raise f.ProtocolError("header block too large", f.COMPRESSION_ERROR)
        try:
            return self.decoder.decode(bytes(block))
        except hpack.OversizedHeaderListError:
            raise
        except hpack.HPACKError as exc:
            raise f.ProtocolError(f"header block: {exc}", f.COMPRESSION_ERROR) from exc

    def received(self, sid: int, flow_length: int, stream_open: bool) -> None:
        """Account for a DATA frame's flow-controlled length: handed back with the next write."""
        if not flow_length:
            return
        self._owed_conn += flow_length
        if stream_open:
            self._owed[sid] = self._owed.get(sid, 0) + flow_length
        if self._owed_conn > CONNECTION_RECEIVE_WINDOW // 2 or (stream_open and self._owed[sid] > RECEIVE_WINDOW // 2):
            self.flush()

    def open_stream(self, sid: int) -> None:
        self.stream_send[sid] = self.peer_initial_window

    def forget(self, sid: int) -> None:
        """A stream is over: no window is owed to it or kept for it."""
        self._owed.pop(sid, None)
        self.stream_send.pop(sid, None)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class StreamReset(Exception):
    """The peer reset the stream this end was sending on."""

    def __init__(self, sid: int):
        super().__init__(f"stream {sid} was reset by the peer")
        self.sid = sid
