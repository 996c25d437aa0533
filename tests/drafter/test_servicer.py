"""The Drafter servicer in process: Speculate streams are capped so that idle ones never take the
threads of StartSequence, Stats and health; a tree shape the drafter does not know is refused."""
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_service.client import DrafterClient, draft_request
from drafter_service.engine import Drafter
from drafter_service.servicer import DrafterServicer, serve
from treeserve.server import channel, rpc_threads, stream_cap
from treeserve.v1 import treeserve_pb2 as pb


class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(details)
        self.code = code


class Context:
    """What the servicer needs of a grpc.ServicerContext."""

    def abort(self, code, details):
        raise Aborted(code, details)


def unread():
    """A stream's requests that must not be read."""
    raise AssertionError("a refused stream read its requests")
    yield


@pytest.fixture
def ngram():
    d = Drafter(None, max_sequences=4, idle_timeout_s=0)
    yield d
    d.close()


def test_a_stream_past_the_cap_is_refused_before_it_reads_anything(ngram):
    servicer = DrafterServicer(ngram, max_streams=1)
    first = servicer.Speculate(iter([draft_request("ghost", 1, 1)]), Context())
    assert next(first).error.code == grpc.StatusCode.NOT_FOUND.value[0]  # open, suspended: it holds its slot
    with pytest.raises(Aborted) as refused:
        next(servicer.Speculate(unread(), Context()))
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    first.close()  # the stream ends: its slot is free again
    again = servicer.Speculate(iter([draft_request("ghost", 1, 1)]), Context())
    assert next(again).sequence_id == "ghost"
    again.close()


def test_idle_streams_at_the_cap_leave_unary_calls_and_health_answering(ngram):
    server = serve(ngram, "127.0.0.1:0")
    address = f"127.0.0.1:{server.port}"
    cap = stream_cap(rpc_threads(ngram.max_sequences))
    streams = []
    try:
        with DrafterClient(address, timeout=5) as client:
            for _ in range(cap):
                s = client.stream()
                assert s.draft("ghost", 1, 1).error is not None  # answered: the server holds the stream
                streams.append(s)
            extra = client.stream()
            with pytest.raises(grpc.RpcError) as refused:
                extra.collect(1)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # every stream the server takes is open and idle: the other calls still have threads
            assert client.start("a", [1, 2, 3]) == 3
            assert client.stats().active_sequences == 1
            health = health_pb2_grpc.HealthStub(channel(address))
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
            assert client.end("a")
            for s in streams:
                s.close()
    finally:
        for s in streams:
            s._responses.cancel()
        server.stop(grace=0)


@pytest.mark.parametrize("shape, expect", [(pb.TREE_SHAPE_UNSPECIFIED, "ngram"), (pb.TREE_SHAPE_NGRAM, "ngram")])
def test_a_known_or_unspecified_shape_is_taken(ngram, shape, expect):
    servicer = DrafterServicer(ngram, max_streams=1)
    req = pb.StartSequenceRequest(sequence_id="s", tokens=[1, 2, 3], options=pb.DraftOptions(shape=shape))
    assert servicer.StartSequence(req, Context()).committed_length == 3
    assert ngram._seqs["s"].options.shape == expect


def test_an_unknown_shape_is_refused_not_drafted_as_the_default(ngram):
    servicer = DrafterServicer(ngram, max_streams=1)
    req = pb.StartSequenceRequest(sequence_id="s", tokens=[1, 2, 3], options=pb.DraftOptions(shape=42))
    with pytest.raises(Aborted) as refused:
        servicer.StartSequence(req, Context())
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "42" in str(refused.value)
    assert ngram.active() == 0


def test_bytes_that_do_not_parse_are_invalid_argument_unary_and_streamed(ngram):
    """A StartSequence and a Speculate request whose sequence id is not UTF-8: INVALID_ARGUMENT,
    where grpcio's own parse answers INTERNAL; the server goes on serving."""
    server = serve(ngram, "127.0.0.1:0")
    bad = b"\x0a\x02\xff\xfe"  # field 1 (the sequence id, a string): two bytes that are not UTF-8
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            with pytest.raises(grpc.RpcError) as unary:
                ch.unary_unary("/treeserve.v1.Drafter/StartSequence")(bad, timeout=10)
            with pytest.raises(grpc.RpcError) as streamed:
                list(ch.stream_stream("/treeserve.v1.Drafter/Speculate")(iter([bad]), timeout=10))
        for info in (unary, streamed):
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert "does not parse" in info.value.details()
        with DrafterClient(f"127.0.0.1:{server.port}", timeout=5) as client:
            assert client.stats().strategy
    finally:
        server.stop()


def test_a_trees_unknown_or_unserved_shape_is_refused_in_its_response(ngram):
    """A Speculate request's per-tree shape: unknown (from a newer client) or one the sequence's
    state cannot serve (a model shape on an n-gram drafter) is that request's INVALID_ARGUMENT; the
    next request of the stream is served."""
    servicer = DrafterServicer(ngram, max_streams=1)
    servicer.StartSequence(pb.StartSequenceRequest(sequence_id="s", tokens=[1, 2, 3, 1, 2]), Context())
    unknown = pb.DraftRequest(sequence_id="s", committed_length=5, root_token=3, shape=42)
    answers = [servicer._draft(r) for r in (unknown, draft_request("s", 5, 3, shape="dynamic"),
                                            draft_request("s", 5, 3, shape="ngram"))]
    for bad in answers[:2]:
        assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], bad
    assert "42" in answers[0].error.message and "draft model" in answers[1].error.message
    assert not answers[2].HasField("error") and list(answers[2].tree.tokens)[:2] == [3, 1]
