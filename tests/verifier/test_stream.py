"""VerifyStream: Verify over one long-lived stream. Same answers as unary Verify, one response per
request in order, a malformed request ends only its own stream, per-item errors do not end it, a
late response fails like a unary deadline, and the bearer token is required. Each test runs on the
main (grpcio) port with StreamSession and on the direct port (treeserve.h2grpc) with
DirectStreamSession: the contract is the same."""
from __future__ import annotations

import queue
import random
import time

import grpc
import pytest

from tests.verifier.trees import random_tree, with_drafts
from treeserve.sampling import Sampling
from treeserve.tree import TokenTree, tree_to_proto
from treeserve.v1 import treeserve_pb2 as pb
from treeserve.v1 import treeserve_pb2_grpc as pbg
from verifier_service.client import CommitSpec, VerifierClient, VerifyItem

VOCAB = 320


TRANSPORTS = ("grpc", "direct")


def stream_opener(client: VerifierClient, transport: str):
    """open(timeout=None) -> a VerifyStream session of `client`'s verifier on `transport`."""
    if transport == "grpc":
        return client.verify_stream
    port = client.stats().direct_port
    assert port, "the verifier serves no direct port"
    return lambda timeout=None: client.verify_stream_direct(f"127.0.0.1:{port}", timeout)


@pytest.fixture(params=TRANSPORTS)
def open_stream(request, client):
    return stream_opener(client, request.param)


def request(*items: VerifyItem):
    return pb.VerifyRequest(items=[it.to_proto() for it in items])


def answers(resp) -> list:
    """Everything a response says about its items (forward timing aside)."""
    out = []
    for r in resp.results:
        tops = [(list(t.tokens), [round(x, 5) for x in t.logprobs]) for t in r.top_logprobs]
        walk = (list(r.walk.accepted_nodes), r.walk.bonus_token) if r.HasField("walk") else None
        error = (r.error.code, r.error.message) if r.HasField("error") else None
        out.append((error, r.committed_length, list(r.target_tokens), walk, tops))
    return out


@pytest.mark.parametrize("s, drafts", [(Sampling(), False), (Sampling(temperature=0.9, top_k=40, seed=21), True)])
def test_stream_answers_equal_unary_step_by_step(client, open_stream, fresh_id, s, drafts):
    """Twin sequences (same prompt and sampling) stepped through the same trees and commits, one by
    unary Verify, the other over one stream: equal answers at every step."""
    rng = random.Random(7)
    prompt = [rng.randrange(1, VOCAB) for _ in range(8)]
    unary_id, stream_id = fresh_id("unary"), fresh_id("stream")
    L, root = client.prefill(unary_id, prompt, s)
    assert client.prefill(stream_id, prompt, s) == (L, root)
    commit = None
    with open_stream() as stream:
        for _ in range(6):
            tree = random_tree(rng, root, VOCAB, size=rng.randint(1, 12))
            if drafts and tree.size > 1:
                tree = with_drafts(rng, tree, VOCAB)
            by_call = client.verify_raw(request(VerifyItem(unary_id, L, tree, commit, top_logprobs=3)))
            by_stream = stream.send(request(VerifyItem(stream_id, L, tree, commit, top_logprobs=3)))
            assert answers(by_stream) == answers(by_call)
            (r,) = by_call.results
            assert not r.HasField("error")
            if r.HasField("walk"):
                path, bonus = tuple(r.walk.accepted_nodes), r.walk.bonus_token
            else:  # any branch is a valid commit: the longest moves state furthest
                path = tuple(max((tree.path_to(i) for i in range(tree.size)), key=len))
                bonus = r.target_tokens[path[-1]]
            commit = CommitSpec(L, path)
            L, root = L + len(path), bonus
        assert stream.open


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pipelined_requests_get_one_response_each_in_order(client, verifier, fresh_id, transport):
    """Requests written ahead of their answers (grpcio's stub, not a session): each response belongs
    to the request at its position."""
    ids = [fresh_id("pipe") for _ in range(3)]
    roots = {sid: client.prefill(sid, [3, 4, 5 + k]) for k, sid in enumerate(ids)}
    plan = []  # per request: [(sequence id, tree size)]
    for i in range(24):
        chosen = ids[i % 3: i % 3 + 1 + i % 2]  # one or two sequences
        plan.append([(sid, 1 + (i * 5 + j) % 7) for j, sid in enumerate(chosen)])
    reqs = [request(*(VerifyItem(sid, roots[sid][0], TokenTree.chain([roots[sid][1]] + [9] * (n - 1)))
                      for sid, n in step)) for step in plan]
    address = verifier.address if transport == "grpc" else f"127.0.0.1:{client.stats().direct_port}"
    with grpc.insecure_channel(address) as ch:
        responses = list(pbg.VerifierStub(ch).VerifyStream(iter(reqs), timeout=60))
    assert len(responses) == len(plan)
    for step, resp in zip(plan, responses):
        assert [(r.sequence_id, len(r.target_tokens)) for r in resp.results] == step
        assert all(not r.HasField("error") for r in resp.results)


def test_malformed_request_ends_only_its_stream(client, open_stream, fresh_id):
    sid, other = fresh_id(), fresh_id()
    L, root = client.prefill(sid, [1, 2, 3])
    Lo, root_o = client.prefill(other, [1, 2, 4])
    good = request(VerifyItem(sid, L, TokenTree.single(root)))
    with open_stream() as bad, open_stream() as bystander:
        assert bad.send(good).results[0].committed_length == L
        assert bystander.send(request(VerifyItem(other, Lo, TokenTree.single(root_o)))).results[0].target_tokens
        with pytest.raises(grpc.RpcError) as e:
            bad.send(request(VerifyItem(sid, L, TokenTree.single(root)), VerifyItem(sid, L, TokenTree.single(root))))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than once" in e.value.details()
        assert not bad.open and bad.error is e.value
        # the other stream and unary calls carry on; the failed session opens a new stream
        assert bystander.open
        (r,) = bystander.send(request(VerifyItem(other, Lo, TokenTree.chain([root_o, 7])))).results
        assert not r.HasField("error") and len(r.target_tokens) == 2
        assert client.verify([VerifyItem(sid, L, TokenTree.single(root))]).results[0].ok
        assert bad.send(good).results[0].committed_length == L and bad.open


def test_item_errors_travel_inside_the_response(client, open_stream, fresh_id):
    sid = fresh_id()
    L, root = client.prefill(sid, [6, 7])
    with open_stream() as stream:
        resp = stream.send(request(VerifyItem(fresh_id("unknown"), 0, TokenTree.single(root)),
                                   VerifyItem(sid, L + 3, TokenTree.single(root)),
                                   VerifyItem(sid + "-too-long", 0, TokenTree.single(root), top_logprobs=99)))
        codes = [r.error.code for r in resp.results]
        assert codes == [c.value[0] for c in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                                              grpc.StatusCode.INVALID_ARGUMENT)]
        assert stream.open and stream.error is None
        assert stream.send(request(VerifyItem(sid, L, TokenTree.single(root)))).results[0].committed_length == L


def test_late_response_is_deadline_exceeded_and_the_next_send_reopens(client, open_stream, fresh_id):
    sid = fresh_id()
    L, root = client.prefill(sid, [8, 9, 10])
    slow = request(VerifyItem(sid, L, random_tree(random.Random(1), root, VOCAB, size=16)))
    with open_stream(timeout=3.0) as stream:
        # answers in time, also after the deadline thread woke up with nothing to wait for
        assert stream.send(slow).results[0].committed_length == L
        time.sleep(3.2)
        assert stream.send(slow).results[0].committed_length == L
        with pytest.raises(grpc.RpcError) as e:
            stream.send(slow, timeout=1e-4)  # no round trip through a model is this fast
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "no response within" in e.value.details()
        assert not stream.open and stream.error is e.value
        assert stream.send(slow).results[0].committed_length == L and stream.open


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_stream_requires_the_token(tiny_pair, transport):
    from models import HybridLM
    from verifier_service.limits import Limits
    from verifier_service.servicer import ModelInfo, VerifierServer

    lm = HybridLM.from_pretrained(tiny_pair[0], max_slots=2, max_len=64)
    srv = VerifierServer(lm, Limits(max_sequences=2, max_tree_nodes=8, max_sequence_length=64), "127.0.0.1:0",
                         ModelInfo("target", "cpu", (0,)), auth_token="s3cret", direct_address="127.0.0.1:0")
    address = f"127.0.0.1:{srv.port}"
    stream_address = address if transport == "grpc" else f"127.0.0.1:{srv.direct_port}"

    def open_stream(c: VerifierClient):  # not stream_opener: an anonymous client may not ask Stats
        return c.verify_stream() if transport == "grpc" else c.verify_stream_direct(stream_address)

    try:
        with VerifierClient(address, timeout=30) as anonymous, open_stream(anonymous) as stream:
            with pytest.raises(grpc.RpcError) as e:
                stream.send(request(VerifyItem("a", 3, TokenTree.single(1))))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # refused at once, before the client writes anything (a refusal of the wrong kind of
        # handler would wait for a first message and run into the deadline instead)
        silent: queue.SimpleQueue = queue.SimpleQueue()
        with grpc.insecure_channel(stream_address) as ch:
            call = pbg.VerifierStub(ch).VerifyStream(iter(silent.get, None), timeout=10)
            with pytest.raises(grpc.RpcError) as e:
                next(call)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            silent.put(None)
        with VerifierClient(address, auth_token="s3cret", timeout=30) as c, open_stream(c) as stream:
            L, root = c.prefill("a", [1, 2, 3])
            (r,) = stream.send(pb.VerifyRequest(items=[pb.VerifyItem(
                sequence_id="a", committed_length=L, tree=tree_to_proto(TokenTree.single(root)))])).results
            assert r.committed_length == L and len(r.target_tokens) == 1
    finally:
        srv.stop()


GRACE_S = 60.0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shutdown_ends_an_open_stream_at_its_next_request(tiny_pair, transport):
    """SIGTERM with a stream open: its next request is answered UNAVAILABLE (go to another replica),
    not served, and the process exits long before its grace period (60 s here), which an open
    stream would otherwise hold it for. (The grace is long so that a busy machine's slow exit is
    never mistaken for a held one.)"""
    from tests.verifier.harness import VerifierProcess

    proc = VerifierProcess(tiny_pair[0], "--shutdown-grace-s", str(GRACE_S), "--direct-port", "0")
    try:
        with VerifierClient(proc.address, timeout=30) as c:
            L, root = c.prefill("bye", [3, 4, 5])
            with stream_opener(c, transport)() as stream:
                stream.send(request(VerifyItem("bye", L, TokenTree((root,), (-1,)))))
                proc.proc.terminate()
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as err:
                    while time.monotonic() - t0 < GRACE_S / 2:  # until the server has taken the signal
                        stream.send(request(VerifyItem("bye", L, TokenTree((root,), (-1,)))))
                        time.sleep(0.02)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
                assert "shutting down" in err.value.details()
                proc.proc.wait(timeout=GRACE_S / 2)
                assert time.monotonic() - t0 < GRACE_S / 2
    finally:
        proc.stop()


def test_open_streams_are_capped_so_unary_calls_keep_their_threads(tiny_pair):
    """An open VerifyStream holds one of the main port's RPC threads for its life. Past the cap
    (half the pool) a new stream is refused with RESOURCE_EXHAUSTED before it reads anything,
    while Stats, health and Prefill still answer; once a stream ends, a new one is taken."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from models import HybridLM
    from treeserve.stream_session import drain
    from verifier_service.limits import Limits
    from treeserve.server import rpc_threads, stream_cap
    from verifier_service.servicer import ModelInfo, VerifierServer

    limits = Limits(max_sequences=2, max_tree_nodes=8, max_sequence_length=64)
    lm = HybridLM.from_pretrained(tiny_pair[0], max_slots=2, max_len=64)
    srv = VerifierServer(lm, limits, "127.0.0.1:0", ModelInfo("target", "cpu", (0,)))
    cap = srv.servicer.max_streams
    assert cap == stream_cap(rpc_threads(limits.max_sequences)) == rpc_threads(limits.max_sequences) // 2
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    stub = pbg.VerifierStub(channel)
    streams: list = []  # (request queue, call) of every stream the test opened

    def open_stream():
        requests: queue.SimpleQueue = queue.SimpleQueue()
        call = stub.VerifyStream(drain(requests), timeout=60)
        streams.append((requests, call))
        return requests, call

    def open_and_answered():
        """A stream that has answered a request: open on the server, holding its slot."""
        requests, call = open_stream()
        requests.put(pb.VerifyRequest())
        assert len(next(call).results) == 0

    try:
        for _ in range(cap):
            open_and_answered()
        _, refused = open_stream()
        with pytest.raises(grpc.RpcError) as e:
            next(refused)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{cap} VerifyStreams are open" in e.value.details()
        # the unary calls still find threads
        assert stub.Stats(pb.StatsRequest(), timeout=10).max_sequences == 2
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        prefill = stub.Prefill(pb.PrefillRequest(sequence_id="a", prompt_tokens=[1, 2, 3]), timeout=10)
        assert prefill.committed_length == 3
        # a stream ends (its client half-closes, then reads the end, sent after its slot was freed)
        requests, ending = streams[0]
        requests.put(None)
        assert list(ending) == []
        open_and_answered()
    finally:
        for requests, call in streams:
            requests.put(None)
            call.cancel()
        channel.close()
        srv.stop()
