"""treeserve.server.Server's shutdown: calls in flight get the grace period, and no more."""
from __future__ import annotations

import argparse
import threading
import time

import grpc
import pytest

from treeserve.server import GRACE_SECONDS, Server, add_grace_argument

METHOD = "/treeserve.v1.Verifier/Slow"


def serve_slow(grace_s: float, sleep_s: float) -> tuple[Server, threading.Event]:
    """A started server with one unary method (bytes in, bytes out) that sleeps `sleep_s` seconds."""
    entered = threading.Event()

    def slow(request: bytes, context) -> bytes:
        entered.set()
        time.sleep(sleep_s)
        return request

    def register(_servicer, server):
        handlers = {"Slow": grpc.unary_unary_rpc_method_handler(slow)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("treeserve.v1.Verifier", handlers),))

    server = Server("127.0.0.1:0", grace_s=grace_s).add(register, None, "Verifier").start()
    return server, entered


def call_in_background(port: int) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            try:
                out["reply"] = ch.unary_unary(METHOD)(b"ping", timeout=30)
            except grpc.RpcError as exc:
                out["code"] = exc.code()

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_a_call_in_flight_finishes_within_the_grace_period():
    server, entered = serve_slow(grace_s=10.0, sleep_s=0.5)
    caller, out = call_in_background(server.port)
    assert entered.wait(10)
    t0 = time.monotonic()
    server.stop()  # the server's own grace period
    caller.join(10)
    assert out == {"reply": b"ping"}
    assert time.monotonic() - t0 < 5.0  # it waited for the call, not for the whole 10 s


def test_a_call_that_outlasts_the_grace_period_is_cut_off():
    server, entered = serve_slow(grace_s=0.2, sleep_s=5.0)
    caller, out = call_in_background(server.port)
    assert entered.wait(10)
    t0 = time.monotonic()
    server.stop()
    stopped_after = time.monotonic() - t0
    caller.join(10)
    # the server cancels the call and closes the connection; which of the two the client sees first varies
    assert out.get("code") in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), out
    assert stopped_after < 3.0  # well before the handler's 5 s


def test_a_negative_grace_period_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        Server("127.0.0.1:0", grace_s=-1.0)


@pytest.mark.parametrize("text", ["-1", "nan", "soon"])
def test_the_option_refuses_what_is_not_a_number_of_seconds(text, capsys):
    p = argparse.ArgumentParser()
    add_grace_argument(p)
    assert p.parse_args([]).shutdown_grace_s == GRACE_SECONDS
    assert p.parse_args(["--shutdown-grace-s", "0"]).shutdown_grace_s == 0.0
    with pytest.raises(SystemExit):
        p.parse_args(["--shutdown-grace-s", text])
    assert "must be a number of seconds >= 0" in capsys.readouterr().err
