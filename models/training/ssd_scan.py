"""Matmul form of the chunked Mamba2 (SSD) scan, used to make training on the reference path fast.

transformers' pure-PyTorch fallback for ``mamba_chunk_scan_combined`` builds its chunk products by
broadcasting and summing, which materialises ``(batch, chunks, Q, Q, heads, d_state)`` tensors and is
one to two orders of magnitude slower than it needs to be. ``chunk_scan`` computes the same function
with batched matrix products and group-shared B/C (no ``repeat_interleave``), in fp32 regardless of
autocast. ``fast_scan()`` swaps it into the Mamba2 and NemotronH modelling modules for the duration of
a training run; the checkpoints are unchanged standard ones, and tests compare it with the reference.

When ``mamba_ssm`` is installed transformers already uses its fused kernels and nothing is swapped.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator

import torch
import torch.nn.functional as F

_MODULES = (
    "transformers.models.mamba2.modeling_mamba2",
    "transformers.models.nemotron_h.modeling_nemotron_h",
)


def _segsum_exp(a: torch.Tensor) -> torch.Tensor:
    """``a (..., T)`` → ``(..., T, T)`` with ``[i, j] = exp(sum a[j+1 .. i])`` for ``j <= i``, else 0.

    The masked cumulative sum avoids subtracting two large cumulative sums.
    """
    t = a.shape[-1]
    strict = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(-1)
    seg = a[..., None, :].expand(*a.shape, t).transpose(-1, -2)  # [..., i, j] = a[i]
    seg = seg.masked_fill(~strict, 0.0).cumsum(dim=-2)
    lower = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(0)
    return torch.exp(seg.masked_fill(~lower, float("-inf")))


def chunk_scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    **_unused,
):
    """Selective state-space scan over whole sequences.

    hidden_states ``(b, L, H, P)``; dt ``(b, L, H)`` (raw unless already discretised); A ``(H,)``
    (negative); B, C ``(b, L, G, N)`` with ``H % G == 0``; D ``(H,)``; dt_bias ``(H,)``;
    initial_states ``(b, H, P, N)``. Returns y ``(b, L, H, P)`` fp32, and the final state
    ``(b, H, P, N)`` fp32 when ``return_final_states``. Same signature and result as transformers'
    reference ``mamba2_chunk_scan``.
    """
    if z is not None:
        raise NotImplementedError("gated output is applied by the caller's norm in Mamba2/NemotronH")
    with torch.autocast(device_type=hidden_states.device.type, enabled=False):
        return _chunk_scan_fp32(
            hidden_states, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus, dt_limit,
            return_final_states,
        )


def _chunk_scan_fp32(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus, dt_limit,
                     return_final_states):
    b, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    rep = nheads // ngroups
    q = chunk_size

    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])

    x = x.float()
    pad = (q - seqlen % q) % q
    xdt = x * dt[..., None]
    dA = dt * A.float()
    if pad:
        xdt = F.pad(xdt, (0, 0, 0, 0, 0, pad))
        dA = F.pad(dA, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    nc = (seqlen + pad) // q

    # Heads are split as (group, head-in-group) so B and C are shared without copying.
    xdt = xdt.view(b, nc, q, ngroups, rep, headdim).permute(0, 1, 3, 4, 2, 5)  # b c g r q p
    Bc = B.float().view(b, nc, q, ngroups, dstate).permute(0, 1, 3, 2, 4)  # b c g q n
    Cc = C.float().view(b, nc, q, ngroups, dstate).permute(0, 1, 3, 2, 4)  # b c g q n
    dA = dA.view(b, nc, q, ngroups, rep).permute(0, 1, 3, 4, 2)  # b c g r q
    dA_cs = dA.cumsum(dim=-1)

    # 1. within-chunk outputs: (L ∘ C Bᵀ) (dt x)
    decay_in = _segsum_exp(dA)  # b c g r q q
    scores = (Cc @ Bc.transpose(-1, -2))[:, :, :, None] * decay_in  # b c g r q q
    y = scores @ xdt  # b c g r q p

    # 2. state contributed by each chunk alone, decayed to the chunk's end
    decay_to_end = torch.exp(dA_cs[..., -1:] - dA_cs)  # b c g r q
    states = (xdt * decay_to_end[..., None]).transpose(-1, -2) @ Bc[:, :, :, None]  # b c g r p n

    # 3. carry states across chunks (few chunks: a small dense decay matrix)
    if initial_states is None:
        init = states.new_zeros(b, 1, ngroups, rep, headdim, dstate)
    else:
        init = initial_states.float().view(b, 1, ngroups, rep, headdim, dstate)
    states = torch.cat([init, states], dim=1)  # b (c+1) g r p n
    totals = F.pad(dA_cs[..., -1].permute(0, 2, 3, 1), (1, 0))  # b g r (c+1)
    chunk_decay = _segsum_exp(totals)  # b g r (c+1) (c+1)
    flat = states.permute(0, 2, 3, 1, 4, 5).reshape(b, ngroups, rep, nc + 1, headdim * dstate)
    carried = (chunk_decay @ flat).view(b, ngroups, rep, nc + 1, headdim, dstate)
    final_state = carried[:, :, :, -1]  # b g r p n
    prev = carried[:, :, :, :-1].permute(0, 3, 1, 2, 4, 5)  # b c g r p n

    # 4. contribution of the carried-in state: diag(exp(cumsum dA)) C h
    y_off = (Cc[:, :, :, None] @ prev.transpose(-1, -2)) * torch.exp(dA_cs)[..., None]  # b c g r q p
    y = y + y_off

    y = y.permute(0, 1, 4, 2, 3, 5).reshape(b, nc * q, nheads, headdim)[:, :seqlen]
    if D is not None:
        y = y + x * D.float()[:, None]
    if return_final_states:
        return y, final_state.reshape(b, nheads, headdim, dstate)
    return y


def _fused_kernels_available() -> bool:
    return importlib.util.find_spec("mamba_ssm") is not None


@contextlib.contextmanager
def fast_scan() -> Iterator[bool]:
    """Within the block, Mamba2 and NemotronH layers use ``chunk_scan``; yields whether it swapped."""
    if _fused_kernels_available():
        yield False
        return
    modules = [importlib.import_module(name) for name in _MODULES]
    saved = [m.mamba2_chunk_scan for m in modules]
    try:
        for m in modules:
            m.mamba2_chunk_scan = chunk_scan
        yield True
    finally:
        for m, fn in zip(modules, saved):
            m.mamba2_chunk_scan = fn
