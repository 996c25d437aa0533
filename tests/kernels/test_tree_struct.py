"""ancestor_bits (Triton, interpreted) vs ancestor_bits_ref vs plain per-node parent walks."""
import random

import pytest
import torch

from kernels import tree_struct
from kernels.tree_index import ancestor_mask, depths
from kernels.tree_struct import ancestor_bits, ancestor_bits_ref, ancestor_mask_from_bits, words_per_row
from tests.kernels import tree_cases

POISON = 0x5A5A5A5A


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Unwritten output words show up as a pattern no tree produces (bits past the tree's size set)."""
    monkeypatch.setattr(tree_struct, "new_bits",
                        lambda T, W, device: torch.full((T, W), POISON, dtype=torch.int32, device=device))


def expected_bits(lists, max_nodes):
    """Bits from Python parent walks: word j // 32 of row t has bit j % 32 iff j is on t's root path."""
    W = words_per_row(max_nodes)
    rows = []
    for parents in lists:
        for i in range(len(parents)):
            words = [0] * W
            for j in tree_cases.path_to(parents, i):
                words[j // 32] |= 1 << (j % 32)
            rows.append([w - (1 << 32) if w >= 1 << 31 else w for w in words])
    return torch.tensor(rows, dtype=torch.int32)


def check(spec, seed, max_nodes=None):
    parents, cu, mx, lists = tree_cases.packed_batch(spec, random.Random(seed))
    mx = max_nodes or mx
    want = expected_bits(lists, mx)
    ref = ancestor_bits_ref(parents, cu, mx)
    out = ancestor_bits(parents, cu, mx)
    assert out.shape == (parents.numel(), words_per_row(mx)) and out.dtype == torch.int32
    assert torch.equal(ref, want), "reference vs parent walks"
    assert torch.equal(out, want), "triton vs parent walks"
    # the bits are the same relation as the dense masks the other twins use
    from_bits = ancestor_mask_from_bits(out, cu, mx)
    assert torch.equal(from_bits, ancestor_mask(parents, cu, mx))
    popcount = from_bits.sum(dim=2)  # (B, N)
    sizes = (cu[1:] - cu[:-1]).tolist()
    packed = torch.cat([popcount[b, :n] for b, n in enumerate(sizes)]) - 1
    assert torch.equal(packed, depths(parents, cu, mx))


@pytest.mark.parametrize("kind", tree_cases.KINDS)
@pytest.mark.parametrize("n", [1, 16, 31, 33, 64])
def test_every_tree_kind(kind, n):
    check([(n, kind)], seed=n)


def test_ragged_batch_of_every_kind():
    """Trees of different sizes packed together: each row only sees its own tree's local nodes."""
    check([(n, kind) for n, kind in zip((7, 1, 40, 33, 2, 17), tree_cases.KINDS)], seed=3)


@pytest.mark.parametrize("spec", [[(130, "deep"), (3, "star")], [(256, "chain")], [(256, "random"), (1, "single")],
                                  [(100, "bushy"), (65, "chain")]])
def test_several_words_per_row(spec):
    """Over 32 nodes: ancestors in several words, bit 31 (the sign bit) set along chains."""
    check(spec, seed=4)


def test_padded_tile_wider_than_the_trees():
    """max_nodes above every tree's size (as CUDA-graph buckets pass it): more words, all zero past the trees."""
    check([(5, "random"), (1, "single"), (9, "chain")], seed=5, max_nodes=128)


def test_chain_rows_are_prefixes():
    parents, cu, mx, _ = tree_cases.packed_batch([(70, "chain")], random.Random(0))
    m = ancestor_mask_from_bits(ancestor_bits(parents, cu, mx), cu, mx)[0]
    assert torch.equal(m, torch.tril(torch.ones(70, 70, dtype=torch.bool)))


def test_malformed_parents_still_terminate():
    """A parent at or after its child (never valid) ends the walk instead of looping forever."""
    parents = torch.tensor([-1, 0, 3, 2], dtype=torch.int32)  # node 2 points forward, 3 back to 2
    cu = torch.tensor([0, 4], dtype=torch.int32)
    out = ancestor_bits(parents, cu, 4)
    assert out[:2, 0].tolist() == [0b1, 0b11]
    assert out[2, 0].item() == 0b100 and out[3, 0].item() == 0b1100


def test_empty_batch():
    parents = torch.zeros(0, dtype=torch.int32)
    assert ancestor_bits(parents, torch.zeros(1, dtype=torch.int32), 1).shape == (0, 1)
