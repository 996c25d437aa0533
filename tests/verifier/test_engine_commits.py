"""Piggy-backed commits in the engine, in-process: applied by the same runtime call as the verify
that carries them (inside its forward where the model runs bucketed programs), and isolated when
that call fails."""
from __future__ import annotations

import random

import pytest

from tests.verifier.trees import random_tree
from treeserve.sampling import Sampling
from verifier_service.engine import Engine, VerifyWork
from verifier_service.limits import Limits

VOCAB = 320


@pytest.fixture()
def engines(tiny_pair):
    """(plain, bucketed): engines over two copies of the tiny target, the second running the static
    programs CUDA graphs replay (eagerly, on CPU), where commits ride in the verify's scans."""
    from models import HybridLM

    limits = Limits(max_sequences=4, max_tree_nodes=16, max_sequence_length=160)
    made = []
    for graphs in (False, True):
        lm = HybridLM.from_pretrained(tiny_pair[0], max_slots=4, max_len=160)
        if graphs:
            lm.use_graphs(capture=False).capture_all()
        made.append(Engine(lm, limits))
    return made


def _rounds(engine: Engine, n_seqs: int, n_rounds: int, seed: int, fail=None):
    """Every sequence steps n_rounds times, each step a tree with the previous step's accepted path
    (its greedy walk) committed; returns every step's target tokens by sequence."""
    rng = random.Random(seed)
    seqs = {}
    for k in range(n_seqs):
        L, root = engine.prefill(f"s{k}", tuple(rng.randrange(1, VOCAB) for _ in range(4 + k)), Sampling())
        seqs[f"s{k}"] = [L, root, None]
    out = {sid: [] for sid in seqs}
    for r in range(n_rounds):
        works = []
        for sid, (L, root, commit) in seqs.items():
            works.append(VerifyWork(sid, L, random_tree(rng, root, VOCAB, size=rng.choice([1, 3, 6, 8, 12])), commit))
        if fail is not None:
            fail(r)
        report = engine.verify(works)
        for w, o in zip(works, report.outputs):
            assert o.error is None, o.error
            tokens = o.result.target_tokens
            out[w.sequence_id].append(tokens)
            path, node = [0], 0
            while True:  # the greedy walk: the child whose token is the target's next
                kids = [c for c in w.tree.children(node) if w.tree.tokens[c] == tokens[node]]
                if not kids:
                    break
                node = kids[0]
                path.append(node)
            L = o.committed_length
            seqs[w.sequence_id] = [L + len(path), tokens[node], (L, tuple(path))]
            assert o.committed_length == w.committed_length
        assert report.commits == (len(works) if r else 0)
    return out


def test_commits_riding_in_the_verify_give_the_plain_answers(engines):
    plain, bucketed = engines
    taken, real = [], bucketed.lm.graphs.gather_commit
    bucketed.lm.graphs.gather_commit = lambda *a: taken.append(real(*a)) or taken[-1]
    assert _rounds(plain, 3, 6, seed=1) == _rounds(bucketed, 3, 6, seed=1)
    assert taken and any(t is not None for t in taken), "no commit rode in a verify"


def test_a_failed_batch_applies_its_commits_and_retries_each_tree(engines, monkeypatch):
    """The batched runtime call fails in round 2 (before it changes anything) and in round 4 (after
    its commits were applied): either way every commit is applied once and every tree is answered,
    as without the failures."""
    plain, bucketed = engines
    want = _rounds(plain, 3, 6, seed=2)
    lm = bucketed.lm
    real_verify = lm.verify

    def fail(r):
        def verify(slots, trees, *a, commits=(), **k):
            if len(slots) > 1:  # the batch: fails; the one-by-one retries go through
                if r == 4:
                    lm.commit(list(commits))
                raise RuntimeError("injected failure")
            return real_verify(slots, trees, *a, commits=commits, **k)

        monkeypatch.setattr(lm, "verify", verify if r in (2, 4) else real_verify)

    assert _rounds(bucketed, 3, 6, seed=2, fail=fail) == want
