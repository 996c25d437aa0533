"""treeserve.server: Server's shutdown (calls in flight get the grace period, and no more), and
`with_raw_requests` (methods registered to take their requests as bytes)."""
from __future__ import annotations

import argparse
import contextlib
import threading
import time
from concurrent import futures

import grpc
import pytest

from treeserve.server import GRACE_SECONDS, Server, add_grace_argument, with_raw_requests
from treeserve.v1 import treeserve_pb2 as pb
from treeserve.v1 import treeserve_pb2_grpc as pbg

# a method of our own under a real service name (health checking registers the service by name)
SERVICE = "treeserve.v1.Verifier"
METHOD = f"/{SERVICE}/Slow"


@contextlib.contextmanager
def slow_server(grace_s: float, handler_s: float):
    """A started server with one unary method (bytes in, bytes out) that takes `handler_s` seconds.
    Yields (server, entered: set once a call is in the handler); afterwards the handler is let go
    at once and the server stopped, whatever the test did."""
    entered, release = threading.Event(), threading.Event()

    def slow(request: bytes, context) -> bytes:
        entered.set()
        release.wait(handler_s)
        return request

    def register(_servicer, server):
        handlers = {"Slow": grpc.unary_unary_rpc_method_handler(slow)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)  # as generated code does

    server = Server("127.0.0.1:0", grace_s=grace_s).add(register, None, "Verifier").start()
    try:
        yield server, entered
    finally:
        release.set()
        server.stop(grace=0)


def call_in_background(port: int) -> tuple[threading.Thread, dict]:
    """One call of the slow method on its own thread -> (thread, {'reply': bytes} or {'code': status})."""
    out: dict = {}

    def run():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            try:
                out["reply"] = ch.unary_unary(METHOD)(b"ping", timeout=60)
            except grpc.RpcError as exc:
                out["code"] = exc.code()

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_a_call_in_flight_finishes_within_the_grace_period():
    with slow_server(grace_s=30.0, handler_s=0.5) as (server, entered):
        caller, out = call_in_background(server.port)
        assert entered.wait(30)
        t0 = time.monotonic()
        server.stop()  # the server's own grace period
        caller.join(30)
        assert out == {"reply": b"ping"}
        assert time.monotonic() - t0 < 15.0  # it waited for the call, not for the whole 30 s


def test_a_call_that_outlasts_the_grace_period_is_cut_off():
    with slow_server(grace_s=0.2, handler_s=30.0) as (server, entered):
        caller, out = call_in_background(server.port)
        assert entered.wait(30)
        t0 = time.monotonic()
        server.stop()
        stopped_after = time.monotonic() - t0
        caller.join(30)
        # the server cancels the call and closes the connection; which the client sees first varies
        assert out.get("code") in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), out
        assert stopped_after < 4.5  # the 0.2 s asked for, not the default 5 s (nor the handler's 30)


def test_a_negative_grace_period_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        Server("127.0.0.1:0", grace_s=-1.0)


def test_the_option_defaults_to_the_servers_grace_period():
    p = argparse.ArgumentParser()
    add_grace_argument(p)
    assert p.parse_args([]).shutdown_grace_s == GRACE_SECONDS
    assert p.parse_args(["--shutdown-grace-s", "0"]).shutdown_grace_s == 0.0
    assert p.parse_args(["--shutdown-grace-s", "2.5"]).shutdown_grace_s == 2.5


@pytest.mark.parametrize("text", ["-1", "nan", "soon"])
def test_the_option_refuses_what_is_not_a_number_of_seconds(text, capsys):
    p = argparse.ArgumentParser()
    add_grace_argument(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--shutdown-grace-s", text])
    assert "must be a number of seconds >= 0" in capsys.readouterr().err


class _RecordingVerifier(pbg.VerifierServicer):
    """Records the request each method was handed."""

    def __init__(self):
        self.seen: dict = {}

    def Verify(self, request, context):
        self.seen["Verify"] = request
        return pb.VerifyResponse()

    def VerifyStream(self, request_iterator, context):
        for request in request_iterator:
            self.seen["VerifyStream"] = request
            yield pb.VerifyResponse()

    def Stats(self, request, context):
        self.seen["Stats"] = request
        return pb.VerifierStats()


def test_raw_request_methods_are_handed_bytes_and_the_rest_messages():
    servicer = _RecordingVerifier()
    register = with_raw_requests(pbg.add_VerifierServicer_to_server, ["Verify", "VerifyStream"])
    server = Server("127.0.0.1:0").add(register, servicer, "Verifier").start()
    request = pb.VerifyRequest(items=[pb.VerifyItem(sequence_id="a", committed_length=3)])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pbg.VerifierStub(ch)
            assert stub.Verify(request, timeout=10) == pb.VerifyResponse()  # responses serialized as generated
            assert list(stub.VerifyStream(iter([request]), timeout=10)) == [pb.VerifyResponse()]
            stub.Stats(pb.StatsRequest(), timeout=10)
    finally:
        server.stop(grace=0)
    assert servicer.seen["Verify"] == servicer.seen["VerifyStream"] == request.SerializeToString()
    assert isinstance(servicer.seen["Stats"], pb.StatsRequest)


def test_raw_requests_for_a_method_the_service_lacks_are_refused():
    register = with_raw_requests(pbg.add_VerifierServicer_to_server, ["Verify", "Verfiy"])
    with pytest.raises(ValueError, match="Verfiy"):
        register(_RecordingVerifier(), grpc.server(futures.ThreadPoolExecutor(1)))


def test_a_stream_cap_refuses_past_its_limit_and_frees_a_slot_when_a_stream_ends():
    from treeserve.errors import ResourceExhausted
    from treeserve.server import StreamCap, rpc_threads, stream_cap

    cap = StreamCap(2, "test streams", "close one")
    with cap.held(), cap.held():
        with pytest.raises(ResourceExhausted, match="2 test streams are open.*close one"):
            with cap.held():
                pass
    with cap.held(), cap.held():  # both slots free again
        pass
    with pytest.raises(ValueError):
        StreamCap(0, "test streams", "")
    for sequences in (1, 64, 512):
        threads = rpc_threads(sequences)
        assert stream_cap(threads) >= 16 and threads - stream_cap(threads) >= sequences + 4


def test_count_argument_takes_whole_numbers_from_its_bound():
    from treeserve.server import count_argument

    parse = count_argument(1)
    assert parse("3") == 3
    for bad in ("0", "-2", "1.5", "many"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


@pytest.mark.parametrize("module, options", [
    ("verifier_service.cli", ["--model", "m", "--auth-token"]),
    ("drafter_service.cli", ["--ngram", "--auth-token"]),
    ("orchestrator.cli_orchestrator", ["--verifier", "v:1", "--auth-token"]),
    ("orchestrator.cli_orchestrator", ["--verifier", "v:1", "--service-token"]),
    ("orchestrator.cli_serve", ["--auth-token"]),
    ("orchestrator.cli_generate", ["hi", "--auth-token"]),
])
def test_every_token_option_refuses_an_empty_or_unsendable_token(module, options, capsys):
    """An empty token (an unset variable in `--auth-token "$TOKEN"`) would turn authentication off
    without a word; one with a space or a newline cannot travel in a header."""
    import importlib

    p = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(p)
    assert p.parse_args([*options, "s3cret-token_1"]) is not None
    for bad in ("", "two words", "line\nbreak", "caf\u00e9"):
        with pytest.raises(SystemExit):
            p.parse_args([*options, bad])
        assert "--" in capsys.readouterr().err


def test_a_request_that_does_not_parse_is_invalid_argument_for_every_method():
    """Bytes that are no message of the method's request type (here a sequence id that is not
    UTF-8) are the client's error: INVALID_ARGUMENT for the raw methods (the servicer parses them)
    and the parsed ones alike, where grpcio's own parse answers INTERNAL."""
    from treeserve.errors import InvalidArgument

    class Parsing(_RecordingVerifier):
        def Verify(self, request, context):
            try:
                pb.VerifyRequest.FromString(request)
            except Exception as exc:  # noqa: BLE001
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(InvalidArgument(str(exc))))
            return pb.VerifyResponse()

    servicer = Parsing()
    server = Server("127.0.0.1:0").add(pbg.add_VerifierServicer_to_server, servicer, "Verifier",
                                       raw_methods=["Verify"]).start()
    bad = b"\x0a\x02\xff\xfe"  # field 1 (a string), two bytes that are not UTF-8
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            for method in ("Verify", "Release", "Prefill"):
                call = ch.unary_unary(f"/treeserve.v1.Verifier/{method}")
                with pytest.raises(grpc.RpcError) as info:
                    call(bad, timeout=10)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value.details())
            stub = pbg.VerifierStub(ch)
            stub.Stats(pb.StatsRequest(), timeout=10)  # and a good request still reaches the servicer
    finally:
        server.stop(grace=0)
    assert isinstance(servicer.seen["Stats"], pb.StatsRequest)


def test_a_shutdown_tells_what_asked_before_the_grace_begins():
    with slow_server(grace_s=5.0, handler_s=30.0) as (server, entered):
        told = []
        server.on_stopping(lambda: told.append(server.stopping.is_set()))
        thread, out = call_in_background(server.port)
        assert entered.wait(10)
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        deadline = time.monotonic() + 10
        while not told and time.monotonic() < deadline:
            time.sleep(0.01)
        assert told == [True] and stopper.is_alive()  # told while the call still has its grace
    stopper.join(10)
    thread.join(10)


def test_a_shutdown_callback_that_raises_does_not_stop_the_shutdown(caplog):
    with slow_server(grace_s=0.0, handler_s=0.0) as (server, _):
        told = []

        def broken():
            raise RuntimeError("broken callback")

        server.on_stopping(broken)
        server.on_stopping(lambda: told.append("after"))
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        stopper.join(30)
        assert not stopper.is_alive()
        assert told == ["after"] and "a shutdown callback failed" in caplog.text
