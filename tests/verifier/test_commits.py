"""Commit rules, refused items and limits: the right codes, and no effect on anyone's state."""
from __future__ import annotations

import random

import grpc
import pytest

from tests.verifier.harness import MAX_SEQUENCE_LENGTH, MAX_SEQUENCES, MAX_TREE_NODES
from tests.verifier.trees import random_tree
from treeserve.tree import TokenTree
from treeserve.v1 import treeserve_pb2 as pb
from verifier_service.client import CommitSpec, VerifyItem

VOCAB = 320
FP = grpc.StatusCode.FAILED_PRECONDITION
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _refused(call, code):
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, e.value.details()
    return e.value.details()


def test_explicit_commit_rules(client, reference, fresh_id):
    rng = random.Random(1)
    prompt = [7, 8, 9, 10]
    sid, ref = fresh_id(), reference.sequence(prompt)
    try:
        L, root = client.prefill(sid, prompt)
        assert "no verified tree" in _refused(lambda: client.commit(sid, L, [0]), FP)
        tree = TokenTree((root, 11, 12, 13), (-1, 0, 0, 1))
        client.verify([VerifyItem(sid, L, tree)])
        ref.verify(tree)
        _refused(lambda: client.commit(sid, L, [0, 3]), INVALID)  # 3 hangs below 1, not below 0
        _refused(lambda: client.commit(sid, L, [1, 3]), INVALID)  # does not start at the root
        _refused(lambda: client.commit(sid, L, []), INVALID)
        assert "future" in _refused(lambda: client.commit(sid, L + 2, [0]), FP)
        assert "stale" in _refused(lambda: client.commit(sid, L - 3, [0]), FP)
        assert client.commit(sid, L, [0, 1, 3]) == L + 3
        ref.commit([0, 1, 3])
        # a retry (lost reply) is a no-op returning the current length; another commit that would
        # reach the same length was never applied, and says so
        assert client.commit(sid, L, [0, 1, 3]) == L + 3
        assert "was not applied" in _refused(lambda: client.commit(sid, L + 2, [0]), FP)
        assert "was not applied" in _refused(lambda: client.commit(sid, L + 1, [0, 1]), FP)
        # the tree is consumed: nothing left to commit at the new length
        assert "no verified tree" in _refused(lambda: client.commit(sid, L + 3, [0]), FP)
        # and after all of that the state is exactly the runtime's
        nxt = random_tree(rng, 42, VOCAB, size=8)
        (r,) = client.verify([VerifyItem(sid, L + 3, nxt)]).results
        assert r.ok and list(r.target_tokens) == ref.verify(nxt)[0]
    finally:
        ref.close()


def test_retried_verify_with_commit_is_safe(client, reference, fresh_id):
    prompt = [3, 1, 4, 1, 5]
    sid, ref = fresh_id(), reference.sequence(prompt)
    try:
        L, root = client.prefill(sid, prompt)
        t1 = TokenTree((root, 9, 26, 5), (-1, 0, 1, 1))
        client.verify([VerifyItem(sid, L, t1)])
        ref.verify(t1)
        t2 = TokenTree((35, 8, 97), (-1, 0, 1))
        item = VerifyItem(sid, L + 2, t2, commit=CommitSpec(L, (0, 1)))
        first = client.verify([item]).results[0]
        again = client.verify([item]).results[0]  # as if the first reply was lost
        ref.commit([0, 1])
        want = ref.verify(t2)[0]
        assert first.ok and again.ok
        assert list(first.target_tokens) == list(again.target_tokens) == want
        assert first.committed_length == again.committed_length == L + 2
    finally:
        ref.close()


def test_bad_items_do_not_affect_the_others(client, reference, fresh_id):
    rng = random.Random(2)
    names = ["good", "stale", "future", "oversized", "malformed", "no-commit"]
    ids = {n: fresh_id(n) for n in names}
    prompts = {n: [rng.randrange(1, VOCAB) for _ in range(5 + i)] for i, n in enumerate(names)}
    refs = {n: reference.sequence(prompts[n]) for n in names}
    try:
        state = {}
        for n in names:
            L, root = client.prefill(ids[n], prompts[n])
            tree = random_tree(rng, root, VOCAB, size=6)
            (r,) = client.verify([VerifyItem(ids[n], L, tree)]).results
            refs[n].verify(tree)
            state[n] = (L, tree, r.target_tokens)
        def path_of(n):
            return (0, 1) if state[n][1].parents[1] == 0 else (0,)
        def nxt(n, size=5):
            L, tree, targets = state[n]
            p = path_of(n)
            return L + len(p), random_tree(rng, targets[p[-1]], VOCAB, size=size)
        good_L, good_tree = nxt("good")
        items = [
            pb.VerifyItem(sequence_id=ids["good"], committed_length=good_L, tree=_tp(good_tree),
                          commit=pb.Commit(committed_length=state["good"][0], accepted_nodes=path_of("good"))),
            pb.VerifyItem(sequence_id="never-prefilled", committed_length=3, tree=_tp(TokenTree.single(1))),
            pb.VerifyItem(sequence_id=ids["stale"], committed_length=state["stale"][0],
                          tree=_tp(TokenTree.single(1)),
                          commit=pb.Commit(committed_length=state["stale"][0] - 2, accepted_nodes=[0])),
            pb.VerifyItem(sequence_id=ids["future"], committed_length=state["future"][0] + 1,
                          tree=_tp(TokenTree.single(1))),
            pb.VerifyItem(sequence_id=ids["oversized"], committed_length=state["oversized"][0],
                          tree=_tp(TokenTree.chain(list(range(1, MAX_TREE_NODES + 2))))),
            pb.VerifyItem(sequence_id=ids["malformed"], committed_length=state["malformed"][0] + 1,
                          tree=pb.TokenTree(tokens=[1, 2], parents=[-1, 1]),
                          commit=pb.Commit(committed_length=state["malformed"][0], accepted_nodes=[0])),
            pb.VerifyItem(sequence_id=ids["no-commit"], committed_length=state["no-commit"][0],
                          tree=_tp(TokenTree.single(1)),
                          commit=pb.Commit(committed_length=state["no-commit"][0], accepted_nodes=[0, 9])),
        ]
        res = client.verify_raw(pb.VerifyRequest(items=items)).results
        codes = [grpc.StatusCode.OK if not r.HasField("error") else _status(r.error.code) for r in res]
        assert codes == [grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, FP, FP, INVALID, INVALID, INVALID]
        assert "more than the limit" in res[4].error.message
        refs["good"].commit(path_of("good"))
        assert list(res[0].target_tokens) == refs["good"].verify(good_tree)[0]
        # every refused sequence still holds its last tree: committing it now gives the runtime's answer
        for n in names[1:]:
            L2, tree2 = nxt(n)
            p = path_of(n)
            (r,) = client.verify([VerifyItem(ids[n], L2, tree2, commit=CommitSpec(state[n][0], p))]).results
            refs[n].commit(p)
            assert r.ok, (n, r.error)
            assert list(r.target_tokens) == refs[n].verify(tree2)[0], n
    finally:
        for r in refs.values():
            r.close()


def test_tree_past_the_sequence_length_limit(client, fresh_id):
    sid = fresh_id()
    prompt = [5] * (MAX_SEQUENCE_LENGTH - 8)
    L, root = client.prefill(sid, prompt)
    (r,) = client.verify([VerifyItem(sid, L, TokenTree.chain([root] + list(range(1, 9))))]).results
    assert r.error.code == INVALID and "maximum sequence length" in r.error.message
    (r,) = client.verify([VerifyItem(sid, L, TokenTree.chain([root] + list(range(1, 8))))]).results
    assert r.ok


def test_slots_exhausted(client, reference, fresh_id):
    prompt = [2, 7, 1, 8]
    keep, ref = fresh_id(), reference.sequence(prompt)
    try:
        L, root = client.prefill(keep, prompt)
        tree = TokenTree((root, 18, 28), (-1, 0, 0))
        free = MAX_SEQUENCES - client.stats().active_sequences
        fillers = [fresh_id("fill") for _ in range(free)]
        for f in fillers:
            client.prefill(f, [1, 2, 3])
        assert "slots" in _refused(lambda: client.prefill(fresh_id(), [1, 2, 3]), grpc.StatusCode.RESOURCE_EXHAUSTED)
        # the live sequences work as before
        (r,) = client.verify([VerifyItem(keep, L, tree)]).results
        assert list(r.target_tokens) == ref.verify(tree)[0]
        # a freed slot is usable again
        assert client.release(fillers[0])
        assert client.prefill(fresh_id(), [1, 2, 3])[0] == 3
    finally:
        ref.close()


def _tp(tree):
    from treeserve.tree import tree_to_proto

    return tree_to_proto(tree)


def _status(code: int) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == code)
