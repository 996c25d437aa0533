"""ssm_chain_update (Triton, interpreted) vs ssm_chain_update_ref vs the float64 sequential oracle."""
import pytest
import torch

from kernels import ssm_common
from kernels.ssm_decode import ssm_chain_update, ssm_chain_update_ref
from tests.kernels.ssm_oracle import assert_close, chain_case, nan_output, oracle_chain, untouched_slots


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(ssm_common, "new_output", nan_output)


def check(args, tol):
    pool0 = args["ssm_state"].clone()
    expected_y, expected_h = oracle_chain(args)
    slots = args["slot_idx"].long()
    keep = untouched_slots(pool0, slots)
    for fn, name in ((ssm_chain_update_ref, "reference"), (ssm_chain_update, "triton")):
        args["ssm_state"] = pool0.clone()
        y = fn(**args)
        assert y.dtype == args["x"].dtype
        assert_close(y, expected_y, tol, f"{name} y vs oracle")
        assert args["ssm_state"].dtype == torch.float32
        assert_close(args["ssm_state"][slots], expected_h, tol, f"{name} state vs oracle")
        assert torch.equal(args["ssm_state"][keep], pool0[keep]), f"{name} touched other slots"


@pytest.mark.parametrize(
    "nb,K,H,P,N,G",
    [(3, 1, 4, 16, 16, 2), (2, 5, 2, 24, 40, 1), (1, 3, 4, 8, 16, 4), (2, 1, 1, 64, 128, 1)],
)
def test_matches_oracle(nb, K, H, P, N, G):
    check(chain_case(nb, K, H, P, N, G, seed=nb * 100 + K), 1e-4)


def test_no_gate_no_skip():
    args = chain_case(2, 4, 2, 16, 16, 1, seed=7, with_z=False)
    args["D"] = None
    check(args, 1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_activations(dtype):
    check(chain_case(2, 3, 4, 16, 32, 2, seed=8, dtype=dtype), 2e-2 if dtype == torch.bfloat16 else 4e-3)


def test_large_dt_does_not_overflow():
    args = chain_case(2, 4, 2, 16, 16, 1, seed=9, dt_scale=12.0, dt_shift=18.0, a_max=60.0)
    assert args["dt"].max() > 30
    check(args, 1e-4)


def test_dt_limit_is_applied():
    args = chain_case(2, 3, 2, 16, 16, 1, seed=10, dt_scale=3.0)
    args["dt_limit"] = (0.05, 0.5)
    check(args, 1e-4)


def test_k_steps_at_once_equal_k_single_steps():
    args = chain_case(2, 4, 2, 16, 16, 2, seed=11)
    pool = args["ssm_state"].clone()
    y_all = ssm_chain_update(**args)
    steps = []
    for k in range(4):
        one = {**args, "ssm_state": pool}
        for key in ("x", "dt", "B", "C", "z"):
            one[key] = args[key][:, k : k + 1]
        steps.append(ssm_chain_update(**one))
    assert_close(torch.cat(steps, 1), y_all, 1e-5, "K steps at once vs one at a time")
    assert_close(pool, args["ssm_state"], 1e-5, "state")
