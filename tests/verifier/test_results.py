"""The target's token at a position (`results.choose`: argmax, or the seeded sample that follows
the transformed distribution and depends only on seed and position), and `results.compute` over a
mixed batch (greedy, sampled with and without draft distributions, with and without top-k
log-probs), which must give each query what it would get alone: the packed transfer is read back
in the right order."""
from __future__ import annotations

import random

import pytest
import torch
from scipy import stats

from tests.verifier.trees import random_tree, with_drafts
from treeserve import sampling
from treeserve.sampling import Sampling
from verifier_service import results
from verifier_service.results import choose, multi_draft_walk

VOCAB = 50
# the interpreted kernels take log(0) = -inf for tokens top-k and top-p exclude
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


def test_greedy_is_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 3.0, 0.0]])
    assert choose(logits, Sampling(), torch.tensor([5, 6])).tolist() == [1, 0]

def test_sample_follows_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 40000
    tokens = choose(torch.log(probs).expand(n, 4), Sampling(1.0, seed=3), torch.arange(n))
    counts = torch.bincount(tokens, minlength=4).double()
    expected = probs.double() / probs.double().sum() * n
    assert stats.chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_sample_depends_only_on_seed_and_position():
    """The property that makes sampled speculation reproducible: the draw at a position does not
    depend on which batch or how many other rows it was computed with."""
    logits = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    s = Sampling(temperature=0.9, top_k=10, seed=11)
    positions = torch.tensor([4, 9, 9, 10, 17, 4])
    together = choose(logits, s, positions)
    alone = torch.cat([choose(logits[i : i + 1], s, positions[i : i + 1]) for i in range(6)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("s", [Sampling(temperature=0.7, seed=5), Sampling(temperature=1.3, top_k=3, seed=6),
                               Sampling(temperature=0.9, top_p=0.8, seed=7), Sampling(temperature=2.0, top_k=4, top_p=0.9, seed=8)],
                         ids=["temperature", "top-k", "top-p", "top-k-top-p"])
def test_choose_follows_the_transformed_distribution(s):
    """A sample is Gumbel-max over the scaled logits (top-k as a floor, top-p through `transform`):
    its tokens must follow `transform`'s probabilities, zeros included."""
    logits = torch.tensor([[1.5, 0.2, -0.4, 0.9, -1.2, 0.0]])
    n = 40000
    tokens = choose(logits.expand(n, 6), s, torch.arange(n) * 3)
    counts = torch.bincount(tokens, minlength=6).double()
    p = sampling.transform(logits, s)[0].double()
    assert (counts[p == 0] == 0).all(), counts
    live = p > 0
    expected = p / p[live].sum() * n
    assert stats.chisquare(counts[live].numpy(), expected[live].numpy()).pvalue > 1e-3


def queries(rng: random.Random, top_logprobs: int) -> list[results.NodeQuery]:
    plain = random_tree(rng, 3, VOCAB, 6)
    drafted = with_drafts(rng, random_tree(rng, 4, VOCAB, 9), VOCAB)
    return [
        results.NodeQuery(plain, 11, Sampling(), top_logprobs),
        results.NodeQuery(drafted, 20, Sampling(temperature=0.8, top_k=10, seed=5)),
        results.NodeQuery(plain, 7, Sampling(temperature=1.2, seed=6), top_logprobs),
        results.NodeQuery(with_drafts(rng, random_tree(rng, 9, VOCAB, 4), VOCAB), 3,
                          Sampling(temperature=1.0, top_p=0.9, seed=7), top_logprobs),
        results.NodeQuery(drafted, 20, Sampling()),  # greedy with drafts: no walk
    ]


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("top_logprobs", [0, 4], ids=["tokens", "with-top-logprobs"])
def test_a_mixed_batch_gives_each_query_its_own_results(top_logprobs, kernels, monkeypatch):
    monkeypatch.setenv("TREESERVE_KERNELS", kernels)
    rng = random.Random(top_logprobs)
    qs = queries(rng, top_logprobs)
    offsets = [0]
    for q in qs:
        offsets.append(offsets[-1] + q.tree.size)
    logits = torch.randn(offsets[-1], VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    got = results.compute(logits, offsets, qs)
    for b, q in enumerate(qs):
        rows = logits[offsets[b]:offsets[b + 1]]
        positions = torch.tensor(q.tree.depths()) + q.committed_length + 1
        assert got[b].target_tokens == choose(rows, q.sampling, positions).tolist(), b
        if q.tree.draft is not None and not q.sampling.greedy:
            want = multi_draft_walk(q.tree, sampling.transform(rows, q.sampling), q.committed_length, q.sampling.seed)
            assert got[b].walk == want, b
        else:
            assert got[b].walk is None
        if q.top_logprobs:
            top = torch.log_softmax(rows, -1).topk(q.top_logprobs, -1)
            assert [ids for ids, _ in got[b].top_logprobs] == top.indices.tolist(), b
            assert torch.allclose(torch.tensor([v for _, v in got[b].top_logprobs]), top.values)
        else:
            assert got[b].top_logprobs == []


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_the_warm_up_runs_every_sampled_kind(kernels, monkeypatch):
    """`warm_up` (what the verifier runs before serving, so that on CUDA the sampling kernels compile
    then) launches the Gumbel-max sample with and without a floor and the multi-draft acceptance."""
    monkeypatch.setenv("TREESERVE_KERNELS", kernels)
    launched = []
    for name in ("gumbel_argmax", "accept_nodes"):
        real = getattr(results.ops, name)
        monkeypatch.setattr(results.ops, name, lambda *a, _real=real, _name=name, **k: launched.append(
            (_name, a[2] is not None if _name == "gumbel_argmax" else None)) or _real(*a, **k))
    results.warm_up(VOCAB, "cpu")
    assert sorted(set(launched)) == [("accept_nodes", None), ("gumbel_argmax", False), ("gumbel_argmax", True)]
