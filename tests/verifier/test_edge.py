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
