"""The few-row linear kernel on CUDA at the benchmark models' projection shapes, bf16 weights and
activations, both paths (one row; 2..64 rows on tensor cores, the reduction split): against the twin (fp32 sums, one
rounding) within one bf16 ulp, and the model's `linear` picks it up to its row limit. Also the
fused q/k RoPE at the 8B hybrid's attention shape.

    TRITON_INTERPRET=0 python -m pytest -q tests/gpu/test_linear_gpu.py
"""
import pytest
import torch

from kernels.few_rows_linear import MAX_ROWS, few_rows_linear, few_rows_linear_ref
from models.layers import linear as linear_mod
from tests.gpu.marks import compiled_triton, gpu  # noqa: F401 (fixture)

DEV, BF16 = "cuda", torch.bfloat16
SHAPES = [(2560, 10576), (5120, 2560), (4096, 1024), (14336, 4096), (2560, 50288)]  # (K, N)


@gpu
@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("M", [1, 2, 5, 16, 33, MAX_ROWS])
def test_matches_twin(K, N, M):
    gen = torch.Generator(device=DEV).manual_seed(K + N + M)
    W = (torch.randn(N, K, device=DEV, generator=gen) * K ** -0.5).to(BF16)
    x = torch.randn(M, K + 8, device=DEV, generator=gen).to(BF16)[:, 8:]
    b = torch.randn(N, device=DEV, generator=gen).to(BF16)
    got, want = few_rows_linear(x, W, b), few_rows_linear_ref(x, W, b)
    # both sum in fp32 (different order) and round once: at most one bf16 ulp apart, rarely
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-3)
    assert (got != want).float().mean().item() < 0.02


@gpu
@pytest.mark.parametrize("fresh_workspace", [False, True])
def test_split_reduction_in_a_cuda_graph(monkeypatch, fresh_workspace):
    """Replays of a captured launch equal the eager launch bit for bit (the partial sums are added
    in split order), the arrival counters end at zero, and a capture that finds no workspace runs
    unsplit rather than allocating inside the graph, giving the same y to fp32 rounding."""
    from kernels import few_rows_linear as frl

    if fresh_workspace:
        monkeypatch.setattr(frl.SplitWorkspace, "_by_device", {})
    else:  # one that must grow first
        monkeypatch.setattr(frl.SplitWorkspace, "_by_device", {})
        monkeypatch.setattr(frl.SplitWorkspace, "MIN_PARTS", 16)
    gen = torch.Generator(device=DEV).manual_seed(7)
    W = (torch.randn(2560, 5120, device=DEV, generator=gen) * 5120 ** -0.5).to(BF16)
    x = torch.randn(16, 5120, device=DEV, generator=gen).to(BF16)
    assert frl.dot_launch(16, 2560, 5120, 2)["splits"] > 1
    if not fresh_workspace:
        eager = few_rows_linear(x, W)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        y = few_rows_linear(x, W)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        if fresh_workspace:
            torch.testing.assert_close(y, few_rows_linear_ref(x, W), rtol=8e-3, atol=1e-3)
        else:
            assert torch.equal(y, eager)
    if not fresh_workspace:
        assert not frl.SplitWorkspace._by_device[x.device][1].any()
    else:
        assert x.device not in frl.SplitWorkspace._by_device


@gpu
def test_model_linear_uses_it_where_it_is_faster(monkeypatch):
    """1..DOT_ROWS rows of any layer, narrow or wide; more rows go to F.linear."""
    calls = []
    real = linear_mod.ops.few_rows_linear
    monkeypatch.setattr(linear_mod.ops, "few_rows_linear", lambda *a: calls.append(tuple(a[0].shape[:1]) + tuple(a[1].shape[:1])) or real(*a))
    narrow, wide = 4096, 50288
    for rows, out in ((1, wide), (2, narrow), (2, wide), (linear_mod.DOT_ROWS, wide), (linear_mod.DOT_ROWS + 1, narrow),
                      (linear_mod.DOT_ROWS + 1, wide)):
        y = linear_mod.linear(torch.randn(rows, 32, device=DEV), torch.randn(out, 32, device=DEV))
        assert y.shape == (rows, out)
    assert calls == [(1, wide), (2, narrow), (2, wide), (linear_mod.DOT_ROWS, wide)]


@gpu
@pytest.mark.parametrize("Dh,rotary", [(128, 128), (128, 64)])
def test_rope_qk_bf16(Dh, rotary):
    """The fused q/k RoPE at the 8B hybrid's attention shape, positions up to 8192.

    Against transformers' composition (the twin): within one bf16 ulp everywhere. Which way an
    element rounds depends on the last bits of cos/sin: the first H200 run saw a quarter of them
    round differently from the twin. So the rounding itself is checked against the same composition
    with cos/sin taken in float64 of the fp32 angle: the kernel must agree with that almost always."""
    from kernels.rope import apply_rope, rope_inv_freq, rope_qk, rope_qk_ref

    gen = torch.Generator(device=DEV).manual_seed(Dh + rotary)
    T, Hq, Hk = 64, 32, 8
    qkv = torch.randn(T, (Hq + 2 * Hk) * Dh, device=DEV, generator=gen).to(BF16)
    q, k = qkv[:, : Hq * Dh].view(T, Hq, Dh), qkv[:, Hq * Dh: (Hq + Hk) * Dh].view(T, Hk, Dh)
    positions = torch.randint(0, 8192, (T,), device=DEV, generator=gen)
    inv_freq = rope_inv_freq(rotary, 10000.0, DEV)
    angle = torch.cat([positions.float()[:, None] * inv_freq[None, :]] * 2, dim=-1).double()
    cos, sin = angle.cos().to(BF16), angle.sin().to(BF16)
    exact = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    for got, want, oracle in zip(rope_qk(q, k, positions, inv_freq), rope_qk_ref(q, k, positions, inv_freq), exact):
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
        print(f"rounded differently: from the twin {(got != want).float().mean().item():.4f}, "
              f"from the float64 cos/sin {(got != oracle).float().mean().item():.4f}, "
              f"twin from float64 {(want != oracle).float().mean().item():.4f}")
        assert (got != oracle).float().mean().item() < 0.02
