"""Projections. Where our weight-streaming kernel reads the weight faster than cuBLAS on CUDA
(kernels/few_rows_linear.py, measured in BENCHMARKS.md), the projection runs it; everything else is
F.linear:
- a single row (a decode step of one sequence, a one-node tree), any layer;
- 2..DOT_ROWS rows (a small tree, a small decode batch) of a layer at most DOT_MAX_OUT wide. There
  cuBLAS splits K and adds a reduction launch; our split-K kernel reduces in its last program.
  Wider layers (in_proj, the MLP's gate_up) have enough output columns for cuBLAS to stream W
  without a split, and it is faster on them, or as fast.
A Mamba2 verify of 2..32 nodes does not come here for its in_proj: it runs the dot path with the
tree conv in its epilogue (kernels/proj_conv.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import ops

DOT_ROWS = 16
DOT_MAX_OUT = 4096


def runs_kernel(rows: int, out_features: int) -> bool:
    """Whether a (rows, ·) x (out_features, ·)ᵀ projection on CUDA goes to our kernel."""
    return rows == 1 or (rows <= DOT_ROWS and out_features <= DOT_MAX_OUT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, in) -> (T, out) = x weight^T (+ bias), weight (out, in)."""
    if x.is_cuda and x.dim() == 2 and x.dtype == weight.dtype and runs_kernel(x.shape[0], weight.shape[0]):
        return ops.few_rows_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
