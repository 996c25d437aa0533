"""Projections. Where our weight-streaming kernel (kernels/few_rows_linear.py) makes a step on CUDA
faster than cuBLAS does (measured in BENCHMARKS.md), the projection runs it; everything else is
F.linear:
- a single row (a decode step of one sequence, a one-node tree), any layer;
- 2..DOT_ROWS rows (a small tree, a small decode batch), any layer. On layers at most 4096 wide
  cuBLAS splits K and adds a reduction launch, where our split-K kernel reduces in its last program.
  On wider ones (the MLP's gate_up, qkv, the LM head) the two stream the weight about as fast, and
  ours keeps the step's chain of launches under programmatic dependent launch. With these on our
  kernel too, the 8B hybrid's 16-node verify took 0.09-0.25 ms less on an H100 (four pairs, two
  leases), and the 2.7B's moved by -0.16 to +0.01 ms (BENCHMARKS.md fourteenth round).
A Mamba2 verify of 2..32 nodes does not come here for its in_proj: it runs the dot path with the
tree conv in its epilogue (kernels/proj_conv.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import ops

DOT_ROWS = 16


def runs_kernel(rows: int) -> bool:
    """Whether a projection of `rows` rows on CUDA goes to our kernel."""
    return 1 <= rows <= DOT_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, in) -> (T, out) = x weight^T (+ bias), weight (out, in)."""
    if x.is_cuda and x.dim() == 2 and x.dtype == weight.dtype and runs_kernel(x.shape[0]):
        return ops.few_rows_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
