"""The sampling kernels against their PyTorch twins: counter-based uniforms bit for bit, seeded
Gumbel-max tokens, and the multi-draft acceptance outcome at every node of trees of every kind.
Runs interpreted on the CPU; tests/gpu/test_sampling_gpu.py runs the same cases compiled."""
from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

from kernels import gumbel_argmax as ga
from kernels import node_acceptance as na
from kernels.counter_noise import stream_mix, uniform
from tests.kernels.tree_cases import KINDS, make_parents
from treeserve import sampling

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


@triton.jit
def _uniforms_kernel(pos_ptr, idx_ptr, out_ptr, key, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    live = i < n
    pos = tl.load(pos_ptr + i, mask=live, other=0)
    idx = tl.load(idx_ptr + i, mask=live, other=0)
    tl.store(out_ptr + i, uniform(stream_mix(key.to(tl.int64)), pos, idx), mask=live)


def kernel_uniforms(key: int, positions: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    out = torch.full(positions.shape, -1.0, dtype=torch.float64, device=positions.device)
    n = positions.numel()
    _uniforms_kernel[(1,)](positions, index, out, key, n, BLOCK=triton.next_power_of_2(n))
    return out


@pytest.mark.parametrize("key", [0, 1, 6, sampling.stream_key(2**62 + 12345, 3), sampling.stream_key(-7, 1)])
def test_uniforms_equal_the_sampling_module_bit_for_bit(key, device="cpu"):
    g = torch.Generator().manual_seed(key & 0xFFFF)
    positions = torch.cat([torch.randint(0, 1 << 40, (40,), generator=g), torch.tensor([0, 1, (1 << 62) + 3])])
    index = torch.randint(0, 1 << 20, positions.shape, generator=g)
    got = kernel_uniforms(key, positions.to(device), index.to(device)).cpu()
    assert torch.equal(got, sampling.uniforms_keyed(key, positions, index))


# ---- seeded Gumbel-max -------------------------------------------------------------------------
GUMBEL_CASES = [  # rows, vocab, dtype, scale, top-k (0: no floor), key
    (1, 1, torch.float32, 1.0, 0, 1),
    (3, 5, torch.float32, 1.0 / 0.7, 2, 7),
    (5, 37, torch.float16, 2.0, 0, sampling.stream_key(99, 0)),
    (4, 1000, torch.float32, 0.5, 10, sampling.stream_key(2**61 + 1, 0)),
    (2, 2500, torch.bfloat16, 1.25, 0, 3),
    (6, 1030, torch.float32, 1.0, 1, 12),
    (2, 9000, torch.float32, 1.0, 5, 21),  # the vocabulary split over two programs
]


def gumbel_inputs(rows, vocab, dtype, scale, top_k, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    positions = torch.randint(0, 1 << 30, (rows,), generator=g)
    floor = None
    if top_k:
        z = logits.float() * torch.tensor(scale, dtype=torch.float32)
        floor = torch.topk(z, top_k, dim=-1).values[:, -1]
    return logits.to(device), (floor.to(device) if floor is not None else None), positions.to(device)


@pytest.mark.parametrize("case", GUMBEL_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{str(c[2])[6:]}-k{c[4]}")
def test_gumbel_argmax_equals_its_twin(case, device="cpu"):
    rows, vocab, dtype, scale, top_k, key = case
    for seed in range(3):
        logits, floor, positions = gumbel_inputs(rows, vocab, dtype, scale, top_k, seed, device)
        want = ga.gumbel_argmax_ref(logits.cpu(), scale, floor.cpu() if floor is not None else None, key, positions.cpu())
        got = ga.gumbel_argmax(logits, scale, floor, key, positions)
        assert torch.equal(got.cpu(), want), (seed, got, want)
        if top_k:
            assert (logits.float()[torch.arange(rows), got].cpu() * scale >= floor.cpu() - 1e-6).all()


def test_gumbel_argmax_of_a_strided_view_and_a_one_hot_floor(device="cpu"):
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5)).to(device)
    view = logits.t().contiguous().t()  # column-major: the kernel takes a copy
    positions = torch.arange(4, device=device)
    assert torch.equal(ga.gumbel_argmax(view, 1.0, None, 9, positions).cpu(),
                       ga.gumbel_argmax_ref(logits.cpu(), 1.0, None, 9, positions.cpu()))
    # a floor at each row's maximum leaves one token: the sample is the argmax
    floor = logits.max(-1).values
    assert torch.equal(ga.gumbel_argmax(logits, 1.0, floor, 9, positions), logits.argmax(-1))


def test_gumbel_argmax_excludes_minus_infinity(device="cpu"):
    """Log-probabilities with zeros (top-p's input): a token at -inf is never drawn."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 40, generator=g)
    logits[:, ::3] = float("-inf")
    positions = torch.arange(64) * 7
    want = ga.gumbel_argmax_ref(logits, 1.0, None, 5, positions)
    got = ga.gumbel_argmax(logits.to(device), 1.0, None, 5, positions.to(device))
    assert torch.equal(got.cpu(), want)
    assert (want % 3 != 0).all()


@pytest.mark.parametrize("scale", [1.0, 1.0 / 0.7, 1e5])
def test_gumbel_argmax_with_a_shift_equals_its_twin(scale, device="cpu"):
    """The row's largest logit as the shift (what sampling without top-k passes), also at a scale
    of 1e5 (temperature 1e-5), with rows of near ties and a vocabulary split over programs."""
    g = torch.Generator().manual_seed(11)
    for rows, vocab, dtype in ((4, 37, torch.float32), (3, 9000, torch.bfloat16), (6, 300, torch.float16)):
        logits = (torch.randn(rows, vocab, generator=g) * 3 + 10).to(dtype)
        logits[:, 1] = logits[:, 0]  # an exact tie at the top of a row, as often as not
        shift = logits.float().amax(-1)
        positions = torch.randint(0, 1 << 30, (rows,), generator=g)
        want = ga.gumbel_argmax_ref(logits, scale, None, 5, positions, shift=shift)
        got = ga.gumbel_argmax(logits.to(device), scale, None, 5, positions.to(device), shift=shift.to(device))
        assert torch.equal(got.cpu(), want)


def test_a_near_greedy_sample_breaks_a_tie_evenly():
    """Temperature 1e-5, logits [10, 10, -5]: half and half. Unshifted, z = 1e6 left float32 a
    spacing of 1/16, the noise was rounded away and the lower index won 50.7% of 400k draws."""
    from verifier_service.results import choose

    rows = 200_000
    logits = torch.tensor([10.0, 10.0, -5.0]).expand(rows, 3)
    tokens = choose(logits, sampling.Sampling(temperature=1e-5, seed=3), torch.arange(rows))
    first = (tokens == 0).double().mean().item()
    assert (tokens < 2).all() and abs(first - 0.5) < 0.005  # 4.5 standard deviations


def test_gumbel_argmax_refuses_mismatched_shapes():
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError, match="positions"):
        ga.gumbel_argmax(logits, 1.0, None, 1, torch.arange(2))
    with pytest.raises(ValueError, match="floor"):
        ga.gumbel_argmax(logits, 1.0, torch.zeros(2), 1, torch.arange(3))
    with pytest.raises(ValueError, match="shift"):
        ga.gumbel_argmax(logits, 1.0, None, 1, torch.arange(3), shift=torch.zeros(4))


# ---- node acceptance ---------------------------------------------------------------------------
def acceptance_inputs(kind: str, n: int, vocab: int, rng: random.Random, device="cpu", mode="mixed"):
    """p (N, V) float32, q (N, V) float64, children (N, M) for a tree of `kind`; `mode` sets how
    close q is to p: 'equal' (every first child accepted), 'far' (most rejected), 'mixed', or
    'half' (p = q / 2, unnormalised: a rejection leaves no residual mass, so p is kept)."""
    parents = make_parents(kind, n, rng)
    n = len(parents)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    p = torch.softmax(torch.randn(n, vocab, generator=g) * 2, -1)
    if mode == "equal":
        q = p.double().clone()
    elif mode == "half":
        q = p.double().clone()
        p = (q / 2).float()
    elif mode == "far":
        q = torch.softmax(torch.randn(n, vocab, generator=g) * 4, -1).double()
    else:
        q = torch.softmax(torch.log(p.double()) + torch.randn(n, vocab, generator=g, dtype=torch.float64), -1)
    kids = [[c for c in range(n) if parents[c] == i] for i in range(n)]
    width = max(1, max(len(k) for k in kids))
    children = torch.full((n, width), -1, dtype=torch.long)
    for i, k in enumerate(kids):
        if k and rng.random() < 0.9:  # now and then a node with children but no distribution
            toks = torch.multinomial(q[i], min(len(k), vocab), replacement=False, generator=g)
            children[i, : len(toks)] = toks
    positions = torch.randint(0, 1 << 20, (n,), generator=g)
    return p.to(device), q.to(device), children.to(device), positions.to(device)


ACCEPT_CASES = [(kind, n, vocab, mode) for kind in KINDS for n, vocab, mode in
                [(7, 50, "mixed"), (12, 300, "far"), (5, 1100, "equal")]] + [("random", 16, 2049, "far"), ("star", 9, 3, "far"),
                                                        ("chain", 4, 8200, "far"),  # the residual draw split in two
                                                        ("star", 12, 40, "half"), ("bushy", 10, 300, "half")]


@pytest.mark.parametrize("case", ACCEPT_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}")
def test_accept_nodes_equals_its_twin(case, device="cpu"):
    kind, n, vocab, mode = case
    rng = random.Random(f"{case}")
    for _ in range(2):
        p, q, children, positions = acceptance_inputs(kind, n, vocab, rng, device, mode)
        keys = (sampling.stream_key(rng.randrange(1 << 40), sampling.STREAM_ACCEPT),
                sampling.stream_key(rng.randrange(1 << 40), sampling.STREAM_RESIDUAL))
        want = na.accept_nodes_ref(p.cpu(), q.cpu(), children.cpu(), *keys, positions.cpu())
        q_before = q.clone()
        got = na.accept_nodes(p, q, children, *keys, positions)
        assert torch.equal(got.cpu(), want), (got, want)
        assert torch.equal(q, q_before)  # the kernel rewrites its own scratch, not the inputs
        chosen, token = want[:, 0], want[:, 1]
        accepted = chosen >= 0
        assert torch.equal(token[accepted], children.cpu()[accepted, chosen[accepted]])
        if mode == "equal":  # q == p: the first child is always accepted
            has = children.cpu()[:, 0] >= 0
            assert (chosen[has] == 0).all()


def test_accept_nodes_refuses_mismatched_shapes():
    p = torch.rand(3, 10)
    with pytest.raises(ValueError, match="p and q"):
        na.accept_nodes(p, torch.rand(3, 9, dtype=torch.float64), torch.zeros(3, 1, dtype=torch.long), 1, 2, torch.arange(3))
    with pytest.raises(ValueError, match="children"):
        na.accept_nodes(p, p.double(), torch.zeros(2, 1, dtype=torch.long), 1, 2, torch.arange(3))
    with pytest.raises(ValueError, match="positions"):
        na.accept_nodes(p, p.double(), torch.zeros(3, 1, dtype=torch.long), 1, 2, torch.arange(4))


def test_gumbel_argmax_breaks_exact_ties_to_the_lower_index(device="cpu"):
    """Two tokens whose uniforms collide and whose logits are equal, every other token below the
    floor: the sample is the lower index, as torch.argmax's ties go. The pair (found by a search
    over key 1 at position 77) sits 30 blocks of 1024 apart: in the same lane of one program, and
    in different programs when the vocabulary is split."""
    key, position, a, b = 1, 77, 63514, 94234
    vocab = b + 5
    u = sampling.uniforms_keyed(key, torch.full((2,), position), torch.tensor([a, b]))
    assert u[0] == u[1] and (b - a) % 1024 == 0
    logits = torch.zeros(1, vocab)
    logits[0, [a, b]] = 1.0
    floor = torch.tensor([0.5])
    want = ga.gumbel_argmax_ref(logits, 1.0, floor, key, torch.tensor([position]))
    assert want.item() == a
    at = torch.tensor([position], device=device)
    for splits in (1, 2, None):  # one lane of one program (twice: both in the second of two); apart
        got = ga.gumbel_max(logits.to(device), 1.0, floor.to(device), key, at, log_f64=False, splits=splits)
        assert got.item() == a, splits


def test_accept_nodes_rejects_when_u_times_q_equals_p(device="cpu"):
    """The rule accepts when u·q(tok) < p(tok): at equality it rejects (q one-hot on the child,
    p(tok) exactly the child's uniform)."""
    vocab, tok, key = 16, 3, sampling.stream_key(9, sampling.STREAM_ACCEPT)
    # a position whose uniform is below 1/2: an odd multiple of 2**-25 there is exact in float32
    position = next(t for t in range(100) if sampling.uniforms_keyed(key, torch.tensor([t]), 0).item() < 0.5)
    u = sampling.uniforms_keyed(key, torch.tensor([position]), 0).item()
    p = torch.full((1, vocab), (1.0 - u) / (vocab - 1), dtype=torch.float32)
    p[0, tok] = u
    assert p[0, tok].item() == u
    q = torch.zeros(1, vocab, dtype=torch.float64)
    q[0, tok] = 1.0
    children = torch.tensor([[tok]])
    args = (key, sampling.stream_key(9, sampling.STREAM_RESIDUAL), torch.tensor([position]))
    want = na.accept_nodes_ref(p, q, children, *args)
    got = na.accept_nodes(p.to(device), q.to(device), children.to(device), args[0], args[1], args[2].to(device))
    assert want[0, 0].item() == -1 and torch.equal(got.cpu(), want)
    p[0, tok] = u + 2.0 ** -24  # just above: accepted
    assert na.accept_nodes(p.to(device), q.to(device), children.to(device), args[0], args[1], args[2].to(device))[0, 0].item() == 0


def test_compiles_for_sm90():
    """The Gumbel-max and acceptance kernels, launched as above (fp32 and bf16 logits, with and
    without a top-k floor or a shift, vocabularies past one block), compile for an H100 without register
    spills (but one of 4 bytes); CI has no GPU, and these otherwise meet a compiler only in the GPU
    tests."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from tests.kernels.ssm_oracle import assert_compiles_for_sm90

    def run_all():
        for rows, vocab, dtype, top_k in ((3, 300, torch.float32, 0), (2, 5000, torch.bfloat16, 20)):
            logits, floor, positions = gumbel_inputs(rows, vocab, dtype, 0.7, top_k, seed=0)
            ga.gumbel_argmax(logits, 0.7, floor, 123, positions)
            ga.gumbel_argmax(logits, 0.7, None, 123, positions, shift=logits.float().amax(-1))
        rng = random.Random(3)
        for kind, n, vocab in (("random", 12, 300), ("chain", 4, 8200)):
            p, q, children, positions = acceptance_inputs(kind, n, vocab, rng, "cpu", "far")
            na.accept_nodes(p, q, children, 11, 12, positions)

    # the variants with a top-k floor or a shift spill 4 bytes (one register) at 1024-wide blocks:
    # known and bounded
    assert_compiles_for_sm90([ga._gumbel_max_kernel, na._accept_nodes_kernel], run_all,
                             spill_bytes=lambda spec: 4 if spec["constexprs"].get("HAS_FLOOR")
                             or spec["constexprs"].get("HAS_SHIFT") else 0)
