"""The bucketed static-buffer programs that CUDA graphs replay, run eagerly on CPU: padding of trees
and batches, the scratch slot, the shared stash, and the eager fallback must all leave results
unchanged."""
from __future__ import annotations

import random

import pytest
import torch

from models import HybridLM
from models.graphs import PREPARED_PATH, GraphRunner
from tests.models.hf_zoo import hf_logits, random_prompt
from tests.models.trees import random_tree


def _pair(path):
    plain = HybridLM.from_pretrained(path, max_slots=3, max_len=48)
    bucketed = HybridLM.from_pretrained(path, max_slots=3, max_len=48)
    bucketed.graphs = GraphRunner(bucketed, node_buckets=(1, 4, 8), capture=False)
    return plain, bucketed


@pytest.mark.parametrize("arch", ["bamba", "falcon_h1", "falcon_h1_norm", "zamba2", "zamba2_plain"])
def test_bucketed_steps_match_plain_steps(saved, arch):
    path, model = saved(arch)
    plain, bucketed = _pair(path)
    rng = random.Random(7)
    prompts = [random_prompt(rng, 5), random_prompt(rng, 8), random_prompt(rng, 3)]
    for lm in (plain, bucketed):
        slots = [lm.pool.alloc() for _ in prompts]
        assert slots == [0, 1, 2]
        lm.prefill(slots, prompts)
    seqs = [list(p) for p in prompts]
    for rnd in range(4):
        live = sorted(rng.sample(range(3), rng.randrange(1, 4)))
        if rnd % 2 == 0:
            toks = [rng.randrange(1, 96) for _ in live]
            a, b = plain.decode(live, toks), bucketed.decode(live, toks)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            for q, t in zip(live, toks):
                seqs[q].append(t)
            continue
        # sizes straddle the buckets; a 10-node tree takes the eager fallback
        trees = [random_tree(rng, rng.randrange(1, 96), rng.choice([1, 3, 5, 8, 10]), "random") for _ in live]
        ra, rb = plain.verify(live, trees), bucketed.verify(live, trees)
        assert ra.offsets == rb.offsets
        torch.testing.assert_close(ra.logits, rb.logits, rtol=1e-5, atol=1e-5)
        paths = [t.path_to(rng.randrange(t.size)) for t in trees]
        plain.commit([(ra.pending[i], p) for i, p in enumerate(paths)])
        bucketed.commit([(rb.pending[i], p) for i, p in enumerate(paths)])
        for q, t, p in zip(live, trees, paths):
            seqs[q] += t.tokens_along(p)
    toks = [3, 4, 5]
    out = bucketed.decode([0, 1, 2], toks)
    for q in range(3):
        ref = hf_logits(model, seqs[q] + [toks[q]])[-1]
        assert (out[q] - ref).abs().max() < 1e-4


def test_shared_stash_survives_a_second_verify(saved):
    """Two verify calls replay the same bucket before either commits: the first handle must still
    commit its own tree (its stash is copied out before the second replay)."""
    path, model = saved("nemotron_h")
    lm = HybridLM.from_pretrained(path, max_slots=2, max_len=48)
    lm.graphs = GraphRunner(lm, node_buckets=(4, 8), capture=False)
    rng = random.Random(8)
    prompts = [random_prompt(rng, 6), random_prompt(rng, 4)]
    slots = [lm.pool.alloc(), lm.pool.alloc()]
    lm.prefill(slots, prompts)
    t0, t1 = random_tree(rng, 9, 7, "random"), random_tree(rng, 10, 6, "chain")
    r0 = lm.verify([slots[0]], [t0])
    r1 = lm.verify([slots[1]], [t1])
    assert r0.pending[0].stash is not r1.pending[0].stash
    p0, p1 = t0.path_to(6), t1.path_to(5)
    lm.commit([(r0.pending[0], p0), (r1.pending[0], p1)])
    out = lm.decode(slots, [1, 2])
    for b, (p, t, path_) in enumerate(((prompts[0], t0, p0), (prompts[1], t1, p1))):
        ref = hf_logits(model, p + t.tokens_along(path_) + [b + 1])[-1]
        assert (out[b] - ref).abs().max() < 1e-4


def _record_pieces(runner) -> list:
    """Record (kind, tokens) of every piece `runner` runs a prompt as."""
    pieces = []
    for kind in ("chunk", "chain"):
        run = getattr(runner, f"_run_{kind}")
        setattr(runner, f"_run_{kind}",
                lambda g, slot, tokens, kind=kind, run=run: pieces.append((kind, len(tokens))) or run(g, slot, tokens))
    return pieces


@pytest.mark.parametrize("arch", ["mamba2", "nemotron_h", "bamba", "falcon_h1", "zamba2"])
def test_prompts_prefill_through_graphs_like_the_packed_prefill(saved, arch):
    """With graphs, prompts of up to `prefill_tokens` tokens each run in pieces: prefill chunks,
    largest first while they fit, then chains of at most the largest node bucket, each a verify and
    the commit of its whole path. They give the packed prefill's logits at each prompt's last
    token and leave its states and lengths, from an empty slot and after a history, alone and
    several together, whichever kind of piece comes last. Longer ones are prefilled packed."""
    path, model = saved(arch)
    plain, bucketed = _pair(path)
    bucketed.graphs = GraphRunner(bucketed, node_buckets=(1, 4, 8), capture=False, prefill_chunks=(5, 12),
                                  prefill_tokens=24)
    pieces = _record_pieces(bucketed.graphs)
    rng = random.Random(3)
    for lm in (plain, bucketed):
        assert [lm.pool.alloc() for _ in range(3)] == [0, 1, 2]
    seqs = [[], [], []]
    # the third call mixes a prompt under the cap (in pieces) with one past it (prefilled packed),
    # which comes first among the logits; the last prompt is exactly at the cap
    for slots, lengths in (([0], [13]), ([0, 1], [3, 9]), ([1, 2], [1, 25]), ([0, 2], [8, 4]), ([1], [24])):
        prompts = [random_prompt(rng, n) for n in lengths]
        ours, theirs = bucketed.prefill(slots, prompts), plain.prefill(slots, prompts)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        for s, p in zip(slots, prompts):
            seqs[s] += p
    assert pieces == [("chunk", 12), ("chain", 1), ("chain", 3), ("chunk", 5), ("chain", 4), ("chain", 1),
                      ("chunk", 5), ("chain", 3), ("chain", 4), ("chunk", 12), ("chunk", 12)], \
        "the 25-token prompt should have been prefilled packed, beside the 1-token one's chain"
    assert [bucketed.pool.length(s) for s in range(3)] == [len(q) for q in seqs]
    for name, t in _state(plain.pool).items():
        ours = getattr(bucketed.pool, name)
        for s in range(3):
            # K/V rows past a slot's length are free rows, where a verify leaves its padding
            real = (slice(s, s + 1), slice(0, len(seqs[s]))) if name in ("k", "v") else s
            torch.testing.assert_close(ours[real], t[real], rtol=1e-5, atol=1e-5, msg=f"{name} of slot {s}")
    out = bucketed.decode([0, 1], [5, 6])
    assert (out[0] - hf_logits(model, seqs[0] + [5])[-1]).abs().max() < 1e-4
    assert (out[1] - hf_logits(model, seqs[1] + [6])[-1]).abs().max() < 1e-4


def test_prefill_chunks_too_long_for_the_pool_or_the_cap_are_left_out(saved):
    """A chunk longer than a sequence may be is never kept, and one past the cap is never captured:
    no prompt could use it. Chunk sizes and the cap must make sense."""
    path, _ = saved("mamba2")
    lm = HybridLM.from_pretrained(path, max_slots=2, max_len=20)
    runner = GraphRunner(lm, node_buckets=(1, 4, 8), capture=False, prefill_chunks=(8, 16, 32, 8), prefill_tokens=12)
    assert runner.prefill_chunks == (16, 8)
    assert [(p.kind, p.n) for p in runner._pieces(19)] == [("chunk", 16), ("chain", 3)]
    runner.capture_prefill()
    assert sorted(runner._chunk) == [8] and sorted(runner._chain) == [1, 4, 8]
    for chunks, cap in (((0,), 8), ((-4, 8), 8), ((8,), -1), ((8,), None)):
        with pytest.raises(ValueError):
            GraphRunner(lm, node_buckets=(1, 4, 8), capture=False, prefill_chunks=chunks, prefill_tokens=cap)


def test_a_prompt_between_a_verify_and_its_commit_leaves_the_verify_alone(saved):
    """A request that joins while another's verified tree waits for its commit (the verifier
    commits with the next step): the prompt's chains write their own stash, so the commit still
    finds the verify's rows, and what follows is what follows without the prompt."""
    path, _ = saved("bamba")
    plain, bucketed = _pair(path)
    rng = random.Random(6)
    first, other = random_prompt(rng, 6), random_prompt(rng, 7)
    tree = random_tree(rng, rng.randrange(1, 96), 8, "random")  # a graph's tree, in the shared stash
    branch = tree.path_to(tree.size - 1)
    after = []
    for lm in (plain, bucketed):
        a, b = lm.pool.alloc(), lm.pool.alloc()
        lm.prefill([a], [first])
        res = lm.verify([a], [tree])
        lm.prefill([b], [other])
        lm.commit([(res.pending[0], branch)])
        after.append(lm.decode([a, b], [3, 4]))
    torch.testing.assert_close(after[1], after[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("failing", ["chain 4", "prefill 6"])
def test_a_prompt_with_a_piece_whose_graph_fails_is_prefilled_packed(saved, monkeypatch, failing):
    """A chain or chunk graph that cannot be captured leaves every prompt that needs it to the
    packed prefill whole, with nothing committed twice; prompts whose pieces have graphs still run
    through them."""
    path, _ = saved("bamba")
    plain, bucketed = _pair(path)
    runner = bucketed.graphs = GraphRunner(bucketed, node_buckets=(1, 4, 8), capture=False, prefill_chunks=(6,))
    pieces = _record_pieces(runner)
    try_capture = runner._try_capture
    monkeypatch.setattr(runner, "_try_capture",
                        lambda meta, program, what: None if what == failing else try_capture(meta, program, what))
    rng = random.Random(4)
    for lm in (plain, bucketed):
        lm.pool.alloc()
    # 13 tokens: chunks of 6 and 6, then a chain of 1; 3 and 2 tokens: a chain in the node bucket
    # of 4; 21 tokens: three chunks, then a chain of 3 (bucket 4)
    for n in (13, 3, 2, 21):
        prompt = random_prompt(rng, n)
        torch.testing.assert_close(bucketed.prefill([0], [prompt]), plain.prefill([0], [prompt]), rtol=1e-5, atol=1e-5)
    assert bucketed.pool.length(0) == 39
    if failing == "chain 4":
        assert pieces == [("chunk", 6), ("chunk", 6), ("chain", 1)] and runner._chain[4] is None
    else:
        assert pieces == [("chain", 3), ("chain", 2)] and runner._chunk[6] is None


def _state(pool) -> dict:
    return {n: getattr(pool, n).clone() for n in ("ssm", "conv", "k", "v") if getattr(pool, n, None) is not None}


@pytest.mark.parametrize("arch", ["bamba", "falcon_h1", "zamba2"])
def test_graph_commit_is_the_eager_commit_bit_for_bit(saved, arch):
    """The commit program a graph replays (padded batch, path steps padded to the bucket, attention
    rows padded past the last path) changes exactly what the eager commit changes, to the bit, and
    the graph path is the one taken for handles of the shared stash."""
    from models.verify import commit

    path, _ = saved(arch)  # Mamba2 and attention sublayers: every state kind
    lm = HybridLM.from_pretrained(path, max_slots=4, max_len=48)
    lm.graphs = GraphRunner(lm, node_buckets=(4, 8), capture=False)
    rng = random.Random(9)
    slots = [lm.pool.alloc() for _ in range(3)]
    lm.prefill(slots, [random_prompt(rng, n) for n in (5, 7, 4)])
    for kind, sizes in (("random", (8, 3, 6)), ("chain", (5, 7, 2)), ("star", (8, 8, 1))):
        trees = [random_tree(rng, rng.randrange(1, 96), n, kind) for n in sizes]
        res = lm.verify(slots, trees)
        paths = [t.path_to(rng.randrange(t.size)) for t in trees]
        items = [(res.pending[i], p) for i, p in enumerate(paths)]
        before, lengths, versions = _state(lm.pool), list(lm.pool._lengths), list(lm.pool._versions)
        commit(lm.pool, items, lm.A_all, lm.dt_bias_all, lm.dt_limit, graphs=None)
        eager = _state(lm.pool)
        for name, t in before.items():  # undo, and commit the same handles through the graph
            getattr(lm.pool, name).copy_(t)
        lm.pool._lengths[:], lm.pool._versions[:] = lengths, versions
        for p, _ in items:
            p.consumed = False
        taken, graph_commit = [], lm.graphs.commit
        lm.graphs.commit = lambda *a: taken.append(graph_commit(*a)) or taken[-1]
        lm.commit(items)
        del lm.graphs.commit
        assert taken == [True], "the commit did not replay a graph"
        for name, t in _state(lm.pool).items():
            assert torch.equal(t, eager[name]), name
        assert all(p.consumed for p, _ in items)
        assert [lm.pool.length(s) for s in slots] == [n + len(p) for n, p in zip(lengths, paths)]


def test_capture_all_takes_the_short_commits_before_the_first_commit(saved, monkeypatch):
    """After `capture_all`, a commit of any batch and of a path up to `PREPARED_PATH` steps replays
    a program captured then, and so does a prompt's chain commit of any length: none is captured on
    first use, and none falls back to eager."""
    path, _ = saved("bamba")
    lm = HybridLM.from_pretrained(path, max_slots=4, max_len=48)
    lm.graphs = GraphRunner(lm, node_buckets=(1, 4, 8, PREPARED_PATH, 2 * PREPARED_PATH), capture=False)
    lm.graphs.capture_all()
    assert set(lm.graphs._commit) == {(b, k) for b in lm.graphs.batch_buckets for k in (1, 4, 8, PREPARED_PATH)}
    assert set(lm.graphs._chain_commit) == {(1, k) for k in lm.graphs.node_buckets}

    def no_capture(*args):
        raise AssertionError(f"commit captured on first use: {args}")

    monkeypatch.setattr(lm.graphs, "_capture_commit", no_capture)
    replayed, graph_commit = [], lm.graphs.commit
    monkeypatch.setattr(lm.graphs, "commit", lambda *a: replayed.append(graph_commit(*a)) or replayed[-1])
    rng = random.Random(5)
    slots = [lm.pool.alloc() for _ in range(3)]
    lm.prefill(slots, [random_prompt(rng, n) for n in (5, 7, 4)])
    for count, size in ((1, 8), (3, 4), (2, 1), (1, PREPARED_PATH)):
        trees = [random_tree(rng, rng.randrange(1, 96), size, "chain") for _ in range(count)]
        res = lm.verify(slots[:count], trees)
        lm.commit([(res.pending[i], t.path_to(t.size - 1)) for i, t in enumerate(trees)])
    assert replayed == [True] * 7  # the three prompts' chain commits, then the four above


def test_eager_commit_rounds_its_path_axis_to_the_path_buckets(saved, monkeypatch):
    """The SSM commit kernel compiles a program per path axis length: an eager commit pads the axis
    to the graphs' path buckets (1, 4, 8, ...), so paths of 5..8 steps share one program, and the
    state is the one of the exact paths."""
    import models.verify as verify

    path, _ = saved("bamba")
    lm = HybridLM.from_pretrained(path, max_slots=4, max_len=48)
    assert lm.graphs is None
    steps, run = [], verify.run_commit

    def counted(pool, stash, meta, batch, k, *rest):
        steps.append(k)
        return run(pool, stash, meta, batch, k, *rest)

    monkeypatch.setattr(verify, "run_commit", counted)
    rng = random.Random(6)
    prompt = random_prompt(rng, 6)
    for n in (1, 3, 5, 8):
        slot = lm.pool.alloc()
        lm.prefill([slot], [prompt])
        tree = random_tree(rng, rng.randrange(1, 96), n, "chain")
        res = lm.verify([slot], [tree])
        lm.commit([(res.pending[0], tree.path_to(n - 1))])
        after = lm.decode([slot], [7])[0]
        lm.pool.free(slot)
        slot = lm.pool.alloc()
        lm.prefill([slot], [prompt + list(tree.tokens)])
        assert torch.allclose(lm.decode([slot], [7])[0], after, atol=1e-5), n
        lm.pool.free(slot)
    assert steps == [1, 4, 8, 8]
