"""treeserve.h2grpc: gRPC over cleartext HTTP/2 written on sockets.

The server (`DirectServer`) is checked against grpcio's client, and the clients
(`DirectStreamSession`, `DirectStream`) against both `DirectServer` and grpcio's server, so each side is tested
against an independent peer: round trips, streams, messages larger than the default flow-control
window and frame size, status codes and their percent-encoded messages, auth, message limits,
deadlines, concurrent streams, malformed connections, the `grpc-timeout` encoding, and shutdown.
Everything is bytes in, bytes out (no serializers)."""
from __future__ import annotations

import contextlib
import errno
import math
import queue
import random
import socket
import struct
import threading
import time
from concurrent import futures

import grpc
import hpack
import pytest

from treeserve.errors import InvalidArgument
from treeserve.h2grpc import frames
from treeserve.h2grpc.client import DirectStream, DirectStreamSession
from treeserve.h2grpc.peer import RECEIVE_WINDOW
from treeserve.h2grpc.server import DirectServer, Method

UNARY = "/test.Echo/Unary"
STREAM = "/test.Echo/Stream"
FAIL = "/test.Echo/Fail"
SLOW = "/test.Echo/Slow"
REMAINING = "/test.Echo/Remaining"

# non-ASCII and '%' (also a literal "%25", which must not be decoded twice)
ERROR_MESSAGE = "bad request: 100% wrong, über ☃ — not %25 nor %zz"
TOKEN = "s3cret-token"
LARGE = 300_000  # > the 64 KiB default window and the 16 KiB default frame size
WAIT_S = 10.0  # an upper bound for waits that should end at once
# grpcio announces a 4 MiB window and 4 MiB frames, and grows its windows as it measures the
# link (BDP probing); without probing it keeps HTTP/2's defaults (64 KiB window, 16 KiB frames),
# so a 300 KB message really has to wait for WINDOW_UPDATEs and be split into frames
GRPC_DEFAULTS = ()
RFC_DEFAULTS = (("grpc.http2.bdp_probe", 0),)
PEER_SETTINGS = [pytest.param(GRPC_DEFAULTS, id="grpc-defaults"), pytest.param(RFC_DEFAULTS, id="rfc-defaults")]


def identity(b: bytes) -> bytes:
    return b


def payload(n: int, seed: int) -> bytes:
    """n reproducible pseudo-random bytes (no repeating pattern that could hide a misplaced chunk)."""
    return random.Random(seed).randbytes(n)


# ---- fixtures ------------------------------------------------------------------------------------

@pytest.fixture
def release():
    """Lets the slow handlers return; set at teardown so no handler thread is left waiting."""
    event = threading.Event()
    try:
        yield event
    finally:
        event.set()


@pytest.fixture
def started():
    """Set by the slow handlers when they begin."""
    return threading.Event()


@pytest.fixture
def remaining():
    """What `call.time_remaining()` said in the REMAINING handler, one entry per call."""
    return []


@pytest.fixture
def start_direct(release, started, remaining):
    """start_direct(**kwargs) -> a started DirectServer serving the test methods; all stopped at teardown."""

    def echo(request: bytes, call) -> bytes:
        if request.startswith(b"fail"):
            raise InvalidArgument(ERROR_MESSAGE)
        if request.startswith(b"slow"):
            started.set()
            release.wait(WAIT_S)
        return b"echo:" + request

    def fail(request: bytes, call) -> bytes:
        raise InvalidArgument(ERROR_MESSAGE)

    def slow(request: bytes, call) -> bytes:
        started.set()
        release.wait(WAIT_S)
        return b"slow:" + request

    def time_left(request: bytes, call) -> bytes:
        remaining.append(call.time_remaining())
        return b"ok"

    methods = {
        UNARY: Method(lambda request, call: b"unary:" + request),
        STREAM: Method(echo, streaming=True),
        FAIL: Method(fail),
        SLOW: Method(slow),
        REMAINING: Method(time_left),
    }
    servers = []

    def start(**kwargs) -> DirectServer:
        server = DirectServer("127.0.0.1:0", methods, **kwargs).start()
        servers.append(server)
        return server

    try:
        yield start
    finally:
        release.set()
        for server in servers:
            server.stop(0)


@pytest.fixture
def direct(start_direct):
    return start_direct()


@pytest.fixture
def open_channel():
    """open_channel(port, options) -> a grpcio insecure channel to 127.0.0.1:port; all closed at teardown."""
    channels = []

    def open_(port: int, options=GRPC_DEFAULTS) -> grpc.Channel:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=list(options))
        channels.append(channel)
        return channel

    try:
        yield open_
    finally:
        for channel in channels:
            channel.close()


@pytest.fixture
def open_session():
    """open_session(port, path, **kwargs) -> a bytes DirectStreamSession; all closed at teardown."""
    sessions = []

    def open_(port: int, path: str = STREAM, **kwargs) -> DirectStreamSession:
        session = DirectStreamSession(f"127.0.0.1:{port}", path, identity, identity, **kwargs)
        sessions.append(session)
        return session

    try:
        yield open_
    finally:
        for session in sessions:
            session.close()


@pytest.fixture
def start_grpc_echo():
    """start_grpc_echo(options) -> the port of a grpcio server with a bidirectional echo method at
    STREAM; all stopped at teardown."""

    def echo(request_iterator, context):
        for request in request_iterator:
            if request.startswith(b"fail"):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, ERROR_MESSAGE)
            yield b"echo:" + request

    handler = grpc.method_handlers_generic_handler("test.Echo", {
        "Stream": grpc.stream_stream_rpc_method_handler(echo),
    })
    servers = []

    def start(options=GRPC_DEFAULTS) -> int:
        server = grpc.server(futures.ThreadPoolExecutor(4), options=list(options))
        servers.append(server)
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        return port

    try:
        yield start
    finally:
        for server in servers:
            server.stop(0).wait(WAIT_S)


@pytest.fixture
def grpc_echo(start_grpc_echo):
    return start_grpc_echo()


def unary(channel: grpc.Channel, path: str = UNARY):
    return channel.unary_unary(path, request_serializer=identity, response_deserializer=identity)


def stream(channel: grpc.Channel, path: str = STREAM):
    return channel.stream_stream(path, request_serializer=identity, response_deserializer=identity)


class Requests:
    """A request iterator for a grpcio stream that the test feeds one message at a time."""

    _END = object()

    def __init__(self):
        self._queue = queue.SimpleQueue()

    def put(self, request: bytes) -> None:
        self._queue.put(request)

    def end(self) -> None:
        self._queue.put(self._END)

    def __iter__(self):
        while (request := self._queue.get()) is not self._END:
            yield request


@contextlib.contextmanager
def echo_stream(channel: grpc.Channel):
    """A grpcio stream of the echo method that has answered its first request ("a"): yields
    (requests, responses); the requests end on the way out."""
    requests = Requests()
    responses = stream(channel)(iter(requests), timeout=WAIT_S)
    try:
        requests.put(b"a")
        assert next(responses) == b"echo:a"
        yield requests, responses
    finally:
        requests.end()


# ---- 1. grpcio client -> DirectServer: round trips -----------------------------------------------

def test_unary_round_trip(direct, open_channel):
    channel = open_channel(direct.port)
    assert unary(channel)(b"hello", timeout=WAIT_S) == b"unary:hello"
    assert unary(channel)(b"", timeout=WAIT_S) == b"unary:"  # an empty message is still a message


def test_bidi_stream_answers_in_order(direct, open_channel):
    channel = open_channel(direct.port)
    requests = [f"m{i}".encode() for i in range(20)]
    responses = list(stream(channel)(iter(requests), timeout=WAIT_S))
    assert responses == [b"echo:" + r for r in requests]


def test_bidi_stream_lockstep(direct, open_channel):
    """Each answer comes before the next request is sent (the way a client session uses a stream)."""
    channel = open_channel(direct.port)
    requests = Requests()
    responses = stream(channel)(iter(requests), timeout=WAIT_S)
    try:
        for i in range(10):
            requests.put(f"step{i}".encode())
            assert next(responses) == f"echo:step{i}".encode()
    finally:
        requests.end()
    assert list(responses) == []


@pytest.mark.parametrize("options", PEER_SETTINGS)
def test_large_messages_both_ways(direct, open_channel, options):
    """Requests are pipelined (grpcio sends the next while the server still answers the first),
    so the server also reads frames while it waits for a window to send in."""
    channel = open_channel(direct.port, options)
    big = [payload(LARGE, seed) for seed in range(3)]
    assert unary(channel)(big[0], timeout=WAIT_S) == b"unary:" + big[0]
    responses = list(stream(channel)(iter(big), timeout=WAIT_S))
    assert len(responses) == len(big)
    for request, response in zip(big, responses):
        assert response == b"echo:" + request


def test_more_than_a_window_on_one_grpcio_stream(direct, open_channel):
    """More bytes through one stream than the receive windows either end announces (16 MiB here,
    4 MiB grpcio's): each end must keep handing windows back."""
    channel = open_channel(direct.port)
    big = payload(LARGE, 11)
    n = RECEIVE_WINDOW // LARGE + 4
    responses = list(stream(channel)(iter([big] * n), timeout=WAIT_S))
    assert len(responses) == n
    assert all(response == b"echo:" + big for response in responses)


# ---- 2. statuses, auth and limits ----------------------------------------------------------------

def test_handler_error_status_and_message(direct, open_channel):
    channel = open_channel(direct.port)
    with pytest.raises(grpc.RpcError) as info:
        unary(channel, FAIL)(b"x", timeout=WAIT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == ERROR_MESSAGE
    # on a stream, after answers were sent (trailers after headers, not trailers-only)
    responses = stream(channel)(iter([b"a", b"fail", b"never"]), timeout=WAIT_S)
    assert next(responses) == b"echo:a"
    with pytest.raises(grpc.RpcError) as info:
        next(responses)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == ERROR_MESSAGE


def test_unknown_method_is_unimplemented(direct, open_channel):
    channel = open_channel(direct.port)
    with pytest.raises(grpc.RpcError) as info:
        unary(channel, "/test.Echo/Nope")(b"x", timeout=WAIT_S)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert unary(channel)(b"still", timeout=WAIT_S) == b"unary:still"  # the connection is fine


def test_auth_token(start_direct, open_channel):
    server = start_direct(auth_token=TOKEN)
    channel = open_channel(server.port)
    with pytest.raises(grpc.RpcError) as info:
        unary(channel)(b"x", timeout=WAIT_S)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        unary(channel)(b"x", timeout=WAIT_S, metadata=(("authorization", "Bearer wrong"),))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    good = (("authorization", f"Bearer {TOKEN}"),)
    assert unary(channel)(b"x", timeout=WAIT_S, metadata=good) == b"unary:x"
    assert list(stream(channel)(iter([b"1", b"2"]), timeout=WAIT_S, metadata=good)) == [b"echo:1", b"echo:2"]


def test_message_over_limit_is_resource_exhausted(start_direct, open_channel):
    server = start_direct(max_message_bytes=1000)
    channel = open_channel(server.port)
    # over the limit by much (many DATA frames follow the refusal) and by one byte
    for size in (LARGE, 1001):
        with pytest.raises(grpc.RpcError) as info:
            unary(channel)(b"x" * size, timeout=WAIT_S)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as info:
        list(stream(channel)(iter([b"ok", b"y" * 5000]), timeout=WAIT_S))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # at the limit is fine, and the server still serves, on this channel and on a new one
    assert unary(channel)(b"z" * 1000, timeout=WAIT_S) == b"unary:" + b"z" * 1000
    assert unary(open_channel(server.port))(b"next", timeout=WAIT_S) == b"unary:next"


# ---- 3. deadlines --------------------------------------------------------------------------------

def test_client_deadline_then_server_still_serves(direct, open_channel, release):
    channel = open_channel(direct.port)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        unary(channel, SLOW)(b"late", timeout=0.2)
    elapsed = time.monotonic() - start
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed < WAIT_S / 2  # the client did not wait for the handler (it waits up to WAIT_S)
    release.set()  # the handler ends now; its late answer goes to a cancelled stream
    assert unary(channel)(b"after", timeout=WAIT_S) == b"unary:after"
    assert unary(open_channel(direct.port))(b"new", timeout=WAIT_S) == b"unary:new"


def test_time_remaining_follows_the_client_deadline(direct, open_channel, remaining):
    channel = open_channel(direct.port)
    unary(channel)(b"warm", timeout=WAIT_S)  # connected: the deadline below covers the call alone
    timeout = 5.0
    assert unary(channel, REMAINING)(b"", timeout=timeout) == b"ok"
    assert unary(channel, REMAINING)(b"") == b"ok"  # no deadline: grpcio sends no grpc-timeout
    with_deadline, without = remaining
    # grpcio rounds the grpc-timeout it sends up to a coarse value, from a clock it caches: for a
    # 5 s timeout it sends "5S" or, often enough, "5010m"; the server can only go by what it gets
    assert timeout - 2.5 < with_deadline <= timeout + 0.05
    assert without == math.inf


# ---- 4. concurrent streams on one connection -----------------------------------------------------

def test_concurrent_streams_on_one_channel(direct, open_channel):
    channel = open_channel(direct.port)
    method = stream(channel)
    n_streams, n_messages = 6, 15
    start = threading.Barrier(n_streams)
    results: dict[int, list[bytes]] = {}
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            start.wait(WAIT_S)
            requests = [f"s{k}-m{i}".encode() for i in range(n_messages)]
            results[k] = list(method(iter(requests), timeout=WAIT_S))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n_streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S + 5)
    assert not errors
    assert all(not t.is_alive() for t in threads)
    for k in range(n_streams):
        assert results[k] == [f"echo:s{k}-m{i}".encode() for i in range(n_messages)]
    assert direct.connections == 1  # they really shared one connection


# ---- 5. DirectStreamSession -> DirectServer ------------------------------------------------------

def test_session_many_sends_on_one_stream(direct, open_session):
    session = open_session(direct.port)
    assert not session.open
    for i in range(50):
        assert session.send(f"n{i}".encode()) == f"echo:n{i}".encode()
        assert session.open
    big = payload(LARGE, 7)
    assert session.send(big) == b"echo:" + big
    assert session.send(b"small") == b"echo:small"
    assert direct.connections == 1


def test_session_more_than_a_window_on_one_stream(direct, open_session):
    """More than a whole receive window (16 MiB) each way: both ends hand windows back."""
    session = open_session(direct.port, timeout=WAIT_S)
    big = payload(LARGE, 12)
    for _ in range(RECEIVE_WINDOW // LARGE + 4):
        assert session.send(big) == b"echo:" + big
    assert direct.connections == 1


def test_session_handler_error_ends_the_stream(direct, open_session):
    session = open_session(direct.port)
    assert session.send(b"a") == b"echo:a"
    with pytest.raises(grpc.RpcError) as info:
        session.send(b"fail")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == ERROR_MESSAGE
    assert session.error is info.value
    assert not session.open
    assert session.send(b"b") == b"echo:b"  # a new stream
    assert session.open
    # an error as the first message of a stream (a trailers-only response)
    session.close()
    session = open_session(direct.port)
    with pytest.raises(grpc.RpcError) as info:
        session.send(b"fail first")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert session.send(b"c") == b"echo:c"


def test_session_message_over_limit(start_direct, open_session):
    server = start_direct(max_message_bytes=1000)
    session = open_session(server.port, timeout=WAIT_S)
    assert session.send(b"a") == b"echo:a"
    with pytest.raises(grpc.RpcError) as info:
        session.send(b"x" * LARGE)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert session.send(b"b") == b"echo:b"


def test_session_unimplemented_and_auth(start_direct, open_session):
    server = start_direct(auth_token=TOKEN)
    with pytest.raises(grpc.RpcError) as info:
        open_session(server.port).send(b"x")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        open_session(server.port, "/test.Echo/Nope", auth_token=TOKEN).send(b"x")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert open_session(server.port, auth_token=TOKEN).send(b"x") == b"echo:x"


def test_session_timeout_then_own_answer(direct, open_session, release):
    session = open_session(direct.port, timeout=0.2)
    assert session.send(b"first", timeout=WAIT_S) == b"echo:first"  # the connection is made meanwhile
    with pytest.raises(grpc.RpcError) as info:
        session.send(b"slow one")
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not session.open
    # the late answer ("echo:slow one") is written before the next request is read: the session
    # must skip it (it belongs to the stream it reset) and return its own
    release.set()
    assert session.send(b"second", timeout=WAIT_S) == b"echo:second"
    assert session.send(b"third", timeout=WAIT_S) == b"echo:third"
    assert direct.connections == 1  # the connection survived the timeout


def test_session_after_server_stop_is_unavailable(direct, open_session):
    session = open_session(direct.port)
    assert session.send(b"a") == b"echo:a"
    direct.stop(1.0)
    with pytest.raises(grpc.RpcError) as info:
        session.send(b"b")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as info:  # nothing listens now: the new connection fails too
        session.send(b"c")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_session_context_manager_closes(direct):
    with DirectStreamSession(f"127.0.0.1:{direct.port}", STREAM, identity, identity) as session:
        assert session.send(b"x") == b"echo:x"
    assert not session.open
    with pytest.raises(ValueError):
        session.send(b"y")


# ---- 5b. DirectStream: several requests in flight on one stream --------------------------------------

def open_stream(port: int, **kwargs) -> DirectStream:
    return DirectStream(f"127.0.0.1:{port}", STREAM, identity, identity, **kwargs)


def test_stream_answers_every_request_in_order(direct):
    s = open_stream(direct.port)
    try:
        assert s.read(0) is None  # nothing asked, nothing there
        for i in range(5):
            s.write(f"r{i}".encode())
        assert [s.read(WAIT_S) for _ in range(5)] == [f"echo:r{i}".encode() for i in range(5)]
        assert s.read(0.05) is None and s.open
        big = payload(LARGE, 3)
        s.write(big)
        assert s.read(WAIT_S) == b"echo:" + big
    finally:
        s.close()
    assert not s.open


def test_stream_read_without_waiting_takes_only_what_has_come(direct, release, started):
    s = open_stream(direct.port)
    try:
        s.write(b"a")
        deadline = time.monotonic() + WAIT_S
        got = None
        while got is None and time.monotonic() < deadline:  # read(0) never waits for the answer
            t0 = time.monotonic()
            got = s.read(0)
            assert time.monotonic() - t0 < 2.0
        assert got == b"echo:a"
        s.write(b"slow b")
        assert started.wait(WAIT_S)
        assert s.read(0) is None and s.read(0.1) is None  # late: the stream stays open for it
        release.set()
        assert s.read(WAIT_S) == b"echo:slow b"
        s.write(b"c")
        assert s.read(WAIT_S) == b"echo:c"
    finally:
        s.close()


def test_stream_read_without_a_limit_waits_after_a_timed_read(direct, release, started):
    """read(None) waits as long as it takes, whatever timeout an earlier read left on the socket."""
    s = open_stream(direct.port)
    try:
        s.write(b"slow x")
        assert started.wait(WAIT_S)
        assert s.read(0.01) is None
        timer = threading.Timer(0.5, release.set)
        timer.start()
        t0 = time.monotonic()
        assert s.read(None) == b"echo:slow x"
        assert time.monotonic() - t0 >= 0.4
    finally:
        s.close()


def test_stream_response_that_does_not_parse_ends_it(direct):
    def strict(b: bytes) -> bytes:
        if not b.startswith(b"echo:ok"):
            raise ValueError("not a response")
        return b

    s = DirectStream(f"127.0.0.1:{direct.port}", STREAM, identity, strict)
    s.write(b"ok")
    s.write(b"bad")
    assert s.read(WAIT_S) == b"echo:ok"
    with pytest.raises(grpc.RpcError) as info:
        s.read(WAIT_S)
    assert info.value.code() == grpc.StatusCode.INTERNAL and not s.open


def test_stream_abort_from_another_thread_wakes_a_read(direct, started):
    s = open_stream(direct.port)
    s.write(b"slow y")
    assert started.wait(WAIT_S)
    threading.Timer(0.2, s.abort).start()
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        s.read(WAIT_S)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < WAIT_S / 2
    assert not s.open


def test_stream_error_status_ends_it(direct):
    s = open_stream(direct.port)
    s.write(b"a")
    s.write(b"fail now")
    assert s.read(WAIT_S) == b"echo:a"
    with pytest.raises(grpc.RpcError) as info:
        s.read(WAIT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details() == ERROR_MESSAGE
    assert not s.open
    with pytest.raises(grpc.RpcError) as info:
        s.write(b"b")
    assert info.value.code() == grpc.StatusCode.CANCELLED


def test_stream_auth_and_a_stopped_server(start_direct):
    server = start_direct(auth_token=TOKEN)
    s = open_stream(server.port)
    s.write(b"x")
    with pytest.raises(grpc.RpcError) as info:
        s.read(WAIT_S)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    s = open_stream(server.port, auth_token=TOKEN)
    s.write(b"x")
    assert s.read(WAIT_S) == b"echo:x"
    server.stop(1.0)
    with pytest.raises(grpc.RpcError) as info:
        s.write(b"y")
        s.read(WAIT_S)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and not s.open
    with pytest.raises(grpc.RpcError) as info:  # nothing listens now
        open_stream(server.port)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_stream_against_grpcio_server(grpc_echo):
    s = open_stream(grpc_echo)
    try:
        for i in range(10):
            s.write(f"g{i}".encode())
        assert [s.read(WAIT_S) for _ in range(10)] == [f"echo:g{i}".encode() for i in range(10)]
    finally:
        s.close()


# ---- 6. DirectStreamSession -> grpcio server -----------------------------------------------------

def test_session_against_grpcio_server(grpc_echo, open_session):
    session = open_session(grpc_echo, timeout=WAIT_S)
    for i in range(20):
        assert session.send(f"g{i}".encode()) == f"echo:g{i}".encode()
    with pytest.raises(grpc.RpcError) as info:
        session.send(b"fail")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == ERROR_MESSAGE
    assert not session.open
    assert session.send(b"again") == b"echo:again"
    assert session.open


@pytest.mark.parametrize("options", PEER_SETTINGS)
def test_session_large_messages_against_grpcio_server(start_grpc_echo, open_session, options):
    session = open_session(start_grpc_echo(options), timeout=WAIT_S)
    for seed in range(3):
        big = payload(LARGE, seed)
        assert session.send(big) == b"echo:" + big
    assert session.send(b"small") == b"echo:small"


def test_session_request_refused_mid_upload(start_grpc_echo, open_session):
    """A grpcio server with 64 KiB windows refuses a request over its message limit as soon as it
    reads the length, while the session still waits for window to send the rest: the session must
    report the server's status, not wait for a window that never opens. (Run on a thread, so that
    a hang fails the test instead of stalling the run.)"""
    port = start_grpc_echo(RFC_DEFAULTS + (("grpc.max_receive_message_length", 1000),))
    session = open_session(port, timeout=WAIT_S)
    outcome = []

    def send() -> None:
        try:
            outcome.append(session.send(payload(LARGE, 13)))
        except BaseException as exc:  # noqa: BLE001 - judged by the test's thread
            outcome.append(exc)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(WAIT_S)
    assert not sender.is_alive(), "send() never returned"
    [error] = outcome
    assert isinstance(error, grpc.RpcError), f"send() gave {error!r}"
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert session.send(b"small") == b"echo:small"


# ---- 7. malformed connections, and a raw HTTP/2 client ------------------------------------------

# RFC 9113 numbers, written out here rather than taken from the module under test
GOAWAY_TYPE, PROTOCOL_ERROR_CODE, FRAME_SIZE_ERROR_CODE, ENHANCE_YOUR_CALM_CODE = 7, 1, 6, 11
CLIENT_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def raw_frame(ftype: int, flags: int, stream_id: int, body: bytes, length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return struct.pack(">I", n)[1:] + bytes((ftype, flags)) + struct.pack(">I", stream_id) + body


def read_to_eof(sock: socket.socket, limit: float = WAIT_S) -> bytes:
    """All the server sends until it closes the connection; fails if it does not within `limit`."""
    end = time.monotonic() + limit
    data = bytearray()
    while True:
        left = end - time.monotonic()
        if left <= 0:
            pytest.fail(f"the server kept the connection open (got {len(data)} bytes)")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return bytes(data)
        except TimeoutError:
            pytest.fail(f"the server kept the connection open (got {len(data)} bytes)")
        if not chunk:
            return bytes(data)
        data += chunk


def goaway_codes(data: bytes) -> list[int]:
    """The error codes of the GOAWAY frames in `data` (whole frames only)."""
    codes, at = [], 0
    while at + 9 <= len(data):
        length = int.from_bytes(data[at:at + 3], "big")
        if data[at + 3] == GOAWAY_TYPE:
            codes.append(int.from_bytes(data[at + 13:at + 17], "big"))
        at += 9 + length
    return codes


@pytest.mark.parametrize("sent, goaway", [
    pytest.param(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n", None, id="http1-not-a-preface"),
    pytest.param(b"\xff" * 64, None, id="garbage"),
    pytest.param(CLIENT_PREFACE + raw_frame(0, 0, 1, b"", length=20000), FRAME_SIZE_ERROR_CODE,
                 id="frame-over-max-size"),
    pytest.param(CLIENT_PREFACE + raw_frame(4, 0, 0, b"") + raw_frame(6, 0, 0, b"abc"), FRAME_SIZE_ERROR_CODE,
                 id="ping-3-bytes"),
    pytest.param(CLIENT_PREFACE + raw_frame(4, 0, 0, b"") + raw_frame(0, 0, 5, b"\x00" * 10), PROTOCOL_ERROR_CODE,
                 id="data-on-idle-stream"),
    pytest.param(CLIENT_PREFACE + raw_frame(6, 0, 0, b"\x00" * 8), PROTOCOL_ERROR_CODE,
                 id="preface-not-followed-by-settings"),
])
def test_malformed_connection_is_closed(direct, open_channel, sent, goaway):
    with socket.create_connection(("127.0.0.1", direct.port), timeout=WAIT_S) as sock:
        sock.sendall(sent)
        data = read_to_eof(sock)
    if goaway is not None:
        assert goaway_codes(data) == [goaway]
    else:
        assert data == b""  # not HTTP/2 at all: closed without a word
    # the server is still up and serving
    assert unary(open_channel(direct.port))(b"fine", timeout=WAIT_S) == b"unary:fine"


HANDSHAKE_S = 0.3  # a short handshake bound, for the tests that wait it out


@pytest.mark.parametrize("sent", [
    pytest.param(b"", id="nothing"),
    pytest.param(CLIENT_PREFACE[:10], id="part-of-the-preface"),
    pytest.param(CLIENT_PREFACE, id="preface-without-settings"),
])
def test_a_connection_that_does_not_complete_its_handshake_is_closed(start_direct, open_channel, sent):
    """Sockets that never finish the HTTP/2 handshake (preface, then SETTINGS) within handshake_s
    are closed, so idle sockets cannot hold every connection slot. A client that did its
    handshake is not bound by it: its connection, older than handshake_s by then, still serves,
    and new clients connect as ever."""
    direct = start_direct(handshake_s=HANDSHAKE_S)
    channel = open_channel(direct.port)
    assert unary(channel)(b"before", timeout=WAIT_S) == b"unary:before"
    t0 = time.monotonic()  # before the connect: the server's deadline runs from its accept
    with socket.create_connection(("127.0.0.1", direct.port), timeout=WAIT_S) as sock:
        sock.sendall(sent)
        data = read_to_eof(sock, limit=WAIT_S)
        assert time.monotonic() - t0 >= HANDSHAKE_S  # closed for the deadline, not at once
    if sent == CLIENT_PREFACE:  # the preface came: the server's own SETTINGS went out
        assert data[3] == 4
    else:
        assert data == b""
    assert unary(channel)(b"after", timeout=WAIT_S) == b"unary:after"
    assert unary(open_channel(direct.port))(b"new", timeout=WAIT_S) == b"unary:new"


def test_a_trickled_preface_is_closed_at_the_handshake_deadline(start_direct):
    """The bound is on the whole handshake, not on each read: a client that sends its preface a
    byte at a time, each within the bound, is closed before the preface is complete."""
    direct = start_direct(handshake_s=HANDSHAKE_S)
    pause = HANDSHAKE_S / 3  # the preface would take 24 of these
    with socket.create_connection(("127.0.0.1", direct.port), timeout=WAIT_S) as sock:
        sock.settimeout(pause)
        for sent, byte in enumerate(CLIENT_PREFACE):
            try:
                sock.sendall(bytes([byte]))
                closed = sock.recv(1) == b""
            except TimeoutError:
                continue  # still open: the next byte
            except OSError:  # reset by the server
                closed = True
            if closed:
                break
        else:
            pytest.fail("the server took a preface trickled over several handshake periods")
    assert sent < len(CLIENT_PREFACE) - 1


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_the_handshake_bound_must_be_a_positive_time(bad):
    with pytest.raises(ValueError, match="handshake_s"):
        DirectServer("127.0.0.1:0", {}, handshake_s=bad)


def test_window_opened_by_settings(direct):
    """RFC 9113 §6.9.2: a SETTINGS_INITIAL_WINDOW_SIZE change adjusts every open stream's window,
    so a peer may open a stream's window with SETTINGS alone. A raw client announces a 0-byte
    window, sends a unary request, then raises the window by SETTINGS: the answer must follow."""
    encoder = hpack.Encoder()
    headers = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", UNARY),
                              (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")])
    initial_window_size = 0x4  # the SETTINGS parameter's identifier
    with socket.create_connection(("127.0.0.1", direct.port), timeout=WAIT_S) as sock:
        sock.sendall(CLIENT_PREFACE + raw_frame(4, 0, 0, struct.pack(">HI", initial_window_size, 0))
                     + raw_frame(1, 0x4, 1, headers)  # HEADERS, END_HEADERS
                     + raw_frame(0, 0x1, 1, b"\x00" + struct.pack(">I", 2) + b"hi"))  # DATA, END_STREAM
        # the response's HEADERS come (they are not flow-controlled), its DATA cannot yet
        received = read_frames(sock, until=lambda ftype, flags, sid: ftype == 1 and sid == 1)
        assert not [fr for fr in received if fr[0] == 0]
        sock.sendall(raw_frame(4, 0, 0, struct.pack(">HI", initial_window_size, 65535)))
        received = read_frames(sock, until=lambda ftype, flags, sid: ftype == 1 and sid == 1 and flags & 0x1)
    body = b"".join(fr[3] for fr in received if fr[0] == 0 and fr[2] == 1)
    assert body == b"\x00" + struct.pack(">I", len(b"unary:hi")) + b"unary:hi"


def read_frames(sock: socket.socket, until, limit: float = WAIT_S) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream, payload) of the frames the server sends, up to the first for which
    until(type, flags, stream) holds; fails if it does not come within `limit` seconds."""
    end = time.monotonic() + limit
    out = []
    while True:
        header = _recv_exact(sock, 9, end)
        length = int.from_bytes(header[:3], "big")
        item = (header[3], header[4], int.from_bytes(header[5:9], "big") & 0x7FFFFFFF, _recv_exact(sock, length, end))
        out.append(item)
        if until(*item[:3]):
            return out


def _recv_exact(sock: socket.socket, n: int, end: float) -> bytes:
    data = bytearray()
    while len(data) < n:
        left = end - time.monotonic()
        if left <= 0:
            pytest.fail("the server did not send the expected frame in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            pytest.fail("the server did not send the expected frame in time")
        if not chunk:
            pytest.fail("the server closed the connection")
        data += chunk
    return bytes(data)


# ---- 8. grpc-timeout encoding --------------------------------------------------------------------

@pytest.mark.parametrize("seconds", [1e-9, 5e-6, 0.2, 0.3, 1.0, 1.5, 59.0, 3600.0, 86400.0 * 30])
def test_timeout_header_round_trip(seconds):
    value = frames.timeout_header(seconds)
    digits, unit = value[:-1], value[-1]
    assert digits.isdigit() and 1 <= len(digits) <= 8 and unit in "HMSmun"
    back = frames.timeout_seconds(value)
    assert back <= seconds * (1 + 1e-12)  # never later than asked
    assert back == pytest.approx(seconds, rel=1e-6)


@pytest.mark.parametrize("value, seconds", [
    ("1H", 3600.0), ("2M", 120.0), ("3S", 3.0), ("250m", 0.25), ("7u", 7e-6), ("99999999n", 0.099999999),
])
def test_timeout_seconds_units(value, seconds):
    assert frames.timeout_seconds(value) == pytest.approx(seconds)


def test_timeout_header_extremes():
    assert frames.timeout_seconds(frames.timeout_header(0.0)) > 0  # never "0": that is no time at all
    assert frames.timeout_seconds(frames.timeout_header(-1.0)) > 0
    assert frames.timeout_header(1e15) == "99999999H"


@pytest.mark.parametrize("value", ["", "S", "10", "10x", "123456789S", "-1S", "1.5S", " 1S", "1s", "1 S"])
def test_bad_timeout_values(value):
    with pytest.raises(ValueError):
        frames.timeout_seconds(value)


# ---- 9. shutdown ---------------------------------------------------------------------------------

def test_stop_with_idle_grpcio_stream(direct, open_channel):
    with echo_stream(open_channel(direct.port)) as (_, responses):
        grace = 6.0
        start = time.monotonic()
        direct.stop(grace)
        # well within grace, and in fact at once: no call is running, so there is nothing to wait for
        assert time.monotonic() - start < grace / 2
        with pytest.raises(grpc.RpcError) as info:
            next(responses)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_stop_with_idle_session(direct, open_session):
    session = open_session(direct.port, timeout=WAIT_S)
    assert session.send(b"a") == b"echo:a"
    grace = 6.0
    start = time.monotonic()
    direct.stop(grace)
    assert time.monotonic() - start < grace / 2  # idle: nothing to wait for
    with pytest.raises(grpc.RpcError) as info:
        session.send(b"b")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_stop_lets_the_running_call_finish(direct, open_channel, started, release):
    channel = open_channel(direct.port)
    call = unary(channel, SLOW).future(b"x", timeout=WAIT_S)
    assert started.wait(WAIT_S)
    stopper = threading.Thread(target=direct.stop, args=(WAIT_S,))
    start = time.monotonic()
    stopper.start()
    assert direct.stopping.wait(WAIT_S)
    release.set()  # the call ends within grace: its answer still goes out
    assert call.result(timeout=WAIT_S) == b"slow:x"
    stopper.join(WAIT_S)
    assert not stopper.is_alive()
    assert time.monotonic() - start < WAIT_S / 2  # stop returned when the call was done, not after grace
    with pytest.raises(grpc.RpcError) as info:  # and nothing is accepted any more
        unary(open_channel(direct.port))(b"y", timeout=WAIT_S)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_stop_gives_up_after_grace(direct, open_channel, started):
    channel = open_channel(direct.port)
    call = unary(channel, SLOW).future(b"x", timeout=WAIT_S)
    assert started.wait(WAIT_S)
    grace = 1.0
    start = time.monotonic()
    direct.stop(grace)  # the handler never returns (until teardown)
    elapsed = time.monotonic() - start
    assert grace * 0.9 <= elapsed < grace + 3.0
    with pytest.raises(grpc.RpcError) as info:
        call.result(timeout=WAIT_S)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# ---- 10. the session against a server that holds back --------------------------------------------

def raw_server(behave) -> tuple[int, threading.Event]:
    """A one-connection server on a thread: reads the client's preface, then runs behave(sock).
    Returns (port, done: set when behave returned and the socket closed)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    done = threading.Event()

    def serve() -> None:
        try:
            conn, _ = listener.accept()
            with conn:
                _recv_exact(conn, len(CLIENT_PREFACE), time.monotonic() + WAIT_S)
                behave(conn)
        finally:
            listener.close()
            done.set()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1], done


def test_session_send_times_out_when_the_window_stays_shut():
    """A server that announces a 0-byte stream window and never opens it: the request cannot be
    sent, and `send` reports DEADLINE_EXCEEDED within its timeout instead of waiting for ever."""
    initial_window_size = 0x4
    hold = threading.Event()

    def behave(sock):
        sock.sendall(raw_frame(4, 0, 0, struct.pack(">HI", initial_window_size, 0)))
        hold.wait(WAIT_S)

    port, done = raw_server(behave)
    session = DirectStreamSession(f"127.0.0.1:{port}", STREAM, identity, identity, timeout=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            session.send(b"x" * 100)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 0.5 + 3.0
        assert not session.open
    finally:
        hold.set()
        session.close()
        done.wait(WAIT_S)


def test_session_upload_ended_by_trailers_alone():
    """A server that answers a request it has not fully read with trailers and no RST_STREAM (grpcio
    always adds the RST; the protocol does not require it): the session reports the trailers'
    status instead of waiting for a window that will not come."""
    hold = threading.Event()

    def behave(sock):
        sock.sendall(raw_frame(4, 0, 0, struct.pack(">HI", 0x4, 1024)))  # a 1 KiB stream window
        read_frames(sock, until=lambda ftype, flags, sid: ftype == 0 and sid == 1)  # the first DATA
        trailers = hpack.Encoder().encode([(":status", "200"), ("content-type", "application/grpc"),
                                           ("grpc-status", "8"), ("grpc-message", "too big")])
        sock.sendall(raw_frame(1, 0x1 | 0x4, 1, trailers))  # HEADERS, END_STREAM | END_HEADERS
        hold.wait(WAIT_S)

    port, done = raw_server(behave)
    session = DirectStreamSession(f"127.0.0.1:{port}", STREAM, identity, identity, timeout=WAIT_S)
    try:
        with pytest.raises(grpc.RpcError) as info:
            session.send(payload(LARGE, 21))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details() == "too big"
    finally:
        hold.set()
        session.close()
        done.wait(WAIT_S)


class _AcceptFails:
    """A listening socket whose next `times` accepts fail as one does when the process has no file
    descriptor left (EMFILE); every other call goes to the real socket."""

    def __init__(self, sock: socket.socket, times: int = 1):
        self._sock = sock
        self.times = times
        self.failed = 0

    def accept(self):
        if self.failed < self.times:
            self.failed += 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self._sock.accept()

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_a_failed_accept_does_not_stop_the_port(direct, open_channel):
    """A port whose accept failed once (no descriptor left for a moment) goes on serving new
    connections; before, its acceptor thread ended and later clients hung."""
    failing = direct._listener = _AcceptFails(direct._listener)
    for i in range(2):  # each on a new connection
        channel = open_channel(direct.port, (("grpc.use_local_subchannel_pool", 1),))
        assert unary(channel)(b"x%d" % i, timeout=WAIT_S) == b"unary:x%d" % i
    assert failing.failed == 1


def test_accepts_that_keep_failing_are_told_once_in_a_while(direct, open_channel, caplog):
    """Ten failed accepts in a row (half a second at ACCEPT_RETRY_S) make one warning, not ten;
    the port serves once they pass."""
    failing = direct._listener = _AcceptFails(direct._listener, times=10)
    for i in range(2):  # the first may be taken by the accept already waiting on the real socket
        channel = open_channel(direct.port, (("grpc.use_local_subchannel_pool", 1),))
        assert unary(channel)(b"x%d" % i, timeout=WAIT_S) == b"unary:x%d" % i
    assert failing.failed == 10
    assert caplog.text.count("accept failed") == 1


def test_a_peer_that_takes_none_of_its_answers_is_closed(start_direct):
    """A client that opens every window, asks and asks on a stream and reads nothing: the
    server's write makes no progress for send_timeout_s and the connection is closed (before,
    its thread waited in the write for ever, holding a connection slot)."""
    direct = start_direct(send_timeout_s=0.5)
    encoder = hpack.Encoder()
    headers = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", STREAM),
                              (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")])
    body = b"m" * 16000
    message = raw_frame(0, 0, 1, b"\x00" + struct.pack(">I", len(body)) + body)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.settimeout(WAIT_S)
        sock.connect(("127.0.0.1", direct.port))
        window = frames.MAX_WINDOW
        sock.sendall(CLIENT_PREFACE + raw_frame(4, 0, 0, struct.pack(">HI", 0x4, window))
                     + raw_frame(8, 0, 0, struct.pack(">I", window - frames.DEFAULT_WINDOW))
                     + raw_frame(1, 0x4, 1, headers))
        sock.settimeout(1.0)
        try:
            for _ in range(2000):  # 32 MB of answers: more than the kernel's buffers hold
                sock.sendall(message)
        except OSError:
            pass  # the server stopped reading (its write is stuck) or closed: either way, enough
        deadline = time.monotonic() + WAIT_S
        while direct.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert direct.connections == 0


def test_a_connection_with_no_call_that_stays_silent_is_closed(start_direct, open_channel):
    """After its handshake, a connection with no call open that sends nothing for idle_s gets
    GOAWAY NO_ERROR and is closed (silent peers cannot hold every slot); one with a call open is
    not, however long the call waits between messages."""
    idle_s = 0.5
    direct = start_direct(idle_s=idle_s)
    with echo_stream(open_channel(direct.port)) as (requests, responses):
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", direct.port), timeout=WAIT_S) as sock:
            sock.sendall(CLIENT_PREFACE + raw_frame(4, 0, 0, b""))
            data = read_to_eof(sock, limit=WAIT_S)
        assert time.monotonic() - t0 >= idle_s
        assert goaway_codes(data) == [0]
        time.sleep(idle_s)  # the open stream's connection is older than idle_s now, and silent
        requests.put(b"b")
        assert next(responses) == b"echo:b"


def test_connections_probe_a_quiet_peer_with_tcp_keepalive(direct):
    """A peer whose host vanished sends no FIN; keepalive probes are what find it (2 min)."""
    from treeserve.h2grpc.server import KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES

    with socket.create_connection(("127.0.0.1", direct.port), timeout=WAIT_S) as sock:
        sock.sendall(CLIENT_PREFACE + raw_frame(4, 0, 0, b""))
        read_frames(sock, until=lambda ftype, flags, sid: ftype == 4 and not flags & 1)
        [conn] = direct._connections
        theirs = conn.peer.sock
        assert theirs.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        assert (theirs.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                theirs.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                theirs.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)) == \
            (KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES)


def test_the_server_says_how_many_calls_it_serves_at_once():
    """SETTINGS_MAX_CONCURRENT_STREAMS is announced, so a grpcio channel queues its calls past it
    instead of having them refused."""
    from treeserve.h2grpc.server import MAX_CONCURRENT_STREAMS

    server = DirectServer("127.0.0.1:0", {UNARY: Method(identity)}).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
            sock.sendall(CLIENT_PREFACE + raw_frame(4, 0, 0, b""))
            [(_, flags, _, body)] = read_frames(sock, until=lambda ftype, flags, sid: ftype == 4 and not flags & 1)
        settings = dict(struct.unpack(">HI", body[i:i + 6]) for i in range(0, len(body), 6))
        assert settings[0x3] == MAX_CONCURRENT_STREAMS
    finally:
        server.stop(0)


def test_a_peer_that_floods_a_connection_it_does_not_let_answer_is_closed(direct):
    """The client shuts every stream's window (SETTINGS_INITIAL_WINDOW_SIZE 0), asks on a stream,
    then sends frames without end while the answer waits for a window: what the server sets aside
    meanwhile is bounded, then GOAWAY ENHANCE_YOUR_CALM."""
    from treeserve.h2grpc.peer import MAX_DEFERRED_FRAMES

    encoder = hpack.Encoder()
    headers = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", STREAM),
                              (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")])
    message = b"\x00" + struct.pack(">I", 2) + b"hi"
    flood = raw_frame(0, 0, 1, message) * (MAX_DEFERRED_FRAMES + 10)  # more requests on the stream
    with socket.create_connection(("127.0.0.1", direct.port), timeout=WAIT_S) as sock:
        sock.sendall(CLIENT_PREFACE + raw_frame(4, 0, 0, struct.pack(">HI", 0x4, 0))
                     + raw_frame(1, 0x4, 1, headers) + raw_frame(0, 0, 1, message))
        try:
            sock.sendall(flood)
        except OSError:
            pass  # closed while we were still sending: what the test wants
        data = read_to_eof(sock, limit=WAIT_S)
    assert ENHANCE_YOUR_CALM_CODE in goaway_codes(data)


def test_a_session_whose_idle_connection_the_server_closed_connects_again(start_direct, open_session):
    """A session connected (or whose stream ended) and then unused for longer than the server's
    idle_s: the server has closed that connection, and the next send opens a new one instead of
    failing UNAVAILABLE (an engine would have taken its verifier for down)."""
    direct = start_direct(idle_s=0.3)

    def closed_for_idleness():
        deadline = time.monotonic() + WAIT_S
        while direct.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert direct.connections == 0

    session = open_session(direct.port).connect()
    closed_for_idleness()
    assert session.send(b"a", timeout=WAIT_S) == b"echo:a"
    session.close()
    closed_for_idleness()
    session = open_session(direct.port)
    assert session.send(b"b", timeout=WAIT_S) == b"echo:b"
    session._end(reset=True)  # the stream ends; the connection stays, with no call open
    closed_for_idleness()
    assert session.send(b"c", timeout=WAIT_S) == b"echo:c"
