"""Prefill / verify / commit / release through the service equal the runtime driven directly."""
from __future__ import annotations

import random

import grpc
import pytest

from tests.verifier.trees import random_tree, with_drafts
from treeserve.acceptance import follow_target
from treeserve.sampling import Sampling
from treeserve.tree import TokenTree
from verifier_service.client import CommitSpec, VerifyItem

VOCAB = 320


def test_greedy_round_trip_matches_runtime(client, reference, fresh_id):
    rng = random.Random(3)
    prompt = [rng.randrange(1, VOCAB) for _ in range(9)]
    sid = fresh_id()
    ref = reference.sequence(prompt)
    try:
        L, root = client.prefill(sid, prompt)
        assert (L, root) == (len(prompt), ref.first)
        commit = None
        for step in range(4):
            tree = random_tree(rng, root, VOCAB, size=rng.randint(1, 12))
            (r,) = client.verify([VerifyItem(sid, L, tree, commit=commit, top_logprobs=5)]).results
            want_tokens, _, want_top = ref.verify(tree, top_logprobs=5)
            assert r.ok and r.committed_length == L
            assert list(r.target_tokens) == want_tokens
            assert r.walk is None
            assert len(r.top_logprobs) == tree.size
            for (got_t, got_lp), (exp_t, exp_lp) in zip(r.top_logprobs, want_top):
                assert list(got_t) == exp_t
                assert got_lp == pytest.approx(exp_lp, abs=1e-4)
            # take the longest root path on even steps (plenty of accepted nodes), the target's on odd
            path = list(follow_target(tree, r.target_tokens).accepted_nodes)
            if step % 2 == 0:
                path = max((tree.path_to(i) for i in range(tree.size)), key=len)
            ref.commit(path)
            commit = CommitSpec(L, tuple(path))
            L, root = L + len(path), r.target_tokens[path[-1]]
        # the last commit goes through the explicit Commit call
        assert client.commit(sid, commit.committed_length, commit.accepted_nodes) == L
        tree = random_tree(rng, root, VOCAB, size=6)
        (r,) = client.verify([VerifyItem(sid, L, tree)]).results
        assert list(r.target_tokens) == ref.verify(tree)[0]
        assert client.release(sid) is True
        assert client.release(sid) is False
        (r,) = client.verify([VerifyItem(sid, L, tree)]).results
        assert r.error.code == grpc.StatusCode.NOT_FOUND and sid in r.error.message
        with pytest.raises(grpc.RpcError) as e:
            client.commit(sid, L, [0])
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        ref.close()


@pytest.mark.parametrize("s, flat", [(Sampling(temperature=0.9, top_k=50, top_p=0.95, seed=11), False),
                                     (Sampling(temperature=1.0, seed=12), True)])
def test_sampled_targets_and_multi_draft_walk_match_runtime(client, reference, fresh_id, s, flat):
    rng = random.Random(5)
    prompt = [rng.randrange(1, VOCAB) for _ in range(6)]
    sid = fresh_id()
    ref = reference.sequence(prompt, s)
    try:
        L, root = client.prefill(sid, prompt, s)
        assert root == ref.first
        commit = None
        walks = 0
        for _ in range(4):
            tree = with_drafts(rng, random_tree(rng, root, VOCAB, size=rng.randint(2, 10)), VOCAB, flat)
            (r,) = client.verify([VerifyItem(sid, L, tree, commit=commit)]).results
            want_tokens, want_walk, _ = ref.verify(tree)
            assert list(r.target_tokens) == want_tokens
            assert r.walk == want_walk
            walks += len(r.walk.accepted_nodes) > 1
            path = r.walk.accepted_nodes
            ref.commit(path)
            commit = CommitSpec(L, tuple(path))
            L, root = L + len(path), r.walk.bonus
        if flat:  # the walk went down the tree, not only to the residual draw
            assert walks >= 2
        # a tree without drafts gets target samples only
        tree = random_tree(rng, root, VOCAB, size=5)
        (r,) = client.verify([VerifyItem(sid, L, tree, commit=commit)]).results
        assert r.walk is None and list(r.target_tokens) == ref.verify(tree)[0]
    finally:
        ref.close()


def test_prefill_is_idempotent(client, fresh_id):
    sid = fresh_id()
    s = Sampling(temperature=0.7, seed=3)
    first = client.prefill(sid, [4, 5, 6], s)
    assert client.prefill(sid, [4, 5, 6], s) == first
    # still the same answer after the sequence has moved on
    L, root = first
    client.verify([VerifyItem(sid, L, TokenTree.chain([root, 9]))])
    client.commit(sid, L, [0, 1])
    assert client.prefill(sid, [4, 5, 6], s) == first
    for prompt, other in [([4, 5, 7], s), ([4, 5, 6], Sampling())]:
        with pytest.raises(grpc.RpcError) as e:
            client.prefill(sid, prompt, other)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert client.release(sid)
    assert client.prefill(sid, [4, 5, 7]) [0] == 3
