"""Sampling transform and counter-based randomness."""
from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from treeserve import sampling
from treeserve.sampling import Sampling


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 3.0, 0.0]])
    probs = sampling.transform(logits, Sampling())
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    assert torch.allclose(sampling.transform(logits, Sampling(temperature=1.0)), torch.exp(logits))
    k2 = sampling.transform(logits, Sampling(temperature=1.0, top_k=2))
    assert torch.allclose(k2, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    # top_p 0.7: keep 0.5 (mass before 0) and 0.25 (mass before 0.5 < 0.7), drop 0.15 (before 0.75)
    p = sampling.transform(logits, Sampling(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    hot = sampling.transform(logits, Sampling(temperature=0.5))
    expected = torch.softmax(logits / 0.5, -1)
    assert torch.allclose(hot, expected)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (so -0.0 differs from 0.0), every NaN counting as one value."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@pytest.mark.parametrize("width", [1, 7, 300])
def test_transform_by_device_values_equals_transform_bit_for_bit(width):
    """The values in a tensor (one captured graph for every temperature, top-k and top-p) give the
    same probabilities as the settings themselves, including top-k at and past the width, top-p
    at 1 (off), ties, a row with a NaN and a row of -inf."""
    g = torch.Generator().manual_seed(width)
    logits = torch.randn(7, width, generator=g) * 5
    logits[0, : width // 2] = logits[0, 0]  # a run of ties
    logits[1, -1] = float("-inf")
    logits[2, width // 2] = float("nan")
    logits[3] = float("-inf")
    for temperature in (0.05, 0.7, 1.0, 2.5):
        for top_k in (0, 1, 3, width, width + 9):
            for top_p in (0.0, 0.3, 0.95, 1.0):
                s = Sampling(temperature, top_k, top_p).validate()
                got = sampling.transform_by(logits, sampling.transform_values(s), s.truncations)
                assert same_bits(got, sampling.transform(logits, s)), s


def test_truncations_name_what_applies():
    assert Sampling(1.0).truncations == sampling.Truncations(top_k=False, top_p=False)
    assert Sampling(1.0, top_k=5, top_p=1.0).truncations == sampling.Truncations(top_k=True, top_p=False)
    assert Sampling(0.5, top_p=0.9).truncations == sampling.Truncations(top_k=False, top_p=True)
    assert torch.equal(sampling.transform_values(Sampling()), torch.zeros(3))
    assert sampling.transform_values(Sampling(0.5, 4, 0.9)).tolist() == pytest.approx([2.0, 4.0, 0.9])


def test_top_k_then_top_p_by_hand():
    """Worked by hand, independent of `transform`: top-k first, then top-p over what top-k kept
    (renormalised): the smallest set of most likely tokens whose mass reaches top_p."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # top-k 2 keeps [e^2, e^1] / (e^2 + e^1) = [0.731, 0.269]: 0.731 alone reaches 0.7
    assert sampling.transform(logits, Sampling(temperature=1.0, top_k=2, top_p=0.7)).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    # top-p 0.75 over all four ([0.644, 0.237, 0.087, 0.032]) needs the first two, 0.881 of the mass
    e = torch.exp(logits[0]).tolist()
    want = [e[0] / (e[0] + e[1]), e[1] / (e[0] + e[1]), 0.0, 0.0]
    assert sampling.transform(logits, Sampling(temperature=1.0, top_p=0.75)).tolist()[0] == pytest.approx(want)
    # probabilities 0.5, 0.25, 0.15, 0.1: just under 0.75 two tokens reach it, just over it three
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    under = sampling.transform(logits, Sampling(temperature=1.0, top_p=0.7499)).tolist()[0]
    over = sampling.transform(logits, Sampling(temperature=1.0, top_p=0.7501)).tolist()[0]
    assert under == pytest.approx([2 / 3, 1 / 3, 0.0, 0.0])
    assert over == pytest.approx([0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.0])
    # and temperature before both: T = 0.5 doubles the logits
    sharp = sampling.transform(torch.tensor([[1.0, 0.5, 0.0]]), Sampling(temperature=0.5, top_k=2)).tolist()[0]
    assert sharp == pytest.approx([math.e / (math.e + 1), 1 / (math.e + 1), 0.0])


@pytest.mark.parametrize("temperature", [1e-39, 1e-30, 1e-6])
def test_a_temperature_too_small_to_scale_by_is_greedy(temperature):
    """1 / temperature would overflow float32 logits (NaN probabilities, tokens that are not the
    target's); below MIN_TEMPERATURE the settings are greedy, the limit they tend to."""
    logits = torch.tensor([[400.0, 2.0, -1.0, 399.0]])
    s = Sampling(temperature=temperature, seed=3).validate()
    assert s.greedy
    assert sampling.transform(logits, s).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert not Sampling(temperature=sampling.MIN_TEMPERATURE).greedy


def test_validation():
    for bad in (Sampling(temperature=-1), Sampling(top_k=-2), Sampling(top_p=1.5),
                Sampling(temperature=math.inf), Sampling(temperature=1e46), Sampling(temperature=math.nan)):
        with pytest.raises(ValueError):
            bad.validate()
    assert Sampling(temperature=sampling.MAX_TEMPERATURE).validate()


def test_seeds_far_apart_do_not_share_a_stream():
    """With `seed * 4 + stream` as the key, seeds 2**62 apart drew the same numbers."""
    pos = torch.arange(64)
    for seed in (5, 2**40 + 3):
        for far in (seed + 2**62, seed + 3 * 2**62):
            assert sampling.stream_key(seed, 0) != sampling.stream_key(far, 0)
            assert not torch.equal(sampling.uniforms(seed, pos, 0), sampling.uniforms(far, pos, 0))
    keys = {sampling.stream_key(seed, stream) for seed in range(2000) for stream in range(4)}
    assert len(keys) == 8000


def test_uniforms_reproducible_and_uniform():
    pos = torch.arange(20000)
    u1 = sampling.uniforms(7, pos, sampling.STREAM_TARGET)
    u2 = sampling.uniforms(7, pos, sampling.STREAM_TARGET)
    assert torch.equal(u1, u2)
    assert not torch.equal(u1, sampling.uniforms(8, pos, sampling.STREAM_TARGET))
    assert not torch.equal(u1, sampling.uniforms(7, pos, sampling.STREAM_ACCEPT))
    assert ((u1 > 0) & (u1 < 1)).all()
    assert stats.kstest(u1.numpy(), "uniform").pvalue > 1e-3
