"""When kernels launch with programmatic dependent launch (kernels/pdl.py). The compile tests of each
kernel check the Hopper build carries the grid-dependency instructions; tests/gpu check the numbers
do not change."""
from __future__ import annotations

import torch

from kernels import pdl


def test_never_on_the_cpu_or_under_the_interpreter(monkeypatch):
    assert not pdl.enabled(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda", 0))  # decided before asking any driver


def test_the_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TREESERVE_PDL", "0")
    assert not pdl.enabled(torch.device("cuda", 0))
