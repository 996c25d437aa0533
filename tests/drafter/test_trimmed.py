"""Drafting over a trimmed vocabulary: the head's columns map back to token ids everywhere, the
drafted tokens and reported distributions stay inside the kept set, draws follow exactly the
reported q, and speculative output is still the target's own."""
import argparse
import itertools
import random

import pytest
import torch
from scipy.stats import chi2

from drafter_service.ahead import AheadConfig
from drafter_service.children import ChildPicker, PickRule
from drafter_service.draftlm import DraftModel
from drafter_service.engine import DraftCall, Drafter, Options
from drafter_service.head import DraftHead
from drafter_service.vocab import TrimmedVocab
from tests.drafter.compare import assert_same_replies
from tests.drafter.test_ahead import drive
from tests.verifier.reference import greedy as greedy_reference
from treeserve.acceptance import Outcome, follow_target
from treeserve.sampling import Sampling

VOCAB = 320
GREEDY = Sampling()
HOT = Sampling(temperature=0.9, top_k=20, seed=3)
SHAPES = ["chain", "static", "dynamic"]


def kept_ids(n: int, seed: int = 0, must=()) -> tuple[int, ...]:
    """n ids (end-of-text 0 and `must` among them) in a seeded order, standing in for frequency order."""
    rest = [t for t in range(VOCAB) if t != 0 and t not in set(must)]
    random.Random(seed).shuffle(rest)
    ids = [0, *sorted(set(must) - {0})]
    return tuple(ids + rest[: max(0, n - len(ids))])


def trimmed_model(tiny_pair, ids, which: int = 1, **kw) -> DraftModel:
    return DraftModel.load(str(tiny_pair[which]), max_slots=48, max_len=1024,
                           trim=save(tiny_pair, ids), **kw)


def save(tiny_pair, ids) -> str:
    path = tiny_pair[1].parent / f"kept-{len(ids)}-{hash(ids) & 0xffff:x}.json"
    TrimmedVocab(tuple(ids), VOCAB, (0,)).save(path)
    return str(path)


def test_head_columns_and_logits(draft_model):
    ids = kept_ids(40, seed=1)
    head = DraftHead(draft_model.lm, TrimmedVocab(ids, VOCAB, (0,)))
    assert head.trimmed and head.size == 40 and head.vocab_size == VOCAB
    hidden = torch.randn(5, draft_model.lm.config.d_model, generator=torch.Generator().manual_seed(0))
    full = draft_model.head.logits(hidden)
    assert full.shape == (5, VOCAB) and not draft_model.head.trimmed
    torch.testing.assert_close(head.logits(hidden), full[:, list(ids)], rtol=0, atol=1e-6)
    torch.testing.assert_close(head.logits(hidden, [3, 1]), full[[3, 1]][:, list(ids)], rtol=0, atol=1e-6)
    assert head.logits(hidden, []) is None
    cols = torch.arange(40)
    assert head.to_tokens(cols).tolist() == list(ids)
    assert head.columns_of(torch.tensor(ids)).tolist() == list(range(40))
    outside = [t for t in range(VOCAB) if t not in set(ids)][:3]
    assert head.columns_of(torch.tensor(outside + [-1, VOCAB])).tolist() == [-1] * 5
    limited = DraftHead(draft_model.lm, TrimmedVocab(ids, VOCAB, (0,)), vocab_limit=100)
    assert limited.vocab_size == 100 and limited.to_tokens(torch.arange(limited.size)).tolist() == [t for t in ids if t < 100]
    prefix = DraftHead(draft_model.lm, None, vocab_limit=100)
    assert prefix.size == 100 and prefix.columns_of(torch.tensor([5, 99, 100])).tolist() == [5, 99, -1]


@pytest.mark.parametrize("shape", ["chain", "static"])
def test_trimmed_greedy_equals_full_when_the_kept_set_holds_the_drafted_tokens(tiny_pair, draft_model, prompt, shape):
    full, calls, _, _ = drive(draft_model, prompt, GREEDY, shape, None)
    drafted = {t for r in full for t in r.tree.tokens[1:]}
    ids = kept_ids(len(drafted) + 20, seed=2, must=drafted)
    trimmed = trimmed_model(tiny_pair, ids)
    assert trimmed.head.size < VOCAB // 2
    got, _, _, _ = drive(trimmed, prompt, GREEDY, shape, None, calls=calls)
    assert [r.tree for r in got] == [r.tree for r in full]
    # roots and appended tokens outside the kept set are consumed like any other token
    assert any(c.root not in set(ids) for c in calls)


@pytest.mark.parametrize("shape,sampling", [("static", GREEDY), ("dynamic", GREEDY), ("dynamic", HOT), ("fused", HOT)],
                         ids=["static-greedy", "dynamic-greedy", "dynamic-sampling", "fused-sampling"])
def test_every_token_in_frequency_order_drafts_exactly_like_the_full_head(tiny_pair, draft_model, prompt, shape,
                                                                           sampling):
    """A 'trimmed' set that keeps every id only reorders the head's columns: trees, draft
    distributions and draft-ahead hits must be exactly those of the untrimmed drafter."""
    permuted = trimmed_model(tiny_pair, kept_ids(VOCAB, seed=3))
    assert permuted.head.trimmed and permuted.head.size == VOCAB
    ahead = AheadConfig(trees=3, fanout=2)
    full, calls, probs_full, _ = drive(draft_model, prompt, sampling, shape, ahead)
    got, _, probs_perm, _ = drive(permuted, prompt, sampling, shape, ahead, calls=calls)
    assert_same_replies(got, full)
    ids = permuted.head.ids
    torch.testing.assert_close(probs_perm, probs_full[:, ids], rtol=0, atol=1e-7)


@pytest.mark.parametrize("sampling", [GREEDY, HOT], ids=["greedy", "sampling"])
@pytest.mark.parametrize("shape", SHAPES)
def test_drafted_tokens_and_reported_q_stay_in_the_kept_set(tiny_pair, prompt, shape, sampling):
    ids = kept_ids(30, seed=4)
    model = trimmed_model(tiny_pair, ids)
    replies, _, probs, _ = drive(model, prompt, sampling, shape, AheadConfig(trees=2, fanout=2))
    kept = set(ids)
    assert probs.shape[-1] == 30
    for r in replies:
        tree = r.tree.validate(VOCAB, 10)
        assert set(tree.tokens[1:]) <= kept
        for i, d in enumerate(tree.draft or ()):
            if d is None:
                continue
            assert set(d.tokens) <= kept and d.residual == 0.0 and abs(sum(d.probs) - 1.0) < 1e-5
            for c in tree.children(i):
                assert d.prob(tree.tokens[c], VOCAB) > 0.0


def test_reported_q_is_the_trimmed_transform(tiny_pair, prompt):
    """With sampling, each node's reported q is the target transform of the trimmed logits,
    renormalised over the kept tokens (and zero elsewhere)."""
    ids = kept_ids(60, seed=5)
    model = trimmed_model(tiny_pair, ids)
    d = Drafter(model, Options("dynamic", 12, 4, False), ahead=None)
    try:
        d.start("q", prompt, HOT)
        tree = d.draft(DraftCall("q", len(prompt), (), 9)).tree
        state = d._seqs["q"].state
        logits = state.logits(tree)  # (N, 60) over the kept columns
    finally:
        d.close()
    tokens, q = ChildPicker(HOT, PickRule.DRAWN, columns=model.head).draft_distribution(logits)
    assert set(tokens.flatten().tolist()) <= set(ids)
    for i, dist in enumerate(tree.draft):
        if dist is None:
            continue
        expect = {t: p for t, p in zip(tokens[i].tolist(), q[i].tolist()) if p > 0}
        listed = dict(zip(dist.tokens, dist.probs))
        # the tree's q came from the forward over the tree as it was at that level: equal up to rounding
        assert listed.keys() == expect.keys() and max(abs(listed[t] - expect[t]) for t in listed) < 1e-5


# ---- draws over a trimmed head follow the reported q exactly --------------------------------------
Q = [0.35, 0.25, 0.15, 0.12, 0.08, 0.05]
TOKENS = [11, 3, 250, 40, 7, 99]


def test_draws_follow_without_replacement_probabilities_of_the_reported_q(draft_model):
    """Tokens 7 and 99 are trimmed away: q is the rest of Q renormalised, and draw orders follow
    sampling without replacement from that q."""
    ids = (0, 300, 40, 11, 5, 250, 3, 17)
    head = DraftHead(draft_model.lm, TrimmedVocab(ids, VOCAB, (0,)))
    kept = {t: Q[TOKENS.index(t)] for t in TOKENS if t in ids}
    total = sum(kept.values())
    q = {t: p / total for t, p in kept.items()}
    row = torch.full((len(ids),), -float("inf"))
    for t, p in kept.items():
        row[ids.index(t)] = torch.log(torch.tensor(p))
    s = Sampling(temperature=1.0, seed=7)
    picker = ChildPicker(s, PickRule.DRAWN, columns=head)
    [first] = picker.pick(row[None], 3, position=1, salts=[0])
    assert first.dist.residual == 0.0 and set(first.dist.tokens) == set(q)
    for t, p in zip(first.dist.tokens, first.dist.probs):
        assert abs(p - q[t]) < 1e-6
    n, k = 24000, 3
    counts: dict[tuple, int] = {}
    for pos in range(4):
        for kids in picker.pick(row.expand(n // 4, -1), k, position=100 + pos, salts=range(n // 4)):
            counts[kids.tokens] = counts.get(kids.tokens, 0) + 1
    cells = list(itertools.permutations(q, k))

    def without_replacement(order) -> float:
        p, left = 1.0, 1.0
        for t in order:
            p *= q[t] / left
            left -= q[t]
        return p

    expected = [n * without_replacement(c) for c in cells]
    assert set(counts) <= set(cells)
    stat = sum((counts.get(c, 0) - e) ** 2 / e for c, e in zip(cells, expected))
    assert stat < chi2.ppf(0.999, len(cells) - 1), stat


# ---- end to end: the target's greedy output, token for token ---------------------------------------
def speculate(target, drafter, prompt, n):
    """Greedy speculative decoding in this process; returns (tokens, target forwards)."""
    slot = target.pool.alloc()
    try:
        root = int(target.prefill([slot], [prompt])[0].argmax())
        drafter.start("e2e", prompt)
        length, appended, outcome, out, forwards = len(prompt), (), None, [root], 0
        while len(out) < n:
            tree = drafter.draft(DraftCall("e2e", length, appended, root, outcome)).tree
            res = target.verify([slot], [tree])
            o = follow_target(tree, res.logits.argmax(-1).tolist())
            target.commit([(res.pending[0], list(o.accepted_nodes))])
            out += o.emitted(tree)
            appended = tuple(tree.tokens_along(o.accepted_nodes))
            length += len(o.accepted_nodes)
            root, outcome = o.bonus, Outcome(o.accepted_nodes, o.bonus)
            forwards += 1
            drafter.wait_idle(60)
        drafter.end("e2e")
        return out[:n], forwards
    finally:
        target.pool.free(slot)


@pytest.fixture(scope="module")
def target(tiny_pair):
    from models import HybridLM

    return HybridLM.from_pretrained(tiny_pair[0], max_slots=2, max_len=512)


@pytest.mark.parametrize("shape,ahead", [("dynamic", False), ("dynamic", True), ("static", True)])
def test_trimmed_self_drafting_gives_the_targets_greedy_output(tiny_pair, target, prompt, shape, ahead):
    """The drafter is the target checkpoint with half its vocabulary trimmed away: drafts agree
    with the target where its argmax is kept, the bonus token supplies the rest."""
    n = 40
    ids = kept_ids(VOCAB // 2, seed=6)
    model = trimmed_model(tiny_pair, ids, which=0)
    d = Drafter(model, Options(shape, 10, 4, ahead), ahead=AheadConfig(trees=2, fanout=2) if ahead else None)
    try:
        out, forwards = speculate(target, d, prompt, n)
    finally:
        d.close()
    ref = greedy_reference(target, prompt, n)
    assert out == ref
    assert forwards < n * 0.8  # drafts were accepted
    assert any(t not in set(ids) for t in ref)  # and the output has tokens the drafter can never propose


def test_cli_builds_a_trimmed_drafter(tiny_pair):
    from drafter_service.cli import add_arguments, build

    path = save(tiny_pair, kept_ids(50, seed=7))
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", str(tiny_pair[1]), "--trim-vocab", path, "--vocab-limit", "200",
                         "--max-sequences", "2", "--no-draft-ahead"])
    d = build(args)
    try:
        head = d.model.head
        assert head.vocab_size == 200 and head.size == sum(t < 200 for t in kept_ids(50, seed=7))
        d.start("c", [1, 2, 250 % 200, 3])
        tree = d.draft(DraftCall("c", 4, (), 7)).tree
        assert set(tree.tokens[1:]) <= set(head.ids.tolist())
        assert d.model.lm.graphs is None  # CPU: no CUDA graphs
    finally:
        d.close()
