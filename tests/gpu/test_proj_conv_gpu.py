"""in_proj + tree conv in one launch on CUDA at the benchmark models' layer shapes, bf16: the projection
bit for bit the few-row kernel's (the same loop and tiles), the stash bit for bit the projection's
columns, and the conv against the separate tree conv run on that projection (both sum the same taps
in the same order in fp32; allowed one bf16 ulp, on at most 1% of the elements). Eager and replayed
in a CUDA graph.

    TRITON_INTERPRET=0 python -m pytest -q tests/gpu/test_proj_conv_gpu.py
"""
from __future__ import annotations

import random

import pytest
import torch

from kernels import conv_tree as ct
from kernels.few_rows_linear import few_rows_linear
from kernels.proj_conv import MAX_CONV_ROWS, project_tree_conv
from tests.gpu.marks import compiled_triton, gpu  # noqa: F401 (fixture)
from tests.kernels.tree_cases import packed_batch

DEV, BF = "cuda", torch.bfloat16
# (d_model, z columns = d_inner, conv channels, carried dt columns): Mamba2-2.7B, the 8B hybrid's Mamba2 layers
SHAPES = [(2560, 5120, 5376, 80), (4096, 4096, 6144, 32)]
TREES = {2: [(2, "chain")], 16: [(16, "random")], 23: [(9, "deep"), (6, "star"), (1, "single"), (7, "bushy")],
         MAX_CONV_ROWS: [(MAX_CONV_ROWS, "random")]}


@gpu
@pytest.mark.parametrize("K,z_cols,D,carried", SHAPES)
@pytest.mark.parametrize("rows", sorted(TREES))
def test_matches_projection_then_conv(K, z_cols, D, carried, rows):
    rng = random.Random(rows + K)
    gen = torch.Generator(device=DEV).manual_seed(rows + K)
    parents, cu, max_nodes, lists = packed_batch(TREES[rows], rng, device=DEV)
    N = z_cols + D + carried
    h = torch.randn(rows, K, device=DEV, generator=gen).to(BF)
    W = (torch.randn(N, K, device=DEV, generator=gen) * K ** -0.5).to(BF)
    cw = (torch.randn(D, 4, device=DEV, generator=gen) * 0.5).to(BF)
    cb = torch.randn(D, device=DEV, generator=gen).to(BF)
    state = torch.randn(9, D, 4, device=DEV, generator=gen).to(BF)
    slots = torch.tensor(rng.sample(range(9), len(lists)), dtype=torch.int32, device=DEV)
    lens = torch.tensor([rng.choice([0, 2, rng.randrange(3, 500)]) for _ in lists], dtype=torch.int32, device=DEV)
    conv = (cw, cb, state, parents, cu, slots, lens, max_nodes)

    stash = torch.full((rows, N - z_cols), float("nan"), dtype=BF, device=DEV)
    y, got = project_tree_conv(h, W, None, z_cols, *conv, stash=stash)
    y_ref = few_rows_linear(h, W)
    want = ct.tree_conv1d(y_ref[:, z_cols:z_cols + D], *conv)
    assert torch.equal(y, y_ref) and torch.equal(stash, y[:, z_cols:])
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    assert (got != want).float().mean().item() < 0.01

    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        y_g, got_g = project_tree_conv(h, W, None, z_cols, *conv, stash=stash)
    torch.cuda.current_stream().wait_stream(stream)
    stash.fill_(float("nan"))
    got_g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_g, y) and torch.equal(got_g, got) and torch.equal(stash, y[:, z_cols:])
