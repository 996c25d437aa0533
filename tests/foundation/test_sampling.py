"""Sampling transform and counter-based randomness."""
from __future__ import annotations

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


def test_validation():
    for bad in (Sampling(temperature=-1), Sampling(top_k=-2), Sampling(top_p=1.5)):
        with pytest.raises(ValueError):
            bad.validate()


def test_uniforms_reproducible_and_uniform():
    pos = torch.arange(20000)
    u1 = sampling.uniforms(7, pos, sampling.STREAM_TARGET)
    u2 = sampling.uniforms(7, pos, sampling.STREAM_TARGET)
    assert torch.equal(u1, u2)
    assert not torch.equal(u1, sampling.uniforms(8, pos, sampling.STREAM_TARGET))
    assert not torch.equal(u1, sampling.uniforms(7, pos, sampling.STREAM_ACCEPT))
    assert ((u1 > 0) & (u1 < 1)).all()
    assert stats.kstest(u1.numpy(), "uniform").pvalue > 1e-3
