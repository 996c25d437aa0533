"""Checkpoints of the architectures with blocks of their own served by a real verifier process: FalconH1
(parallel Mamba2 + attention blocks, folded multipliers) and Zamba2 (shared-attention blocks that read
the token embeddings, folded adapters). The service needs nothing of the architecture, so its greedy
answers, with commits piggy-backed on the next verify, equal the model runtime's driven directly."""
from __future__ import annotations

import random

import pytest

from tests.models.hf_zoo import VOCAB, make_model
from tests.verifier.harness import MAX_SEQUENCES, MAX_TREE_NODES, VerifierProcess
from tests.verifier.reference import Reference
from tests.verifier.trees import random_tree
from treeserve.acceptance import follow_target
from verifier_service.client import CommitSpec, VerifierClient, VerifyItem


@pytest.fixture(scope="module", params=["falcon_h1", "zamba2"])
def served(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    make_model(arch).save_pretrained(path)
    proc = VerifierProcess(path)
    try:
        yield arch, path, proc
    finally:
        proc.stop()


def test_round_trips_match_runtime(served):
    arch, path, proc = served
    reference = Reference(path, max_slots=MAX_SEQUENCES)
    rng = random.Random(21)
    with VerifierClient(proc.address, timeout=60) as client:
        for n, sid in enumerate((f"{arch}-a", f"{arch}-b")):
            prompt = [rng.randrange(1, VOCAB) for _ in range(7 + 5 * n)]
            ref = reference.sequence(prompt)
            try:
                L, root = client.prefill(sid, prompt)
                assert (L, root) == (len(prompt), ref.first)
                commit = None
                for step in range(4):
                    tree = random_tree(rng, root, VOCAB, size=rng.randint(1, MAX_TREE_NODES))
                    (r,) = client.verify([VerifyItem(sid, L, tree, commit=commit)]).results
                    assert r.ok and r.committed_length == L
                    assert list(r.target_tokens) == ref.verify(tree)[0]
                    path_nodes = list(follow_target(tree, r.target_tokens).accepted_nodes)
                    if step % 2 == 0:  # the longest root path: several accepted nodes
                        path_nodes = max((tree.path_to(i) for i in range(tree.size)), key=len)
                    ref.commit(path_nodes)
                    commit = CommitSpec(L, tuple(path_nodes))
                    L, root = L + len(path_nodes), r.target_tokens[path_nodes[-1]]
                assert client.commit(sid, commit.committed_length, commit.accepted_nodes) == L
                assert client.release(sid) is True
            finally:
                ref.close()
