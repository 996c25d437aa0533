"""grow_level compiled on the GPU vs its PyTorch twin on the same device, at the budgets a drafter
serves (up to 128 nodes) and in a CUDA graph."""
import random

import pytest
import torch

from kernels.tree_growth import Shape, grow_level, grow_level_ref
from tests.gpu.marks import compiled_triton, gpu  # noqa: F401 (fixture)
from tests.kernels import growth_runs


@gpu
@pytest.mark.parametrize("budget,depth,nodes", [(4, 3, 4), (16, 6, 16), (32, 6, 32), (64, 7, 64), (128, 3, 128)])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
def test_top_k_children(budget, depth, nodes, ties):
    for seed in range(4):
        growth_runs.run(Shape(budget, depth, nodes), seed, False, ties, grow_level, grow_level_ref, "cuda")


@gpu
@pytest.mark.parametrize("budget,depth,nodes,support", [(16, 5, 16, 64), (64, 4, 64, 64)])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
def test_drawn_children(budget, depth, nodes, support, ties):
    for seed in range(4):
        growth_runs.run(Shape(budget, depth, nodes, support), seed, True, ties, grow_level, grow_level_ref, "cuda")


@gpu
def test_replayed_from_a_cuda_graph():
    """One captured level, replayed on fresh children each level, gives the eager kernel's tables."""
    shape = Shape(16, 6, 16)
    rng = random.Random(1)
    tokens, probs = growth_runs.children(rng, shape.k, shape.k, False, "cuda")
    graphed = growth_runs.tables(shape, 5, 9, "cuda")
    eager = growth_runs.tables(shape, 5, 9, "cuda")
    grow_level(graphed, tokens, probs)  # compile outside the capture
    graphed.reset()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            grow_level(graphed, tokens, probs)
    graphed.reset()
    for _ in range(shape.depth):
        fresh_tokens, fresh_probs = growth_runs.children(rng, shape.k, shape.k, False, "cuda")
        tokens.copy_(fresh_tokens)
        probs.copy_(fresh_probs)
        graph.replay()
        grow_level(eager, fresh_tokens, fresh_probs)
        growth_runs.assert_same(graphed, eager)
        if int(eager.counts[1]) == 0:
            break
