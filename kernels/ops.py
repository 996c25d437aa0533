"""Pick a kernel implementation per call: Triton for CUDA tensors, the PyTorch twin otherwise.

`TREESERVE_KERNELS=triton` forces Triton (CPU tests run it under `TRITON_INTERPRET=1`);
`TREESERVE_KERNELS=reference` forces the twins everywhere (debugging on a GPU).
"""
from __future__ import annotations

import importlib
import os

import torch

# public name -> module that defines both `name` (Triton) and `name_ref` (PyTorch)
_HOME = {
    "tree_conv1d": "kernels.conv_tree",
    "conv_state_commit": "kernels.conv_tree",
    "conv1d_prefill": "kernels.conv_tree",
    "tree_ssd_scan": "kernels.ssd_tree",
    "tree_ssd_scan_deferred_norm": "kernels.ssd_tree",
    "ancestor_bits": "kernels.tree_struct",
    "ssm_state_commit": "kernels.ssm_commit",
    "ssm_chain_update": "kernels.ssm_decode",
    "mamba_decode_step": "kernels.mamba_decode",
    "mamba_decode_step_deferred_norm": "kernels.mamba_decode",
    "mamba_decode_step_gate_only": "kernels.mamba_decode",
    "ssd_prefill": "kernels.ssd_prefill",
    "write_tree_kv": "kernels.tree_attention",
    "tree_attention": "kernels.tree_attention",
    "kv_commit": "kernels.tree_attention",
    "rms_norm": "kernels.norms",
    "add_rms_norm": "kernels.norms",
    "gated_rms_norm": "kernels.norms",
    "few_rows_linear": "kernels.few_rows_linear",
    "project_tree_conv": "kernels.proj_conv",
    "rope_qk": "kernels.rope",
    "silu_mul": "kernels.silu_mul",
    "grow_level": "kernels.tree_growth",
    "gumbel_argmax": "kernels.gumbel_argmax",
    "accept_nodes": "kernels.node_acceptance",
}


def _mode() -> str:
    return os.environ.get("TREESERVE_KERNELS", "auto")


def runs_triton(device: torch.device) -> bool:
    """Whether kernels for tensors on `device` run in Triton (else their PyTorch twins)."""
    mode = _mode()
    return mode == "triton" or (mode == "auto" and device.type == "cuda")


def implementation(name: str, device: torch.device):
    """The function that runs kernel `name` for tensors on `device`."""
    module = importlib.import_module(_HOME[name])
    return getattr(module, name if runs_triton(device) else f"{name}_ref")


def _dispatcher(name: str):
    def call(*args, **kwargs):
        first = next(a for a in args if isinstance(a, torch.Tensor))
        return implementation(name, first.device)(*args, **kwargs)

    call.__name__ = name
    call.__doc__ = f"Dispatch to `{_HOME[name]}.{name}` (CUDA) or `{name}_ref` (CPU)."
    return call


tree_conv1d = _dispatcher("tree_conv1d")
conv_state_commit = _dispatcher("conv_state_commit")
conv1d_prefill = _dispatcher("conv1d_prefill")
tree_ssd_scan = _dispatcher("tree_ssd_scan")
tree_ssd_scan_deferred_norm = _dispatcher("tree_ssd_scan_deferred_norm")
ancestor_bits = _dispatcher("ancestor_bits")
ssm_state_commit = _dispatcher("ssm_state_commit")
ssm_chain_update = _dispatcher("ssm_chain_update")
mamba_decode_step = _dispatcher("mamba_decode_step")
mamba_decode_step_deferred_norm = _dispatcher("mamba_decode_step_deferred_norm")
mamba_decode_step_gate_only = _dispatcher("mamba_decode_step_gate_only")
ssd_prefill = _dispatcher("ssd_prefill")
write_tree_kv = _dispatcher("write_tree_kv")
tree_attention = _dispatcher("tree_attention")
kv_commit = _dispatcher("kv_commit")
rms_norm = _dispatcher("rms_norm")
add_rms_norm = _dispatcher("add_rms_norm")
gated_rms_norm = _dispatcher("gated_rms_norm")
few_rows_linear = _dispatcher("few_rows_linear")
project_tree_conv = _dispatcher("project_tree_conv")
rope_qk = _dispatcher("rope_qk")
silu_mul = _dispatcher("silu_mul")
grow_level = _dispatcher("grow_level")
gumbel_argmax = _dispatcher("gumbel_argmax")
accept_nodes = _dispatcher("accept_nodes")
