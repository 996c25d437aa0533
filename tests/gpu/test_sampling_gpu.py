"""The sampling kernels compiled on the GPU against their twins on the CPU: the interpreted cases of
tests/kernels/test_sampling_kernels.py, then serving sizes (vocabularies of 32k to 152k, trees of
up to 64 nodes). Tokens must be equal: the uniforms are integer arithmetic, and the float64 sums of
the acceptance rule differ between devices only in their last bits."""
import random

import pytest
import torch

from kernels import gumbel_argmax as ga
from kernels import node_acceptance as na
from tests.gpu.marks import compiled_triton, gpu  # noqa: F401 (fixture)
from tests.kernels import test_sampling_kernels as cases
from tests.verifier.trees import random_tree, with_drafts
from treeserve import sampling
from verifier_service.results import multi_draft_walk


@gpu
@pytest.mark.parametrize("key", [0, 6, sampling.stream_key(2**62 + 12345, 3)])
def test_uniforms_bit_for_bit(key):
    cases.test_uniforms_equal_the_sampling_module_bit_for_bit(key, device="cuda")


@gpu
@pytest.mark.parametrize("case", cases.GUMBEL_CASES + [(8, 32000, torch.bfloat16, 1.0, 0, 11),
                                                       (3, 151936, torch.float32, 1 / 0.8, 50, 12),
                                                       (64, 50304, torch.float16, 1.0, 0, 13)])
def test_gumbel_argmax(case):
    cases.test_gumbel_argmax_equals_its_twin(case, device="cuda")


@gpu
def test_gumbel_argmax_edges():
    cases.test_gumbel_argmax_of_a_strided_view_and_a_one_hot_floor(device="cuda")
    cases.test_gumbel_argmax_excludes_minus_infinity(device="cuda")
    cases.test_gumbel_argmax_breaks_exact_ties_to_the_lower_index(device="cuda")


@gpu
@pytest.mark.parametrize("case", cases.ACCEPT_CASES + [("random", 64, 32000, "mixed"), ("star", 16, 151936, "far"),
                                                       ("deep", 64, 50304, "equal"), ("bushy", 33, 32000, "far")])
def test_accept_nodes(case):
    cases.test_accept_nodes_equals_its_twin(case, device="cuda")


@gpu
def test_accept_nodes_boundary():
    cases.test_accept_nodes_rejects_when_u_times_q_equals_p(device="cuda")


@gpu
def test_walk_on_the_gpu_equals_the_walk_on_the_cpu():
    rng = random.Random(7)
    vocab = 32000
    for t in range(20):
        tree = with_drafts(rng, random_tree(rng, rng.randrange(vocab), vocab, rng.randrange(1, 33)), vocab)
        probs = torch.softmax(torch.randn(tree.size, vocab, generator=torch.Generator().manual_seed(t)) * 3, -1)
        # the children's tokens likely under the target, so that walks go deep
        for i in range(1, tree.size):
            probs[tree.parents[i], tree.tokens[i]] += 0.5
        probs = probs / probs.sum(-1, keepdim=True)
        length, seed = rng.randrange(1 << 20), rng.randrange(1 << 40)
        assert multi_draft_walk(tree, probs.cuda(), length, seed) == multi_draft_walk(tree, probs, length, seed), t


@gpu
@pytest.mark.parametrize("top_logprobs", [0, 3])
def test_results_on_the_gpu_equal_the_results_on_the_cpu(top_logprobs):
    """`results.compute` on CUDA (kernels, pinned host-to-device copies) against the CPU (twins)."""
    from tests.verifier.test_results import VOCAB, queries
    from verifier_service import results

    qs = queries(random.Random(top_logprobs), top_logprobs)
    offsets = [0]
    for q in qs:
        offsets.append(offsets[-1] + q.tree.size)
    logits = torch.randn(offsets[-1], VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    on_gpu = results.compute(logits.cuda(), offsets, qs)
    on_cpu = results.compute(logits, offsets, qs)
    for g, c in zip(on_gpu, on_cpu):
        assert (g.target_tokens, g.walk) == (c.target_tokens, c.walk)
        assert [ids for ids, _ in g.top_logprobs] == [ids for ids, _ in c.top_logprobs]
