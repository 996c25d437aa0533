"""The matmul chunk scan against transformers' reference, and the swap-in context manager."""
from __future__ import annotations

import pytest
import torch

from models.training.ssd_scan import chunk_scan, fast_scan


def _inputs(b, L, H, P, G, N, with_state, seed=0):
    g = torch.Generator().manual_seed(seed)
    f = dict(dtype=torch.float64, generator=g)
    return dict(
        hidden_states=torch.randn(b, L, H, P, **f).requires_grad_(),
        dt=torch.randn(b, L, H, **f).requires_grad_(),
        A=-torch.rand(H, **f) * 4,
        B=torch.randn(b, L, G, N, **f).requires_grad_(),
        C=torch.randn(b, L, G, N, **f).requires_grad_(),
        D=torch.randn(H, **f),
        dt_bias=torch.randn(H, **f),
        initial_states=torch.randn(b, H, P, N, **f) if with_state else None,
    )


@pytest.mark.parametrize("shape", [
    # b, L, H, P, G, N, chunk, initial state
    (2, 37, 4, 8, 2, 16, 8, True),  # padded last chunk, groups
    (1, 64, 6, 4, 3, 8, 16, False),  # exact chunks
    (3, 5, 2, 8, 1, 4, 32, True),  # shorter than one chunk
])
def test_matches_reference_forward_and_backward(shape):
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan as reference

    b, L, H, P, G, N, q, with_state = shape
    x = _inputs(b, L, H, P, G, N, with_state)
    kw = dict(chunk_size=q, dt_softplus=True, dt_limit=(1e-3, float("inf")), return_final_states=True)
    y_ref, s_ref = reference(**x, **kw)
    y, s = chunk_scan(**x, **kw)
    # both compute in fp32 internally; the reference promotes its output with D's dtype
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=2e-5, check_dtype=False)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=2e-5, check_dtype=False)
    w = torch.randn_like(y_ref)
    leaves = [x["hidden_states"], x["dt"], x["B"], x["C"]]
    g_ref = torch.autograd.grad((y_ref * w).sum() + s_ref.sum(), leaves)
    g = torch.autograd.grad((y * w).sum() + s.sum(), leaves)
    for a, b_ in zip(g, g_ref):
        torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-4, check_dtype=False)


def test_output_without_final_state_is_fp32():
    x = _inputs(1, 10, 2, 4, 1, 4, False)
    y = chunk_scan(**{k: (v.float() if v is not None else None) for k, v in x.items()}, chunk_size=4)
    assert y.dtype == torch.float32 and y.shape == (1, 10, 2, 4)


def test_fast_scan_swaps_and_restores():
    import transformers.models.mamba2.modeling_mamba2 as m2
    import transformers.models.nemotron_h.modeling_nemotron_h as nh

    before = (m2.mamba2_chunk_scan, nh.mamba2_chunk_scan)
    with fast_scan() as swapped:
        assert swapped
        assert m2.mamba2_chunk_scan is chunk_scan and nh.mamba2_chunk_scan is chunk_scan
    assert (m2.mamba2_chunk_scan, nh.mamba2_chunk_scan) == before


def test_model_logits_unchanged_by_fast_scan():
    from models.training.presets import get_preset
    from models.training.train import build_model

    for name in ("tiny-target", "tiny-drafter"):
        model = build_model(get_preset(name), 300, seed=3).eval()
        ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = model(input_ids=ids).logits
            with fast_scan():
                got = model(input_ids=ids).logits
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
