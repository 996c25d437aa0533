"""The engine sends its steps over VerifyStream: on the verifier's direct port when the verifier
advertises one (and it answers), else over gRPC; and it falls back to unary Verify against a verifier
built before VerifyStream existed, and against one whose streams are all taken. Same output every way.

Every front door serves one verifier core in this process (one model, one batcher): a full Verifier;
one that also serves the direct port; one that advertises a direct port nobody listens on; and one
registered without VerifyStream, as an older build answers (UNIMPLEMENTED); and one that takes a
single VerifyStream, held by another client (RESOURCE_EXHAUSTED)."""
from __future__ import annotations

import queue
import socket
import time

import grpc
import pytest

from orchestrator.engine import Engine, EngineConfig
from orchestrator.request import RequestSpec, Speculation
from treeserve.sampling import Sampling
from treeserve.h2grpc.server import DirectServer
from treeserve.server import Server, with_raw_requests
from treeserve.v1 import treeserve_pb2_grpc as pbg

NEW_TOKENS = 12


def register_verifier(servicer, server) -> None:
    """Register the Verifier as the verifier's own server does (Verify and VerifyStream take their
    requests as bytes and parse them themselves)."""
    from verifier_service.servicer import RAW_REQUEST_METHODS

    with_raw_requests(pbg.add_VerifierServicer_to_server, RAW_REQUEST_METHODS)(servicer, server)


def register_without_verify_stream(servicer, server) -> None:
    """Register every Verifier method but VerifyStream, under the service's usual name."""

    class Capture:
        handlers: dict = {}

        def add_generic_rpc_handlers(self, handlers):
            pass

        def add_registered_method_handlers(self, name, handlers):
            self.handlers = handlers

    cap = Capture()
    register_verifier(servicer, cap)
    older = {name: h for name, h in cap.handlers.items() if name != "VerifyStream"}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("treeserve.v1.Verifier", older),))
    server.add_registered_method_handlers("treeserve.v1.Verifier", older)  # as generated code does


@pytest.fixture(scope="module")
def verifiers(tiny_pair):
    """{'current': address, 'older': address}, both on one verifier core."""
    from models import HybridLM
    from verifier_service.batcher import Batcher
    from verifier_service.engine import Engine as VerifierEngine
    from verifier_service.limits import Limits
    from verifier_service.servicer import ModelInfo, VerifierServicer

    limits = Limits(max_sequences=4, max_tree_nodes=8, max_sequence_length=128).validate()
    lm = HybridLM.from_pretrained(tiny_pair[0], max_slots=limits.max_sequences, max_len=limits.max_sequence_length)
    core = VerifierEngine(lm, limits)
    batcher = Batcher(core, limits).start()
    def servicer(direct_port: int = 0, max_streams: int = limits.max_sequences):
        made = VerifierServicer(core, batcher, ModelInfo("target", "cpu", (0,)), max_streams=max_streams)
        made.direct_port = direct_port
        return made

    direct_servicer = servicer()
    direct = DirectServer("127.0.0.1:0", direct_servicer.direct_methods()).start()
    direct_servicer.direct_port = direct.port
    with socket.socket() as probe:  # a port that was free a moment ago: nobody listens there
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    servers = {"current": Server("127.0.0.1:0").add(register_verifier, servicer(), "Verifier"),
               "direct": Server("127.0.0.1:0").add(register_verifier, direct_servicer, "Verifier"),
               "dead_direct": Server("127.0.0.1:0").add(register_verifier, servicer(dead_port), "Verifier"),
               "older": Server("127.0.0.1:0").add(register_without_verify_stream, servicer(), "Verifier"),
               "full": Server("127.0.0.1:0").add(register_verifier, servicer(max_streams=1), "Verifier")}
    for s in servers.values():
        s.start()
    yield {name: f"127.0.0.1:{s.port}" for name, s in servers.items()}, f"127.0.0.1:{direct.port}"
    for s in servers.values():
        s.stop(grace=0)
    direct.stop(grace=0)
    batcher.stop()


def generate(engine: Engine, rid: str, prompt: list[int]) -> list[int]:
    spec = RequestSpec(rid, tuple(prompt), Sampling(), NEW_TOKENS, Speculation(mode="off", adaptive=False), front=rid)
    assert engine.submit(spec) is None
    tokens: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for ev in engine.outbox.drain(rid, timeout=1.0)[1]:
            assert ev.error is None, ev.error
            tokens.extend(ev.tokens)
            if ev.last:
                return tokens
    raise TimeoutError(f"{rid} did not finish")


def hold_the_only_stream(address: str):
    """Open the one VerifyStream a verifier of max_streams=1 takes, and keep it open (-> its call)."""
    from treeserve.stream_session import drain
    from treeserve.v1 import treeserve_pb2 as pb

    requests: queue.SimpleQueue = queue.SimpleQueue()
    call = pbg.VerifierStub(grpc.insecure_channel(address)).VerifyStream(drain(requests), timeout=120)
    requests.put(pb.VerifyRequest())
    next(call)  # answered: the server holds the stream
    return call


def test_engine_streams_and_falls_back_to_unary_on_an_older_or_full_verifier(verifiers):
    addresses, direct_address = verifiers
    prompt = [5, 17, 42, 8, 99, 3]
    outputs, rpcs, stream_addresses = {}, {}, {}
    held = hold_the_only_stream(addresses["full"])
    for name, address in addresses.items():
        engine = Engine(EngineConfig(verifier=address, name=name, connect_timeout_s=30)).start()
        engine.eos = frozenset()  # the full NEW_TOKENS whatever the random target predicts
        try:
            outputs[name] = generate(engine, f"r-{name}", prompt)
            stats = engine.stats()
            rpcs[name], stream_addresses[name] = stats["verify_rpc"], stats["verify_stream_address"]
        finally:
            engine.stop()
    held.cancel()
    assert rpcs == {"current": "VerifyStream", "direct": "VerifyStream", "dead_direct": "VerifyStream",
                    "older": "Verify", "full": "Verify"}
    assert stream_addresses["direct"] == direct_address
    assert stream_addresses["current"] == addresses["current"]
    assert stream_addresses["dead_direct"] == addresses["dead_direct"]  # fell back to gRPC
    assert len(outputs["current"]) == NEW_TOKENS
    assert outputs["older"] == outputs["current"] == outputs["direct"] == outputs["dead_direct"] == outputs["full"]
