"""ssm_state_commit (Triton, interpreted) vs ssm_state_commit_ref vs the float64 sequential oracle."""
import random

import pytest
import torch

from kernels.ssd_tree import tree_ssd_scan
from kernels.ssm_commit import ssm_state_commit, ssm_state_commit_ref
from kernels.ssm_decode import ssm_chain_update
from tests.kernels import tree_cases
from tests.kernels.ssm_oracle import LIMIT, assert_close, commit_case, on, oracle_commit, tree_case, untouched_slots


def check(args, tol):
    pool0 = args["ssm_state"].clone()
    expected = oracle_commit(args)
    slots = args["slot_idx"].long()
    keep = untouched_slots(pool0, slots)
    for fn, name in ((ssm_state_commit_ref, "reference"), (ssm_state_commit, "triton")):
        args["ssm_state"] = pool0.clone()
        fn(**args)
        assert_close(args["ssm_state"][slots], expected, tol, f"{name} vs oracle")
        assert torch.equal(args["ssm_state"][keep], pool0[keep]), f"{name} touched other slots"


@pytest.mark.parametrize(
    "lens,K,H,P,N,G",
    [([1, 4, 2], 4, 4, 16, 16, 2), ([6, 1], 6, 2, 24, 40, 1), ([3], 3, 4, 8, 16, 4), ([2, 5], 5, 1, 32, 128, 1),
     ([20, 3, 17], 20, 2, 16, 16, 1)],  # past UNROLLED_STEPS: the loop over each path's own steps
)
def test_matches_oracle(lens, K, H, P, N, G):
    check(commit_case(lens, K, H, P, N, G, seed=sum(lens) + K), 1e-4)


def test_loop_equals_unrolled_steps():
    """The loop over a path's own steps (long paths) gives the unrolled program's states to the bit."""
    case = commit_case([1, 4, 2, 0], 4, 4, 16, 16, 2, seed=12)
    pool0 = case["ssm_state"].clone()
    unrolled, looped = pool0.clone(), pool0.clone()
    ssm_state_commit(**{**case, "ssm_state": unrolled})
    ssm_state_commit(**{**case, "ssm_state": looped}, unrolled_steps=0)
    assert torch.equal(looped, unrolled)
    assert not torch.equal(looped, pool0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_activations(dtype):
    check(commit_case([3, 1], 3, 4, 16, 32, 2, seed=8, dtype=dtype), 1e-3)


def test_large_dt_does_not_overflow():
    args = commit_case([4, 2], 4, 2, 16, 16, 1, seed=9, dt_scale=12.0, dt_shift=18.0, a_max=60.0)
    assert args["dt"].nan_to_num().max() > 30
    check(args, 1e-4)


@pytest.mark.parametrize("impl", [ssm_state_commit, ssm_state_commit_ref], ids=["triton", "reference"])
def test_layers_at_once(impl):
    """With a layer axis on every tensor, one call commits all layers: the same states as committing
    each layer on its own; a path of length 0 leaves its slot as it was."""
    L = 3
    case = commit_case([2, 3, 0], 3, 4, 16, 16, 2, seed=30, layers=L)
    pool = case["ssm_state"]
    before = pool.clone()
    impl(**case)
    for layer in range(L):
        want = before[:, layer].clone()
        one = {k: case[k][:, layer] for k in ("x", "dt", "B")}
        ssm_state_commit_ref(want, case["slot_idx"], **one, rows=case["rows"], path_len=case["path_len"],
                             A=case["A"][layer], dt_bias=case["dt_bias"][layer], dt_limit=LIMIT)
        assert_close(pool[:, layer], want, 1e-5, f"layer {layer}")
        alone = {**case, **one, "ssm_state": before[:, layer], "A": case["A"][layer], "dt_bias": case["dt_bias"][layer]}
        assert_close(pool[case["slot_idx"].long(), layer], oracle_commit(alone), 1e-4, f"layer {layer} vs oracle")
    idle = int(case["slot_idx"][2])
    assert torch.equal(pool[idle], before[idle])


@pytest.mark.parametrize("impl", [ssm_state_commit, ssm_state_commit_ref], ids=["triton", "reference"])
def test_padding_changes_no_bit(impl):
    """A CUDA graph commits a padded batch (paths padded to the bucket's step count with their last row,
    extra sequences of length 0): the committed states are the unpadded commit's to the bit."""
    case = commit_case([1, 2, 5, 3], 5, 4, 16, 16, 2, seed=31, slots=9)
    plain = case["ssm_state"].clone()
    impl(**{**case, "ssm_state": plain})
    K, extra = 8, 3
    rows = case["rows"]
    last = rows.gather(1, (case["path_len"].long() - 1).clamp(min=0)[:, None])
    padded_rows = torch.cat([rows, last.expand(-1, K - rows.shape[1])], 1)
    spare = [s for s in range(9) if s not in case["slot_idx"].tolist()][:1] * extra
    padded = case["ssm_state"].clone()
    impl(**{**case, "ssm_state": padded,
            "rows": torch.cat([padded_rows, torch.zeros(extra, K, dtype=rows.dtype)]),
            "slot_idx": torch.cat([case["slot_idx"], torch.tensor(spare, dtype=torch.int32)]),
            "path_len": torch.cat([case["path_len"], torch.zeros(extra, dtype=torch.int32)])})
    assert torch.equal(padded, plain)


def test_commit_then_decode_equals_sequential_decode():
    commit_then_decode("cpu", H=4, P=16, N=32, G=2, dtype=torch.float32, tol=1e-4)


def commit_then_decode(device, H, P, N, G, dtype, tol, seed=21):
    """Verify a tree, commit a random accepted branch, decode one more token: same as decoding the
    branch's tokens one by one from the same state (and the tree pass already gave their outputs)."""
    rng = random.Random(seed)
    args, lists = tree_case([(12, "random"), (9, "deep")], H, P, N, G, seed=seed, dtype=dtype, slots=4)
    a = on(args, device)
    cu = args["cu_seqlens"]
    y_tree = tree_ssd_scan(**a)
    paths = [tree_cases.random_branch(p, rng) for p in lists]
    K = max(len(p) for p in paths)
    rows = torch.zeros(2, K, dtype=torch.long)
    for b, path in enumerate(paths):
        rows[b, : len(path)] = torch.tensor(path) + int(cu[b])
    rows = rows.to(device)
    path_len = torch.tensor([len(p) for p in paths], dtype=torch.int32, device=device)
    x, dt, B, C, z = a["x"], a["dt"], a["B"], a["C"], a["z"]
    A, D, bias, slot_idx = a["A"], a["D"], a["dt_bias"], a["slot_idx"]
    committed = a["ssm_state"].clone()
    ssm_state_commit(committed, slot_idx, x, dt, B, rows, path_len, A, bias, LIMIT)

    gen = torch.Generator().manual_seed(seed + 1)
    nxt = [torch.randn(2, 1, *shape, generator=gen).to(device, dtype) for shape in ((H, P), (H,), (G, N), (G, N))]
    y_after = ssm_chain_update(committed, slot_idx, nxt[0], nxt[1], A, nxt[2], nxt[3], D, bias, LIMIT)

    for b, path in enumerate(paths):
        seq = a["ssm_state"].clone()
        r = rows[b, : len(path)]
        one = slot_idx[b : b + 1]
        y_seq = ssm_chain_update(seq, one, x[r][None], dt[r][None], A, B[r][None], C[r][None], D, bias, LIMIT,
                                 z=z[r][None])
        assert_close(y_tree[r], y_seq[0], tol, "tree outputs along the accepted path")
        y_next = ssm_chain_update(seq, one, *(t[b : b + 1] for t in nxt[:2]), A, *(t[b : b + 1] for t in nxt[2:]), D,
                                  bias, LIMIT)
        assert_close(y_after[b], y_next[0], tol, "decode after commit")
        slot = int(slot_idx[b])
        assert_close(committed[slot], seq[slot], tol, "state after commit + decode")
