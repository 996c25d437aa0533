"""Request rules of the drafter engine: errors carry the right code and change nothing; other
sequences are unaffected; retries and resets behave."""
import grpc
import pytest

from drafter_service.engine import DraftCall, Drafter, Options
from treeserve.acceptance import Outcome
from treeserve.errors import ServeError
from treeserve.sampling import Sampling


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(ServeError) as info:
        fn()
    return info.value.code


@pytest.fixture
def drafter(draft_model):
    d = Drafter(draft_model, Options("dynamic", 8, 3, True), max_sequences=3)
    yield d
    d.close()


def test_bad_requests_get_codes_and_change_nothing(drafter, prompt):
    L = len(prompt)
    drafter.start("a", prompt)
    first = drafter.draft(DraftCall("a", L, (), 5))
    tree = first.tree
    kid = tree.children(0)[0]
    good = DraftCall("a", L + 2, (5, tree.tokens[kid]), 9, Outcome((0, kid), 9))
    bad = {
        grpc.StatusCode.NOT_FOUND: [DraftCall("nobody", L, (), 5)],
        grpc.StatusCode.FAILED_PRECONDITION: [DraftCall("a", L + 3, good.appended, 9, good.outcome),
                                              DraftCall("a", L - 1, (), 5)],
        grpc.StatusCode.INVALID_ARGUMENT: [
            DraftCall("a", L + 2, good.appended, 9, Outcome((0, tree.size + 3), 9)),  # not a path
            DraftCall("a", L + 2, good.appended, 9, Outcome((1, kid), 9)),  # does not start at the root
            DraftCall("a", L + 2, good.appended, 8, good.outcome),  # bonus differs from the root
            DraftCall("a", L + 1, (5,), 9, Outcome((0, kid), 9)),  # path tokens differ from appended
            DraftCall("a", L + 2, good.appended, 10_000, None),  # root outside the vocabulary
            DraftCall("a", L + 2, good.appended, 9, None, node_budget=-1),
        ],
    }
    for code, calls in bad.items():
        for call in calls:
            assert code_of(lambda: drafter.draft(call)) == code, call
    assert drafter.draft(good).tree.tokens[0] == 9  # still in step after every refusal


def test_other_sequences_unaffected_and_retry_is_idempotent(draft_model, drafter, prompt):
    L = len(prompt)
    solo = Drafter(draft_model, Options("dynamic", 8, 3, True))
    try:
        solo.start("b", prompt[:-2])
        expect = solo.draft(DraftCall("b", L - 2, (), 7)).tree
    finally:
        solo.close()
    drafter.start("a", prompt)
    drafter.start("b", prompt[:-2])
    drafter.draft(DraftCall("a", L, (), 5))
    with pytest.raises(ServeError):
        drafter.draft(DraftCall("a", L + 7, (1, 2), 5))
    got = drafter.draft(DraftCall("b", L - 2, (), 7))
    assert got.tree == expect
    again = drafter.draft(DraftCall("b", L - 2, (), 7))  # a retried request: same answer, no advance
    assert again is got and drafter._seqs["b"].state.length == L - 2


def test_start_resets_limits_and_end(drafter, prompt):
    assert drafter.start("a", prompt) == len(prompt)
    drafter.draft(DraftCall("a", len(prompt), (), 5))
    assert drafter.start("a", prompt[:4], Sampling(0.7, 0, 0, 1)) == 4  # resync: a fresh state
    assert drafter.draft(DraftCall("a", 4, (), 5)).tree.draft is not None
    drafter.start("b", prompt)
    drafter.start("c", prompt)
    assert code_of(lambda: drafter.start("d", prompt)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert drafter.end("c") and not drafter.end("c")
    drafter.start("d", prompt)
    assert code_of(lambda: drafter.start("", prompt)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: drafter.start("e", [1, -3])) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: drafter.start("e", prompt, Sampling(-1.0))) == grpc.StatusCode.INVALID_ARGUMENT


def test_ngram_only_drafter_refuses_model_shapes():
    d = Drafter(None)
    assert d.defaults.shape == "ngram"
    assert code_of(lambda: d.options(shape="dynamic")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: d.options(node_budget=-2)) == grpc.StatusCode.INVALID_ARGUMENT
    assert d.options(node_budget=10_000).node_budget == d.max_nodes
    d.close()


def test_sequence_past_the_draft_models_length_is_refused_until_restarted(draft_model, prompt):
    d = Drafter(draft_model, Options("dynamic", 8, 3, False), ahead=None)
    limit = draft_model.max_len
    try:
        d.start("long", prompt)
        tree = d.draft(DraftCall("long", len(prompt), (), 5)).tree
        assert tree.size <= 8
        filler = tuple([7] * (limit - len(prompt) - 3))
        near = d.draft(DraftCall("long", limit - 3, filler, 6))
        assert near.tree.size <= 3 and max(near.tree.depths()) <= 2  # cut to the room left
        over = DraftCall("long", limit + 1, (6, 1, 2, 3), 4)
        assert code_of(lambda: d.draft(over)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        ok = DraftCall("long", limit - 2, (6,), 4)
        assert code_of(lambda: d.draft(ok)) == grpc.StatusCode.FAILED_PRECONDITION  # must resync
        d.start("long", prompt)
        assert d.draft(DraftCall("long", len(prompt), (), 5)).tree == tree
    finally:
        d.close()
