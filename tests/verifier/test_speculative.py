"""A greedy speculative loop through the service emits exactly plain greedy decoding."""
from __future__ import annotations

import random

from tests.verifier.trees import random_tree
from treeserve.acceptance import follow_target
from verifier_service.client import CommitSpec, VerifyItem

VOCAB = 320
NEW_TOKENS = 40


def test_greedy_speculation_equals_greedy_decoding(client, reference, fresh_id):
    rng = random.Random(9)
    prompt = [rng.randrange(1, VOCAB) for _ in range(10)]
    want = reference.greedy(prompt, NEW_TOKENS)
    sid = fresh_id()
    L, root = client.prefill(sid, prompt)
    out, commit, steps, multi = [root], None, 0, 0
    while len(out) < NEW_TOKENS:
        # the next few greedy tokens as a hint: the tree contains the right continuation sometimes
        hint = want[len(out) : len(out) + rng.randint(0, 6)]
        tree = random_tree(rng, root, VOCAB, size=rng.randint(1, 14), hint=hint)
        (r,) = client.verify([VerifyItem(sid, L, tree, commit=commit)]).results
        assert r.ok, r.error
        outcome = follow_target(tree, r.target_tokens)
        out += outcome.emitted(tree)
        multi += len(outcome.accepted_nodes) > 1
        commit = CommitSpec(L, outcome.accepted_nodes)
        L, root = L + len(outcome.accepted_nodes), outcome.bonus
        steps += 1
    assert out[:NEW_TOKENS] == want
    assert client.commit(sid, commit.committed_length, commit.accepted_nodes) == len(prompt) + len(out) - 1
    assert multi >= 3 and steps < NEW_TOKENS  # speculation did accept drafted tokens
