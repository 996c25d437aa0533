"""Many clients at once: each sequence gets exactly the answers it gets alone, and forwards are shared."""
from __future__ import annotations

import random
import threading

from tests.verifier.trees import random_tree
from treeserve.acceptance import follow_target
from verifier_service.client import CommitSpec, VerifierClient, VerifyItem

VOCAB = 320
CLIENTS = 8
STEPS = 5


def test_concurrent_sequences_match_solo_runs(verifier, reference, fresh_id):
    ids = [fresh_id("conc") for _ in range(CLIENTS)]
    start = threading.Barrier(CLIENTS)
    logs: dict[int, dict] = {}
    errors: list[BaseException] = []

    def run(k: int) -> None:
        rng = random.Random(100 + k)
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 14))]
        log = logs[k] = {"prompt": prompt, "trees": [], "targets": [], "paths": [], "batch": []}
        try:
            with VerifierClient(verifier.address, timeout=120) as c:
                L, root = c.prefill(ids[k], prompt)
                log["first"] = root
                start.wait(timeout=60)
                commit = None
                for _ in range(STEPS):
                    tree = random_tree(rng, root, VOCAB, size=rng.randint(1, 16))
                    reply = c.verify([VerifyItem(ids[k], L, tree, commit=commit)])
                    (r,) = reply.results
                    assert r.ok, r.error
                    out = follow_target(tree, r.target_tokens)
                    # sometimes commit a longer branch than the target's, to move states apart
                    path = out.accepted_nodes if rng.random() < 0.5 else tuple(tree.path_to(tree.size - 1))
                    log["trees"].append(tree)
                    log["targets"].append(list(r.target_tokens))
                    log["paths"].append(path)
                    log["batch"].append(reply.batch_sequences)
                    commit = CommitSpec(L, path)
                    L, root = L + len(path), r.target_tokens[path[-1]]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for k in range(CLIENTS):
        log = logs[k]
        ref = reference.sequence(log["prompt"])
        try:
            assert ref.first == log["first"]
            for step, (tree, targets, path) in enumerate(zip(log["trees"], log["targets"], log["paths"])):
                assert ref.verify(tree)[0] == targets, (k, step)
                ref.commit(path)
        finally:
            ref.close()
    widest = max(b for k in range(CLIENTS) for b in logs[k]["batch"])
    assert widest > 1, "no forward pass was shared"
