"""A request that leaves the tree shape to the server drafts in two regimes: the draft model's
trees and n-gram trees (`AdaptivePolicy.also`, asked of the drafter per tree). One engine (no Ray)
against a verifier and a drafter served from this process: the greedy output is plain decoding's
token for token while the engine asks the drafter for trees of both shapes; a request that named
its shape drafts only that one."""
from __future__ import annotations

import pytest

from orchestrator.engine import Engine, EngineConfig, Hooks
from orchestrator.request import LENGTH, RequestSpec, Speculation
from tests.orchestrator import stack
from tests.orchestrator.inproc import LocalVerifier
from tests.orchestrator.test_engine_recovery import Events
from treeserve.sampling import Sampling
from treeserve.v1 import treeserve_pb2 as pb

FRONT = "front"
N = 48


@pytest.fixture(scope="module")
def verifier(tiny_pair):
    v = LocalVerifier(tiny_pair[0], max_sequences=4, max_tree_nodes=16, max_sequence_length=256)
    yield v
    v.stop()


class Served:
    """The drafter's address, the proposers its trees came from (by name, in request order), and
    the drafter itself."""

    def __init__(self, address: str, proposed: list[str], drafter):
        self.address, self.proposed, self.drafter = address, proposed, drafter


@pytest.fixture(scope="module")
def drafter(tiny_pair):
    from drafter_service.draftlm import DraftModel
    from drafter_service.engine import Drafter, Options
    from drafter_service.servicer import serve

    proposed: list[str] = []

    class Recording(Drafter):
        def _proposer_for(self, seq, shape):
            proposer = super()._proposer_for(seq, shape)
            proposed.append(proposer.name)
            return proposer

    model = DraftModel.load(str(tiny_pair[1]), device="cpu", max_slots=8, max_len=256)
    d = Recording(model, Options("dynamic", 8, 4, False), ahead=None)
    server = serve(d, "127.0.0.1:0")
    yield Served(f"127.0.0.1:{server.port}", proposed, d)
    server.stop()


@pytest.fixture(scope="module")
def prompt(tiny_pair):
    from transformers import AutoTokenizer

    return tuple(AutoTokenizer.from_pretrained(tiny_pair[0])(stack.PROMPT_TEXT * 2)["input_ids"])


def generate(verifier, drafter, specs) -> tuple[dict, dict]:
    """Run `specs` one after another on a fresh engine: (request id -> tokens, the engine's stats)."""
    engine = Engine(EngineConfig(verifier=verifier.address, drafter=drafter.address, name="shapes",
                                 connect_timeout_s=30),
                    Hooks()).start()
    engine.eos = frozenset()  # every request runs to max_new_tokens
    try:
        events = Events(engine)
        for s in specs:
            assert engine.submit(s) is None
            events.pump_until(lambda: events.ended(s.request_id), 240, s.request_id)
            last = events.by_request[s.request_id][-1]
            assert last.error is None and last.finish == LENGTH, last
        return {s.request_id: events.tokens(s.request_id) for s in specs}, engine.stats()
    finally:
        engine.stop()


def shapes_drafted(stats: dict) -> set[str]:
    return {entry["shape"] for entry in stats["acceptance"] if entry["tau"]}


def test_a_default_request_drafts_both_shapes_and_equals_plain_decoding(verifier, drafter, prompt):
    specs = [RequestSpec(f"default-{i}", prompt, Sampling(), N, Speculation(), FRONT) for i in range(2)]
    plain = RequestSpec("plain", prompt, Sampling(), N, Speculation(mode="off"), FRONT)
    drafter.proposed.clear()
    out, stats = generate(verifier, drafter, [plain, *specs])
    assert set(drafter.proposed) == {"dynamic", "ngram"}  # what the drafter was asked for, per tree
    assert len(out["plain"]) == N
    for s in specs:
        assert out[s.request_id] == out["plain"]
    assert shapes_drafted(stats) == {"TREE_SHAPE_UNSPECIFIED", "TREE_SHAPE_NGRAM"}, stats["acceptance"]
    kinds = [[r["shape"] for r in kind["drafted"]] for kind in stats["step_overhead_ms"]]
    assert ["TREE_SHAPE_NGRAM"] in kinds and ["TREE_SHAPE_UNSPECIFIED"] in kinds  # priced apart


def test_a_request_that_named_its_shape_drafts_only_that(verifier, drafter, prompt):
    named = Speculation(shape=pb.TREE_SHAPE_DYNAMIC)
    drafter.proposed.clear()
    out, stats = generate(verifier, drafter, [RequestSpec("named", prompt, Sampling(), N, named, FRONT)])
    assert set(drafter.proposed) == {"dynamic"}
    assert len(out["named"]) == N
    assert shapes_drafted(stats) == {"TREE_SHAPE_DYNAMIC"}, stats["acceptance"]


def test_a_drafter_that_predates_per_tree_shapes_gets_trees_of_the_sequences_shape(verifier, drafter, prompt):
    """Its Stats do not say it honours `DraftRequest.shape` (it would draft its own shape whatever
    the request named): a default request then drafts in its own regime only, priced as such."""
    from drafter_service.servicer import DrafterServicer
    from treeserve.server import Server
    from treeserve.v1 import treeserve_pb2_grpc as pbg

    class Older(DrafterServicer):
        def Stats(self, request, context):
            stats = super().Stats(request, context)
            stats.per_tree_shapes = False
            return stats

    server = Server("127.0.0.1:0")
    server.add(pbg.add_DrafterServicer_to_server, Older(drafter.drafter, max_streams=4), "Drafter").start()
    try:
        drafter.proposed.clear()
        older = Served(f"127.0.0.1:{server.port}", drafter.proposed, drafter.drafter)
        out, stats = generate(verifier, older, [RequestSpec("old", prompt, Sampling(), N, Speculation(), FRONT)])
        assert len(out["old"]) == N
        assert set(drafter.proposed) == {"dynamic"}
        assert shapes_drafted(stats) == {"TREE_SHAPE_UNSPECIFIED"}, stats["acceptance"]
    finally:
        server.stop(grace=0)


def test_a_default_request_on_an_ngram_drafter_learns_its_trees_once(verifier, prompt):
    """A drafter without a model drafts n-gram trees by default: the n-gram regime beside them
    would be the same trees learnt twice (and probed between). Its Stats name its default shape,
    and the engine keeps default requests to their own regime."""
    from drafter_service.engine import Drafter
    from drafter_service.servicer import serve

    server = serve(Drafter(None), "127.0.0.1:0")
    try:
        plain = RequestSpec("plain", prompt, Sampling(), N, Speculation(mode="off"), FRONT)
        default = RequestSpec("ngram", prompt, Sampling(), N, Speculation(), FRONT)
        out, stats = generate(verifier, Served(f"127.0.0.1:{server.port}", [], None), [plain, default])
        assert out["ngram"] == out["plain"]
        assert shapes_drafted(stats) == {"TREE_SHAPE_UNSPECIFIED"}, stats["acceptance"]
    finally:
        server.stop()


def test_a_pinned_ngram_request_teaches_the_engine_every_smaller_budget(verifier, drafter, prompt):
    """Each n-gram tree of 16 nodes also says what trees of 2, 4 and 8 would have emitted on the
    same text (their trees are its first nodes), so the engine's table for the regime holds them
    all, none above the larger budgets' (a default request beside it compares budgets measured
    on the same steps)."""
    pinned = Speculation(shape=pb.TREE_SHAPE_NGRAM, node_budget=16, adaptive=False)
    out, stats = generate(verifier, drafter, [RequestSpec("pinned", prompt, Sampling(), N, pinned, FRONT)])
    assert len(out["pinned"]) == N
    [ngram] = [a["tau"] for a in stats["acceptance"] if a["shape"] == "TREE_SHAPE_NGRAM" and a["tau"]]
    assert set(ngram) == {2, 4, 8, 16}, ngram
    assert ngram[2] <= ngram[4] <= ngram[8] <= ngram[16]
