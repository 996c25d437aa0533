"""Programmatic dependent launch (PDL, Hopper and later) for the short kernels of a decode step.

A decode step at batch 1 is a chain of a few hundred short kernels, each needing the output of the
one before. Launched plainly, a kernel starts only after the previous one has drained, so its
launch, its programs' start-up and the first loads of its weights all sit in the gap between them.
Launched with PDL, a kernel lets the next one start as soon as all of its own programs are running
(`release_next`), and the next one's programs do the work that does not depend on it (loading
weights) before they wait (`wait_for_previous`).

Every kernel launched with PDL (`**launch_options(device)`: `launch_pdl=True`, constexpr `PDL=True`)
keeps two rules:
- before `wait_for_previous` it reads only what no kernel of the step writes (weights; in a verify
  also the committed states and the tree tables, which only a later commit or the next step's
  inputs change) and writes nothing;
- it calls `release_next`, best at its start.
`wait_for_previous` returns once the previous kernel has completed and its writes are visible.
That kernel waited for its own predecessor before it wrote anything, so everything earlier on the
stream is complete too. Kernels not launched this way (torch's, cuBLAS's) release nothing early:
the kernel after one of them starts when it ends, as usual. CUDA graphs capture the dependency.

`TREESERVE_PDL=0` in the environment turns it off (the benchmarks compare both).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: compiled (not interpreted) kernels on a CUDA
    device of compute capability 9 or later, unless TREESERVE_PDL=0."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("TREESERVE_PDL", "1") == "0":
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """The two launch keywords of a PDL kernel on `device`, decided once: the constexpr `PDL` the
    kernel branches on and the launcher's `launch_pdl`."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def release_next(PDL: tl.constexpr):
    """Let the next kernel on the stream launch once every program of this one has got here."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Block until the previous kernel on the stream has completed and its writes are visible."""
    if PDL:
        gdc_wait()
