"""Comparing drafted trees from two drafters that should agree."""


def assert_same_replies(got, want, prob_tol: float = 1e-6) -> None:
    """Same tree shapes, tokens and draft-ahead hits, reply by reply; reported draft distributions
    list the same tokens with probabilities equal up to `prob_tol` (a softmax over the same logits
    summed in another order, or a forward padded to a bucket, may round the last bit differently)."""
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert (a.tree.tokens, a.tree.parents) == (b.tree.tokens, b.tree.parents), f"reply {step}"
        assert a.from_draft_ahead == b.from_draft_ahead, f"reply {step}"
        assert (a.tree.draft is None) == (b.tree.draft is None), f"reply {step}"
        for node, (da, db) in enumerate(zip(a.tree.draft or (), b.tree.draft or ())):
            assert (da is None) == (db is None), f"reply {step} node {node}"
            if da is not None:
                assert da.tokens == db.tokens and da.residual == db.residual, f"reply {step} node {node}"
                assert max(abs(x - y) for x, y in zip(da.probs, db.probs)) <= prob_tol, f"reply {step} node {node}"
