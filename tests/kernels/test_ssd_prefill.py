"""ssd_prefill (Triton, interpreted) vs ssd_prefill_ref vs the float64 sequential oracle."""
import pytest
import torch

from kernels import ssm_common
from kernels.ssd_prefill import ssd_prefill, ssd_prefill_ref
from tests.kernels.ssm_oracle import assert_close, nan_output, oracle_prefill, prefill_case


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(ssm_common, "new_output", nan_output)


def check(args, tol, chunk_size):
    y_exp, h_exp = oracle_prefill(args)
    init_before = None if args["initial_state"] is None else args["initial_state"].clone()
    for fn, name in ((ssd_prefill_ref, "reference"), (ssd_prefill, "triton")):
        y, h = fn(**args, chunk_size=chunk_size)
        assert y.dtype == args["x"].dtype and h.dtype == torch.float32
        assert_close(y, y_exp, tol, f"{name} y vs oracle")
        assert_close(h, h_exp, tol, f"{name} final state vs oracle")
    if init_before is not None:
        assert torch.equal(args["initial_state"], init_before), "initial_state must not be modified"


@pytest.mark.parametrize(
    "L,H,P,N,G,chunk",
    [(37, 4, 16, 16, 2, 16), (64, 2, 24, 40, 1, 32), (5, 4, 16, 32, 4, 16), (50, 1, 32, 128, 1, 64)],
)
def test_matches_oracle(L, H, P, N, G, chunk):
    check(prefill_case(L, H, P, N, G, seed=L), 1e-4, chunk)


def test_without_initial_state_gate_or_skip():
    args = prefill_case(40, 2, 16, 16, 1, seed=3, with_init=False, with_z=False)
    args["D"] = None
    check(args, 1e-4, 16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_activations(dtype):
    check(prefill_case(33, 2, 16, 32, 2, seed=4, dtype=dtype), 2e-2 if dtype == torch.bfloat16 else 4e-3, 16)


def test_large_dt_does_not_overflow():
    args = prefill_case(45, 2, 16, 16, 1, seed=5, dt_scale=12.0, dt_shift=18.0, a_max=60.0)
    assert args["dt"].max() > 30
    check(args, 1e-4, 16)


def split_in_two(fn, args, cut, chunk_size):
    """(y, final state) of the first `cut` tokens then the rest, passing the state between."""
    seq = ("x", "dt", "B", "C", "z")
    first = {k: (v[:cut] if k in seq and v is not None else v) for k, v in args.items()}
    rest = {k: (v[cut:] if k in seq and v is not None else v) for k, v in args.items()}
    y1, h1 = fn(**first, chunk_size=chunk_size)
    y2, h2 = fn(**{**rest, "initial_state": h1}, chunk_size=chunk_size)
    return torch.cat([y1, y2]), h2


@pytest.mark.parametrize("fn", [ssd_prefill_ref, ssd_prefill], ids=["reference", "triton"])
def test_two_halves_with_state_passing_equal_the_whole(fn):
    args = prefill_case(53, 2, 16, 32, 2, seed=6)
    y_all, h_all = fn(**args, chunk_size=16)
    y, h = split_in_two(fn, args, 21, 16)  # 21: not a chunk boundary
    assert_close(y, y_all, 1e-5, "y")
    assert_close(h, h_all, 1e-5, "final state")
