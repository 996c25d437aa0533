"""Projections. A single row on CUDA (a decode step of one sequence, a one-node tree) is a weight
stream, which our kernel reads faster than cuBLAS does (kernels/few_rows_linear.py, measured in
BENCHMARKS.md); everything else is F.linear."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import ops

# rows up to which the weight-streaming kernels beat cuBLAS at the benchmark models' shapes (H200,
# bench.few_rows_linear)
KERNEL_ROWS = 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, in) -> (T, out) = x weight^T (+ bias), weight (out, in)."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= KERNEL_ROWS and x.dtype == weight.dtype:
        return ops.few_rows_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
