"""The service's edge: health, reflection, metrics, Stats, and requests refused before any work."""
from __future__ import annotations

import time
import urllib.request

import grpc
import pytest

from tests.verifier.harness import MAX_SEQUENCE_LENGTH, MAX_SEQUENCES, MAX_TREE_NODES
from treeserve.sampling import Sampling
from treeserve.tree import TokenTree
from treeserve.v1 import treeserve_pb2 as pb
from verifier_service.client import CommitSpec, VerifyItem
from verifier_service.metrics import CALL_STAGES

VOCAB = 320


def _code(excinfo) -> grpc.StatusCode:
    return excinfo.value.code()


def test_health_and_reflection(verifier):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(verifier.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "treeserve.v1.Verifier"):
            assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        (answer,) = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in answer.list_services_response.service}
    assert "treeserve.v1.Verifier" in names
    assert "grpc.health.v1.Health" in names


def test_stats_describe_model_and_limits(client):
    st = client.stats()
    assert st.vocab_size == VOCAB
    assert list(st.eos_token_ids) == [0]
    assert (st.max_sequences, st.max_tree_nodes, st.max_sequence_length) == (MAX_SEQUENCES, MAX_TREE_NODES, MAX_SEQUENCE_LENGTH)
    assert st.device == "cpu" and st.model == "target"


def test_malformed_tree_is_invalid_argument_with_clear_message(client, fresh_id):
    sid = fresh_id()
    L, root = client.prefill(sid, [5, 6, 7])
    bad = pb.VerifyRequest(items=[pb.VerifyItem(
        sequence_id=sid, committed_length=L, tree=pb.TokenTree(tokens=[root, 8, 9], parents=[-1, 2, 0]))])
    (r,) = client.verify_raw(bad).results
    assert r.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "node 1" in r.error.message and "parent 2" in r.error.message and sid in r.error.message
    assert len(r.target_tokens) == 0
    # other rules, each named in its message
    for tokens, parents, words in [
        ([root, VOCAB], [-1, 0], "outside the vocabulary"),
        ([root, 4, 4], [-1, 0, 0], "siblings must differ"),
        ([root, 4], [-1, -1], "second root"),
        ([root], [], "parents"),
    ]:
        msg = pb.VerifyRequest(items=[pb.VerifyItem(sequence_id=sid, committed_length=L,
                                                    tree=pb.TokenTree(tokens=tokens, parents=parents))])
        (r,) = client.verify_raw(msg).results
        assert r.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], tokens
        assert words in r.error.message
    # the sequence is untouched: a valid tree verifies at the same length
    ok = client.verify([VerifyItem(sid, L, TokenTree.single(root))]).results[0]
    assert ok.ok and ok.committed_length == L


def test_requests_refused_as_a_whole(client, fresh_id):
    sid = fresh_id()
    L, root = client.prefill(sid, [1, 2])
    item = VerifyItem(sid, L, TokenTree.single(root))
    with pytest.raises(grpc.RpcError) as e:
        client.verify([item, item])
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT and "more than once" in e.value.details()
    for prompt, s in [([], Sampling()), ([VOCAB], Sampling()), ([1] * MAX_SEQUENCE_LENGTH, Sampling()),
                      ([1, 2], Sampling(temperature=-1.0)), ([1, 2], Sampling(temperature=1.0, top_p=1.5))]:
        with pytest.raises(grpc.RpcError) as e:
            client.prefill(fresh_id(), prompt, s)
        assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT, (len(prompt), s)
    for bad_id in ["", "x" * 129]:
        with pytest.raises(grpc.RpcError) as e:
            client.prefill(bad_id, [1])
        assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        client._stub.Commit(pb.CommitRequest(sequence_id=sid))
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
    # per-item refusals: out-of-range top_logprobs, a commit path not starting at the root
    r = client.verify([VerifyItem(sid, L, TokenTree.single(root), top_logprobs=21),
                       VerifyItem(fresh_id(), 0, TokenTree.single(root), commit=CommitSpec(0, (1,)))]).results
    assert [x.error.code for x in r] == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND]


def test_metrics_endpoint(verifier, client, fresh_id):
    sid = fresh_id()
    L, root = client.prefill(sid, [3, 4])
    client.verify([VerifyItem(sid, L, TokenTree.chain([root, 5, 6]))])
    client.verify([VerifyItem(sid, L + 7, TokenTree.single(root))])  # wrong length
    def value(text: str, name: str) -> float:
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    # recorded once each reply is out (the forward's metrics too), so possibly a moment after it arrived
    deadline = time.monotonic() + 10
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{verifier.metrics_port}/metrics", timeout=10).read().decode()
        if value(text, "treeserve_verifier_nodes_verified_total") >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert value(text, "treeserve_verifier_forward_passes_total") >= 1
    assert value(text, "treeserve_verifier_nodes_verified_total") >= 3
    for name in ("treeserve_verifier_forward_passes_total", "treeserve_verifier_nodes_verified_total",
                 "treeserve_verifier_batch_sequences_bucket", "treeserve_verifier_forward_ms_bucket",
                 'treeserve_verifier_errors_total{code="FAILED_PRECONDITION"}',
                 *(f'treeserve_verifier_call_ms_count{{stage="{st}"}}' for st in CALL_STAGES)):
        assert name in text, name
    # the calls above came alone to a free model: each ran its forward on its own RPC thread
    assert value(text, "treeserve_verifier_inline_calls_total") >= 1


def test_a_duplicate_is_found_in_one_pass_over_many_ids():
    """The duplicate check is linear: 50 000 ids (a check that compared every id with every other
    would take minutes) with the repeat at the very end, and without one."""
    from verifier_service.servicer import first_duplicate

    ids = [f"s{i}" for i in range(50_000)]
    assert first_duplicate(ids + ["s49999"]) == "s49999"
    assert first_duplicate(ids) is None
    assert first_duplicate(["a", "b", "a", "b", "b"]) == "a"  # the first id seen again, named


def test_a_duplicate_at_the_end_of_a_full_request_is_refused(client, fresh_id):
    ids = [fresh_id("dup") for _ in range(MAX_SEQUENCES - 1)]
    items = [pb.VerifyItem(sequence_id=sid, committed_length=1, tree=pb.TokenTree(tokens=[1], parents=[-1]))
             for sid in ids + ids[-1:]]
    with pytest.raises(grpc.RpcError) as e:
        client.verify_raw(pb.VerifyRequest(items=items))
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sequence {ids[-1]!r} appears more than once" in e.value.details()


def _unknown_items(n: int) -> pb.VerifyRequest:
    """A request of `n` items for sequences the verifier does not hold (one-node trees)."""
    return pb.VerifyRequest(items=[pb.VerifyItem(sequence_id=f"never-prefilled-{i}", committed_length=1,
                                                 tree=pb.TokenTree(tokens=[1], parents=[-1])) for i in range(n)])


def _raw_calls(address: str):
    """(name, call(request bytes) -> response bytes) for Verify and VerifyStream at `address`,
    bytes in and out, so that a test can send what no serializer would."""
    ch = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
    unary = ch.unary_unary("/treeserve.v1.Verifier/Verify")
    stream = ch.stream_stream("/treeserve.v1.Verifier/VerifyStream")
    return ch, [("Verify", lambda raw: unary(raw, timeout=60)),
                ("VerifyStream", lambda raw: next(stream(iter([raw]), timeout=60)))]


@pytest.mark.parametrize("port", ["main", "direct"])
def test_more_items_than_sequences_are_refused_as_a_whole(verifier, client, port):
    """Every item past max_sequences could only fail: a request with more is refused before any
    tree is decoded, with the limit named, on Verify and VerifyStream and on both ports; one
    exactly at the limit is served item by item (here: each NOT_FOUND)."""
    address = verifier.address if port == "main" else f"127.0.0.1:{client.stats().direct_port}"
    ch, calls = _raw_calls(address)
    with ch:
        for name, call in calls:
            for n in (MAX_SEQUENCES + 1, 50_000):
                with pytest.raises(grpc.RpcError) as e:
                    call(_unknown_items(n).SerializeToString())
                assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT, (name, n)
                assert f"{n} items in one request: at most {MAX_SEQUENCES}" in e.value.details(), (name, n)
            answer = pb.VerifyResponse.FromString(call(_unknown_items(MAX_SEQUENCES).SerializeToString()))
            assert [r.error.code for r in answer.results] == [grpc.StatusCode.NOT_FOUND.value[0]] * MAX_SEQUENCES


@pytest.mark.parametrize("port", ["main", "direct"])
def test_a_request_that_does_not_parse_is_invalid_argument_on_both_ports(verifier, client, port):
    """A VerifyRequest whose item's sequence_id is not UTF-8 does not parse: the client's error
    (INVALID_ARGUMENT), not the server's (grpcio's own parse failure is INTERNAL), on Verify and
    VerifyStream alike, and on the main port as on the direct one."""
    item = b"\x0a\x02\xff\xfe"  # VerifyItem{sequence_id (field 1, length-delimited) = b"\xff\xfe"}
    raw = b"\x0a" + bytes([len(item)]) + item  # VerifyRequest{items (field 1) = item}
    address = verifier.address if port == "main" else f"127.0.0.1:{client.stats().direct_port}"
    ch, calls = _raw_calls(address)
    with ch:
        for name, call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call(raw)
            assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT, name
            assert "VerifyRequest does not parse" in e.value.details(), name
            # and a request that parses is answered as ever on the same method
            assert len(pb.VerifyResponse.FromString(call(_unknown_items(1).SerializeToString())).results) == 1
