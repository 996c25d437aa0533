"""Conventions every treeserve gRPC server follows: health checking, reflection, status codes from
exceptions, optional bearer-token auth, deadlines, Prometheus metrics, graceful shutdown."""
from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import logging
import math
import signal
import threading
from concurrent import futures
from typing import Callable, Iterable, Iterator

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from treeserve.errors import InvalidArgument, ResourceExhausted, Unavailable, status_of
from treeserve.v1 import treeserve_pb2 as pb

log = logging.getLogger("treeserve.server")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRACE_SECONDS = 5.0  # how long a stopping server lets calls in flight finish (`--shutdown-grace-s`)


def on_error(method: Callable, handle: Callable) -> Callable:
    """Wrap a servicer method so that an exception it raises goes to `handle(context, exc)`, for
    unary methods and for streaming (generator) ones alike, whose exceptions surface while gRPC
    iterates their responses. The one place that knows the two shapes of a handler."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self, request, context):
            try:
                yield from method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - handed on
                handle(context, exc)

        return stream

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - handed on
            return handle(context, exc)

    return unary


def grpc_errors(method: Callable) -> Callable:
    """Servicer-method decorator: exceptions become gRPC statuses (ServeError -> its code,
    TreeError -> INVALID_ARGUMENT, anything else -> INTERNAL, logged). Works for unary and
    streaming (generator) methods; a stream's status ends the stream."""

    def abort(context, exc):
        code, message = status_of(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", method.__qualname__)
        context.abort(code, message)

    return on_error(method, abort)


def client_requests(request_iterator: Iterable, stopping: threading.Event | None = None) -> Iterator:
    """A streaming handler's requests until the client half-closes or cancels the stream. A
    cancel is how a client ends a long-lived stream (shutdown, reconnect, its own timeout), not a
    failure of the service, so it ends the handler quietly instead of reaching `grpc_errors`.

    `stopping` (the server's `Server.stopping`): once the server shuts down, the next request ends
    the stream with UNAVAILABLE instead of being served. New calls are refused from that moment
    anyway; without this a long-lived stream would keep a stopping server busy for its whole grace
    period, and its client would learn of the shutdown only when the stream was cut."""
    try:
        for request in request_iterator:
            if stopping is not None and stopping.is_set():
                raise Unavailable("the server is shutting down: open a new stream to another replica")
            yield request
    except grpc.RpcError:
        return


def with_raw_requests(register: Callable, methods: Iterable[str]) -> Callable:
    """A generated `add_XServicer_to_server` that hands the named methods' requests to the
    servicer as bytes, unparsed (no request deserializer), for the servicer to parse itself:
    grpcio answers a request its deserializer rejects with INTERNAL ("Exception deserializing
    request!"), where a request that does not parse is the client's error, which the servicer
    can report as such (INVALID_ARGUMENT). The other methods have their requests parsed in the call
    instead (`_parsed_in_call`), so that one that does not parse is INVALID_ARGUMENT there too."""
    raw = frozenset(methods)

    def add(servicer, server) -> None:
        stand_in = _RawRequestRegistration(server, raw)
        register(servicer, stand_in)
        if not stand_in.registered:  # generated code of another shape: say so, rather than serve nothing
            raise RuntimeError(f"{getattr(register, '__name__', register)} did not register its methods by name")

    return add


class _RawRequestRegistration:
    """The server as a generated registration sees it: what it registers goes on to the real
    server, with the request deserializers of the `raw` methods taken off."""

    def __init__(self, server: grpc.Server, raw: frozenset[str]):
        self._server = server
        self._raw = raw
        self.registered = False

    def add_generic_rpc_handlers(self, handlers) -> None:
        """Dropped: generated code registers the same handlers by name as well, as a dict of them
        (`add_registered_method_handlers`), the form in which they can be changed; both forms are
        registered from there."""

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        missing = self._raw - handlers.keys()
        if missing:
            raise ValueError(f"{service} has no method {sorted(missing)}")
        handlers = {name: _unparsed(handler) if name in self._raw else _parsed_in_call(handler)
                    for name, handler in handlers.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        self._server.add_registered_method_handlers(service, handlers)
        self.registered = True


# a method handler's kind (request_streaming, response_streaming) -> its factory and behaviour's name
_HANDLER_KINDS = {
    (False, False): (grpc.unary_unary_rpc_method_handler, "unary_unary"),
    (False, True): (grpc.unary_stream_rpc_method_handler, "unary_stream"),
    (True, False): (grpc.stream_unary_rpc_method_handler, "stream_unary"),
    (True, True): (grpc.stream_stream_rpc_method_handler, "stream_stream"),
}


def _unparsed(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with its requests handed over as bytes (no request deserializer)."""
    factory, behaviour = _HANDLER_KINDS[handler.request_streaming, handler.response_streaming]
    return factory(getattr(handler, behaviour), request_deserializer=None,
                   response_serializer=handler.response_serializer)


def _parsed_in_call(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with its requests parsed by its own deserializer inside the call, so that bytes
    that do not parse (a truncated message, a string field that is not UTF-8) are answered
    INVALID_ARGUMENT, not grpcio's INTERNAL: a lone request before the servicer runs, each of a
    stream's as the servicer reads it (an InvalidArgument that its `grpc_errors` reports)."""
    parse = handler.request_deserializer
    if parse is None:
        return handler
    factory, behaviour = _HANDLER_KINDS[handler.request_streaming, handler.response_streaming]
    serve = getattr(handler, behaviour)

    def parsed(data: bytes):
        try:
            return parse(data)
        except DecodeError as exc:
            raise InvalidArgument(f"the request does not parse: {exc}") from None

    if handler.request_streaming:
        def call(requests, context):
            return serve((parsed(data) for data in requests), context)
    else:
        def call(data: bytes, context):
            try:
                request = parsed(data)
            except InvalidArgument as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return serve(request, context)

    return factory(call, request_deserializer=None, response_serializer=handler.response_serializer)


class BearerTokenAuth(grpc.ServerInterceptor):
    """Refuse calls without `authorization: Bearer <token>` (UNAUTHENTICATED). Health checks pass.

    The refusal has the kind of the method it stands in for: gRPC drives a handler by its kind, and
    a unary refusal of a streaming method first waits for a request message, which a client that
    reads before it writes never sends (its call would hang until its deadline)."""

    def __init__(self, token: str):
        self._token = token

        def deny(request_or_iterator, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = {  # (request_streaming, response_streaming) -> refusal
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(deny),
        }

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler_call_details.method.startswith("/grpc.health."):
            return handler
        meta = dict(handler_call_details.invocation_metadata or ())
        if meta.get("authorization") == f"Bearer {self._token}":
            return handler
        if handler is None:  # an unknown method: refused like any other, its absence not revealed
            return self._deny[False, False]
        return self._deny[handler.request_streaming, handler.response_streaming]


class Server:
    """A gRPC server with health and reflection. Register servicers, then `start()`;
    `wait()` blocks until SIGTERM/SIGINT (or `stop()`), then lets the calls in flight finish for up
    to `grace_s` seconds."""

    def __init__(self, address: str, max_workers: int = 32, auth_token: str | None = None,
                 executor: futures.Executor | None = None, grace_s: float = GRACE_SECONDS):
        """executor: the pool that runs the calls (default: a ThreadPoolExecutor of max_workers)."""
        if not grace_s >= 0:
            raise ValueError(f"the shutdown grace period must be >= 0 seconds, got {grace_s}")
        self.grace_s = grace_s
        interceptors = [BearerTokenAuth(auth_token)] if auth_token else []
        self._server = grpc.server(
            executor or futures.ThreadPoolExecutor(max_workers=max_workers),
            interceptors=interceptors,
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._names: list[str] = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        self._stopped = threading.Event()
        self.stopping = threading.Event()  # set when a shutdown begins (see `client_requests`)
        self._on_stopping: list[Callable[[], None]] = []

    def add(self, register: Callable, servicer, service_name: str, raw_methods: Iterable[str] = ()) -> "Server":
        """register: the generated add_XServicer_to_server; service_name: e.g. 'Verifier';
        raw_methods: those whose requests the servicer takes as bytes (`with_raw_requests`)."""
        with_raw_requests(register, raw_methods)(servicer, self._server)
        full = pb.DESCRIPTOR.services_by_name[service_name].full_name
        self._names.append(full)
        self._health.set(full, health_pb2.HealthCheckResponse.SERVING)
        return self

    def start(self) -> "Server":
        reflection.enable_server_reflection(self._names, self._server)
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._server.start()
        return self

    def stop(self, grace: float | None = None) -> None:
        """Refuse new calls and end open streams at their next message (`client_requests`); calls
        in flight get `grace` seconds (None: this server's `grace_s`) before they are cancelled."""
        self.stopping.set()
        for callback in self._on_stopping:
            try:
                callback()
            except Exception:  # noqa: BLE001 - the shutdown goes on
                log.exception("a shutdown callback failed")
        self._health.enter_graceful_shutdown()
        self._server.stop(self.grace_s if grace is None else grace).wait()
        self._stopped.set()

    def on_stopping(self, callback: Callable[[], None]) -> None:
        """Call `callback` as a shutdown begins, before the calls in flight get their grace."""
        self._on_stopping.append(callback)

    def wait(self) -> None:
        """Serve until SIGTERM/SIGINT, then shut down gracefully."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: threading.Thread(target=self.stop, daemon=True).start())
        self._stopped.wait()


def rpc_threads(max_sequences: int) -> int:
    """Worker threads of a server that holds up to `max_sequences` sequences: grpcio's sync server
    runs each call on one and holds it for the call's whole life (a stream's too). Enough for a
    stream and one more call per live sequence, and a few to spare."""
    return max(32, 2 * max_sequences + 8)


def stream_cap(threads: int) -> int:
    """Open streams a server of `threads` workers takes (`StreamCap`): half of them, so the other
    half (at least max_sequences + 4 of `rpc_threads`) always serves unary calls and health checks.
    One stream carries every sequence of a client, so even a client per sequence fits."""
    return threads // 2


class StreamCap:
    """At most `limit` open streams of one method. grpcio's sync server holds a worker thread for
    each open stream, idle or not; with no cap, streams could take every thread, and unary calls and
    health checks would wait behind them until their deadlines. A stream past the cap is refused
    with RESOURCE_EXHAUSTED before it reads anything.

        with cap.held():  # in the stream's handler; the slot is free again when the stream ends
            ...
    """

    def __init__(self, limit: int, what: str, advice: str):
        """what: the streams, as the refusal names them ("VerifyStreams"); advice: what the client
        can do instead."""
        if limit < 1:
            raise ValueError(f"a stream cap must be at least 1, got {limit}")
        self.limit = limit
        self._what = what
        self._advice = advice
        self._slots = threading.BoundedSemaphore(limit)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        if not self._slots.acquire(blocking=False):
            raise ResourceExhausted(f"{self.limit} {self._what} are open, the most this server takes (each holds "
                                    f"one of its threads): {self._advice}")
        try:
            yield
        finally:
            self._slots.release()


def count_argument(low: int, high: float = math.inf) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high] (`number_argument` is its twin for real numbers).
    A value a server could only fail on later (a negative slot count, an empty tree) is refused
    when the command line is read, with the option's name."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {value}")
        return value

    return parse


def token_argument(text: str) -> str:
    """An argparse type: a bearer token. An empty one would turn authentication off without a word
    (an unset variable in `--auth-token "$TOKEN"`), and one outside visible ASCII cannot travel in
    a header: both are refused when the command line is read."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (leave the option out to serve without a token)")
    if not all("!" <= c <= "~" for c in text):
        raise argparse.ArgumentTypeError("must be visible ASCII characters, without spaces")
    return text


def number_argument(unit: str, high: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a number of `unit` in [0, high]; text, NaN and values outside are refused
    with a message naming the unit."""
    bounds = ">= 0" if high == math.inf else f"in [0, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not 0 <= value <= high:  # refuses nan too
            raise argparse.ArgumentTypeError(f"must be a number of {unit} {bounds}, got {text!r}")
        return value

    return parse


def add_grace_argument(p: argparse.ArgumentParser) -> None:
    """The `--shutdown-grace-s` option every treeserve server takes."""
    p.add_argument("--shutdown-grace-s", type=number_argument("seconds"), default=GRACE_SECONDS, metavar="S",
                   help="on SIGTERM/SIGINT, let calls in flight finish for up to S seconds (open streams end at "
                        f"their next message; default {GRACE_SECONDS:g})")


def start_metrics(port: int | None) -> None:
    """Expose Prometheus metrics on http://0.0.0.0:port/metrics (port None or 0: off)."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port)


def channel(address: str, auth_token: str | None = None) -> grpc.Channel:
    """A client channel with treeserve's message limits (and bearer token, when given)."""
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
    ch = grpc.insecure_channel(address, options=options)
    if auth_token:
        ch = grpc.intercept_channel(ch, _BearerClient(auth_token))
    return ch


class _BearerClient(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self._meta = ("authorization", f"Bearer {token}")

    def _details(self, d):
        meta = list(d.metadata or ()) + [self._meta]
        return d._replace(metadata=meta) if hasattr(d, "_replace") else _Details(d, meta)

    def intercept_unary_unary(self, cont, d, req):
        return cont(self._details(d), req)

    def intercept_unary_stream(self, cont, d, req):
        return cont(self._details(d), req)

    def intercept_stream_stream(self, cont, d, reqs):
        return cont(self._details(d), reqs)


class _Details(grpc.ClientCallDetails):
    def __init__(self, d, metadata: Iterable):
        self.method = d.method
        self.timeout = d.timeout
        self.metadata = metadata
        self.credentials = d.credentials
        self.wait_for_ready = getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)
