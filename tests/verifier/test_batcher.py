"""The model thread in-process: packing, splitting, cancelled callers, the idle sweep."""
from __future__ import annotations

import time

import grpc
import pytest

from treeserve.sampling import Sampling
from treeserve.tree import TokenTree
from verifier_service.batcher import Batcher
from verifier_service.engine import Engine, VerifyWork
from verifier_service.limits import Limits


@pytest.fixture()
def make(tiny_pair):
    """make(**limits) -> (engine, batcher); the batcher is not started and is stopped afterwards."""
    from models import HybridLM

    made = []

    def build(**kw):
        limits = Limits(**{"max_sequences": 8, "max_tree_nodes": 16, "max_sequence_length": 128, **kw})
        lm = HybridLM.from_pretrained(tiny_pair[0], max_slots=limits.max_sequences, max_len=limits.max_sequence_length)
        engine = Engine(lm, limits)
        batcher = Batcher(engine, limits)
        made.append(batcher)
        return engine, batcher

    yield build
    for b in made:
        b.stop()


def _prefill(engine, n, prefix="s"):
    out = []
    for k in range(n):
        sid = f"{prefix}{k}"
        L, root = engine.prefill(sid, tuple(range(1 + k, 6 + k)), Sampling())
        out.append((sid, L, root))
    return out


def test_queued_items_share_one_forward_and_match_solo_answers(make):
    engine, batcher = make()
    seqs = _prefill(engine, 5)
    trees = [TokenTree.chain([root] + list(range(10 + k, 10 + 2 * k))) for k, (_, _, root) in enumerate(seqs)]
    # two requests (as from two RPCs) queued while the model thread is not running yet
    f1 = batcher.verify([VerifyWork(sid, L, t) for (sid, L, _), t in zip(seqs[:2], trees[:2])])
    f2 = batcher.verify([VerifyWork(sid, L, t) for (sid, L, _), t in zip(seqs[2:], trees[2:])])
    batcher.start()
    r1, r2 = f1.result(30), f2.result(30)
    assert engine.forward_passes == 1
    assert r1.batch_sequences == r2.batch_sequences == 5
    assert r1.forward_ms > 0 and r1.forward_ms == r2.forward_ms
    batched = [o.result.target_tokens for o in r1.outputs + r2.outputs]
    solo = [engine.verify([VerifyWork(sid, L, t)]).outputs[0].result.target_tokens for (sid, L, _), t in zip(seqs, trees)]
    assert batched == solo


def test_limits_split_batches(make):
    engine, batcher = make(max_batch=2)
    seqs = _prefill(engine, 5)
    fut = batcher.verify([VerifyWork(sid, L, TokenTree.single(root)) for sid, L, root in seqs])
    batcher.start()
    reply = fut.result(30)
    assert all(o.error is None for o in reply.outputs)
    assert engine.forward_passes == 3 and reply.batch_sequences == 2

    engine, batcher = make(max_batch_nodes=20)
    seqs = _prefill(engine, 3)
    fut = batcher.verify([VerifyWork(sid, L, TokenTree.chain([root] + [7] * 9)) for sid, L, root in seqs])
    batcher.start()
    assert all(o.error is None for o in fut.result(30).outputs)
    assert engine.forward_passes == 2  # 10 + 10 nodes, then 10


def test_one_sequence_twice_goes_to_two_forwards(make):
    engine, batcher = make()
    ((sid, L, root),) = _prefill(engine, 1)
    tree = TokenTree.chain([root, 4, 5])
    a = batcher.verify([VerifyWork(sid, L, tree)])
    b = batcher.verify([VerifyWork(sid, L + 2, TokenTree.single(9), commit=(L, (0, 1)))])
    batcher.start()
    assert a.result(30).outputs[0].error is None
    out = b.result(30).outputs[0]
    assert out.error is None and out.committed_length == L + 2
    assert engine.forward_passes == 2


def test_items_of_departed_callers_never_reach_the_model(make):
    engine, batcher = make()
    ((sid, L, root),) = _prefill(engine, 1)
    gone = batcher.verify([VerifyWork(sid, L, TokenTree.single(root))], alive=lambda: False)
    op = batcher.submit(engine.release, sid, alive=lambda: False)
    batcher.start()
    assert gone.result(30).outputs[0].error.code == grpc.StatusCode.CANCELLED
    with pytest.raises(Exception) as e:
        op.result(30)
    assert e.value.code == grpc.StatusCode.CANCELLED
    assert engine.forward_passes == 0 and sid in engine.table


def test_idle_sequences_are_swept(make):
    engine, batcher = make(idle_timeout_s=0.3)
    _prefill(engine, 2)
    slots_before = len(engine.lm.pool.in_use())
    batcher.start()
    # keep one sequence busy, let the other go idle
    deadline = time.monotonic() + 10
    while "s1" in engine.table and time.monotonic() < deadline:
        batcher.submit(engine.commit, "s0", 5, (0,)).exception(10)  # refused (no tree), but a touch
        time.sleep(0.05)
    assert "s1" not in engine.table and "s0" in engine.table
    assert len(engine.lm.pool.in_use()) == slots_before - 1


def test_stop_refuses_new_work(make):
    engine, batcher = make()
    batcher.start()
    batcher.stop()
    fut = batcher.submit(len, ())
    assert fut.exception(5).code == grpc.StatusCode.UNAVAILABLE


def test_bearer_token_is_required(tiny_pair):
    from models import HybridLM
    from verifier_service.client import VerifierClient
    from verifier_service.servicer import ModelInfo, VerifierServer

    lm = HybridLM.from_pretrained(tiny_pair[0], max_slots=2, max_len=64)
    srv = VerifierServer(lm, Limits(max_sequences=2, max_tree_nodes=8, max_sequence_length=64), "127.0.0.1:0",
                         ModelInfo("target", "cpu", (0,)), auth_token="s3cret")
    try:
        address = f"127.0.0.1:{srv.port}"
        with VerifierClient(address, timeout=30) as anonymous:
            with pytest.raises(grpc.RpcError) as e:
                anonymous.stats()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with VerifierClient(address, auth_token="s3cret", timeout=30) as c:
            assert c.prefill("a", [1, 2, 3])[0] == 3
            assert c.stats().active_sequences == 1
    finally:
        srv.stop()


def test_window_waits_only_for_expected_company(make):
    engine, batcher = make(batch_window_ms=1500)
    seqs = _prefill(engine, 3)
    (a, La, ra), (b, Lb, rb), _ = seqs
    batcher.start()
    # s0 alone, with other live sequences idle: nobody is expected, no wait
    t = time.monotonic()
    for _ in range(3):
        assert batcher.verify([VerifyWork(a, La, TokenTree.single(ra))]).result(30).batch_sequences == 1
    assert time.monotonic() - t < 1.0
    # s0 and s1 shared the last forward; s0 comes back first and waits for s1, which follows shortly
    batcher.verify([VerifyWork(a, La, TokenTree.single(ra)), VerifyWork(b, Lb, TokenTree.single(rb))]).result(30)
    fa = batcher.verify([VerifyWork(a, La, TokenTree.single(ra))])
    time.sleep(0.2)
    fb = batcher.verify([VerifyWork(b, Lb, TokenTree.single(rb))])
    assert fa.result(30).batch_sequences == fb.result(30).batch_sequences == 2
